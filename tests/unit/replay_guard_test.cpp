#include "cellblock/replay_guard.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>

namespace cellblock {
namespace {

// A distinct, well-formed 64-hex-character signature for each n.
std::string sig(unsigned n) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016x", n);
    return std::string(48, 'a') + buf;
}

TEST(ReplayGuard, AcceptsOnceThenRejects) {
    ReplayGuard g;
    EXPECT_TRUE(g.check_and_remember(sig(1)));
    EXPECT_FALSE(g.check_and_remember(sig(1)));
    EXPECT_FALSE(g.check_and_remember(sig(1)));
    EXPECT_TRUE(g.check_and_remember(sig(2)));
    EXPECT_EQ(g.size(), 2u);
}

TEST(ReplayGuard, DefaultCapacityIs65536) {
    ReplayGuard g;
    EXPECT_EQ(g.capacity(), 65536u);
}

TEST(ReplayGuard, CaseOfHexDoesNotMatter) {
    ReplayGuard g;
    std::string s = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    EXPECT_TRUE(g.check_and_remember(s));
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    EXPECT_TRUE(g.contains(s));
    EXPECT_FALSE(g.check_and_remember(s));
    EXPECT_EQ(g.size(), 1u);
}

TEST(ReplayGuard, EmptySignatureAlwaysAcceptedNeverStored) {
    ReplayGuard g;
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(g.check_and_remember(""));
    EXPECT_EQ(g.size(), 0u);
    EXPECT_FALSE(g.contains(""));
}

TEST(ReplayGuard, MalformedInputIsRefusedAndNotStored) {
    ReplayGuard g;
    const std::string good = sig(7);
    EXPECT_FALSE(g.check_and_remember(good.substr(0, 63)));
    EXPECT_FALSE(g.check_and_remember(good + "0"));
    EXPECT_FALSE(g.check_and_remember("abc"));
    std::string non_hex = good;
    non_hex[5] = 'z';
    EXPECT_FALSE(g.check_and_remember(non_hex));
    non_hex[5] = '\0';
    EXPECT_FALSE(g.check_and_remember(non_hex));
    EXPECT_EQ(g.size(), 0u);
    EXPECT_FALSE(g.contains(good.substr(0, 63)));
    EXPECT_TRUE(g.check_and_remember(good));
}

TEST(ReplayGuard, ContainsDoesNotRemember) {
    ReplayGuard g;
    EXPECT_FALSE(g.contains(sig(3)));
    EXPECT_EQ(g.size(), 0u);
    EXPECT_TRUE(g.check_and_remember(sig(3)));
    EXPECT_TRUE(g.contains(sig(3)));
    EXPECT_FALSE(g.contains(sig(4)));
}

TEST(ReplayGuard, EvictsOldestFirstAtCapacity) {
    ReplayGuard g(3);
    EXPECT_TRUE(g.check_and_remember(sig(1)));
    EXPECT_TRUE(g.check_and_remember(sig(2)));
    EXPECT_TRUE(g.check_and_remember(sig(3)));
    EXPECT_EQ(g.size(), 3u);
    EXPECT_TRUE(g.check_and_remember(sig(4)));  // evicts 1
    EXPECT_EQ(g.size(), 3u);
    EXPECT_FALSE(g.contains(sig(1)));
    EXPECT_TRUE(g.contains(sig(2)));
    EXPECT_TRUE(g.contains(sig(3)));
    EXPECT_TRUE(g.contains(sig(4)));
    // A rejected replay does not refresh or reorder anything.
    EXPECT_FALSE(g.check_and_remember(sig(2)));
    EXPECT_TRUE(g.check_and_remember(sig(5)));  // evicts 2, the oldest
    EXPECT_FALSE(g.contains(sig(2)));
    EXPECT_TRUE(g.contains(sig(3)));
    EXPECT_TRUE(g.check_and_remember(sig(1)));  // evicted long ago, so accepted
}

TEST(ReplayGuard, SizeStaysBounded) {
    ReplayGuard g(100);
    for (unsigned i = 0; i < 10000; ++i) ASSERT_TRUE(g.check_and_remember(sig(i)));
    EXPECT_EQ(g.size(), 100u);
    EXPECT_EQ(g.capacity(), 100u);
    EXPECT_TRUE(g.contains(sig(9999)));
    EXPECT_TRUE(g.contains(sig(9900)));
    EXPECT_FALSE(g.contains(sig(9899)));
}

TEST(ReplayGuard, ZeroCapacityStillRejectsImmediateReplay) {
    ReplayGuard g(0);
    EXPECT_EQ(g.capacity(), 1u);
    EXPECT_TRUE(g.check_and_remember(sig(1)));
    EXPECT_FALSE(g.check_and_remember(sig(1)));
}

}  // namespace
}  // namespace cellblock
