#include "cellblock/signer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cellblock {
namespace {

using namespace std::string_literals;

bool is_lower_hex(const std::string& s) {
    return std::all_of(s.begin(), s.end(),
                       [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string upper(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    return s;
}

// RFC 4231 HMAC-SHA256 test cases. The protocol signs the concatenation of
// the four frames, so the RFC's message is split across them.
TEST(Signer, MatchesRfc4231Case1) {
    Signer s(std::string(20, '\x0b'));
    EXPECT_EQ(s.sign("Hi", " ", "The", "re"),
              "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(Signer, MatchesRfc4231Case2WhateverTheSplit) {
    const std::string expected = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
    Signer s("Jefe");
    EXPECT_EQ(s.sign("what do ya want ", "for ", "nothing", "?"), expected);
    EXPECT_EQ(s.sign("what do ya want for nothing?", "", "", ""), expected);
    EXPECT_EQ(s.sign("", "", "", "what do ya want for nothing?"), expected);
}

TEST(Signer, MatchesRfc4231Case6KeyLongerThanBlock) {
    Signer s(std::string(131, '\xaa'));
    EXPECT_EQ(s.sign("Test Using Larger Than ", "Block-Size Key - ", "Hash Key ", "First"),
              "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Signer, SignatureIs64LowercaseHexAndVerifies) {
    Signer s("secret");
    const std::string sig = s.sign("{\"a\":1}", "{}", "{}", "{\"code\":\"x\"}");
    ASSERT_EQ(sig.size(), 64u);
    EXPECT_TRUE(is_lower_hex(sig)) << sig;
    EXPECT_TRUE(s.enabled());
    EXPECT_TRUE(s.verify(sig, "{\"a\":1}", "{}", "{}", "{\"code\":\"x\"}"));
}

TEST(Signer, SigningIsDeterministicAndKeyDependent) {
    Signer a("key-a");
    Signer b("key-b");
    EXPECT_EQ(a.sign("h", "p", "m", "c"), a.sign("h", "p", "m", "c"));
    EXPECT_NE(a.sign("h", "p", "m", "c"), b.sign("h", "p", "m", "c"));
    EXPECT_FALSE(b.verify(a.sign("h", "p", "m", "c"), "h", "p", "m", "c"));
}

TEST(Signer, KeyBytesAfterNulCount) {
    Signer a("ab\0cd"s);
    Signer b(std::string("ab"));
    EXPECT_NE(a.sign("h", "p", "m", "c"), b.sign("h", "p", "m", "c"));
}

TEST(Signer, RejectsAnyChangedFrame) {
    Signer s("secret");
    const std::string sig = s.sign("header", "parent", "metadata", "content");
    EXPECT_FALSE(s.verify(sig, "Header", "parent", "metadata", "content"));
    EXPECT_FALSE(s.verify(sig, "header", "parent!", "metadata", "content"));
    EXPECT_FALSE(s.verify(sig, "header", "parent", "", "content"));
    EXPECT_FALSE(s.verify(sig, "header", "parent", "metadata", "content "));
}

// The wire protocol signs a plain concatenation (jupyter_client does the
// same), so moving bytes across a frame boundary keeps the signature valid.
// JSON parsing of each frame is what rejects such a message.
TEST(Signer, FrameBoundariesAreNotSigned) {
    Signer s("secret");
    const std::string sig = s.sign("{}{", "}", "{}", "{}");
    EXPECT_TRUE(s.verify(sig, "{}", "{}", "{}", "{}"));
}

TEST(Signer, RejectsWrongLengthSignatures) {
    Signer s("secret");
    const std::string sig = s.sign("h", "p", "m", "c");
    EXPECT_FALSE(s.verify("", "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify(sig.substr(0, 63), "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify(sig.substr(0, 32), "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify(sig + "0", "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify(sig + "\n", "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify(sig + sig, "h", "p", "m", "c"));
}

TEST(Signer, RejectsUppercaseAndNonHex) {
    Signer s("secret");
    const std::string content = "c";
    const std::string sig = s.sign("h", "p", "m", content);
    ASSERT_NE(sig, upper(sig));  // it has hex letters to change
    EXPECT_FALSE(s.verify(upper(sig), "h", "p", "m", content));

    std::string bad = sig;
    bad[10] = 'g';
    EXPECT_FALSE(s.verify(bad, "h", "p", "m", content));
    bad[10] = ' ';
    EXPECT_FALSE(s.verify(bad, "h", "p", "m", content));
    bad[10] = '\0';
    EXPECT_FALSE(s.verify(bad, "h", "p", "m", content));
    EXPECT_TRUE(s.verify(sig, "h", "p", "m", content));
}

TEST(Signer, RejectsAFlippedDigit) {
    Signer s("secret");
    const std::string sig = s.sign("h", "p", "m", "c");
    for (std::size_t i : {std::size_t{0}, std::size_t{31}, std::size_t{63}}) {
        std::string bad = sig;
        bad[i] = bad[i] == '0' ? '1' : '0';
        EXPECT_FALSE(s.verify(bad, "h", "p", "m", "c")) << "position " << i;
    }
}

TEST(Signer, EmptyKeyDisablesSigning) {
    Signer s("");
    EXPECT_FALSE(s.enabled());
    EXPECT_EQ(s.sign("h", "p", "m", "c"), "");
    EXPECT_TRUE(s.verify("", "h", "p", "m", "c"));
    // With signing off only an empty signature is accepted.
    const std::string other = Signer("k").sign("h", "p", "m", "c");
    EXPECT_FALSE(s.verify(other, "h", "p", "m", "c"));
    EXPECT_FALSE(s.verify("x", "h", "p", "m", "c"));
}

TEST(Signer, UnsupportedSchemeThrows) {
    EXPECT_THROW(Signer("k", "hmac-md5"), std::invalid_argument);
    EXPECT_THROW(Signer("k", "HMAC-SHA256"), std::invalid_argument);
    EXPECT_THROW(Signer("k", ""), std::invalid_argument);
    EXPECT_THROW(Signer("", "hmac-sha1"), std::invalid_argument);
    EXPECT_NO_THROW(Signer("k", "hmac-sha256"));
}

TEST(Signer, MoveKeepsTheKeyAndMovedFromFailsClosed) {
    Signer a("secret");
    const std::string sig = a.sign("h", "p", "m", "c");
    Signer b(std::move(a));
    EXPECT_TRUE(b.enabled());
    EXPECT_EQ(b.sign("h", "p", "m", "c"), sig);
    // A moved-from signer must not turn into "signing disabled".
    EXPECT_FALSE(a.verify("", "h", "p", "m", "c"));  // NOLINT(bugprone-use-after-move)
    EXPECT_FALSE(a.verify(sig, "h", "p", "m", "c"));
    EXPECT_THROW(a.sign("h", "p", "m", "c"), std::logic_error);

    Signer c("other");
    c = std::move(b);
    EXPECT_TRUE(c.verify(sig, "h", "p", "m", "c"));
    EXPECT_FALSE(b.verify(sig, "h", "p", "m", "c"));  // NOLINT(bugprone-use-after-move)
}

TEST(Signer, ConcurrentSigningAgrees) {
    const Signer s("shared-key");
    const std::string expected = s.sign("header", "parent", "metadata", "content");
    std::vector<std::thread> threads;
    std::vector<int> mismatches(4, 0);
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 2000; ++i) {
                if (s.sign("header", "parent", "metadata", "content") != expected) ++mismatches[t];
                if (!s.verify(expected, "header", "parent", "metadata", "content")) ++mismatches[t];
            }
        });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST(MakeRandomKey, Is64LowercaseHexAndFresh) {
    std::set<std::string> keys;
    for (int i = 0; i < 100; ++i) {
        const std::string k = make_random_key();
        ASSERT_EQ(k.size(), 64u);
        ASSERT_TRUE(is_lower_hex(k)) << k;
        keys.insert(k);
    }
    EXPECT_EQ(keys.size(), 100u);
    Signer s(make_random_key());
    EXPECT_TRUE(s.enabled());
    EXPECT_EQ(s.sign("h", "p", "m", "c").size(), 64u);
}

}  // namespace
}  // namespace cellblock
