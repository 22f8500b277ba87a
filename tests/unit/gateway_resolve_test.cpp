// The gateway's name resolution is bounded by the request timeout: a lookup
// that takes longer is given up (the connection gets 504 naming why) and its
// late answer lands nowhere the caller still reads. Lookups here are fakes
// the test controls: nothing is resolved and no packet is sent.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "gateway_internal.hpp"

namespace {
using cellblock::IpAddress;
using cellblock::gateway::Config;
using cellblock::gateway::resolve;
using cellblock::gateway::resolve_within;

// A gate the test opens: the fake lookup waits at it.
struct Gate {
    std::mutex m;
    std::condition_variable cv;
    bool open = false;
    void wait() {
        std::unique_lock l(m);
        cv.wait(l, [&] { return open; });
    }
    void release() {
        std::lock_guard l(m);
        open = true;
        cv.notify_all();
    }
};

TEST(ResolveWithin, ALookupThatAnswersInTimeGivesItsAddresses) {
    std::string why;
    bool timed_out = true;
    const auto found = resolve_within("api.test.example", 30, why, timed_out, [](std::string&) {
        return std::vector<IpAddress>{*IpAddress::parse("127.0.0.1")};
    });
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].to_string(), "127.0.0.1");
    EXPECT_FALSE(timed_out);
}

TEST(ResolveWithin, ALookupThatFailsGivesItsReason) {
    std::string why;
    bool timed_out = true;
    const auto found = resolve_within("nx.test.example", 30, why, timed_out, [](std::string& w) {
        w = "cannot resolve nx.test.example: Name or service not known";
        return std::vector<IpAddress>{};
    });
    EXPECT_TRUE(found.empty());
    EXPECT_FALSE(timed_out);
    EXPECT_EQ(why, "cannot resolve nx.test.example: Name or service not known");
}

TEST(ResolveWithin, ALookupSlowerThanTheTimeoutIsGivenUpAndItsLateAnswerDropped) {
    auto gate = std::make_shared<Gate>();
    auto finished = std::make_shared<std::atomic<bool>>(false);
    std::string why;
    bool timed_out = false;
    const auto found =
        resolve_within("slow.test.example", 0.05, why, timed_out, [gate, finished](std::string&) {
            gate->wait();  // a resolver that has not answered yet
            finished->store(true);
            return std::vector<IpAddress>{*IpAddress::parse("127.0.0.1")};
        });
    // Returned while the lookup still waits: bounded by the timeout, not by it.
    EXPECT_FALSE(finished->load());
    EXPECT_TRUE(found.empty());
    EXPECT_TRUE(timed_out);
    EXPECT_EQ(why,
              "resolving slow.test.example took longer than 0.05 s (network.request_timeout_s)");
    // The late answer: it lands in state the lookup's thread owns (ASan
    // would see a write to anything freed).
    gate->release();
    for (int i = 0; i < 5000 && !finished->load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_TRUE(finished->load());
}

TEST(ResolveWithin, LookupsThatNeverAnswerCannotPileUpThreads) {
    auto gate = std::make_shared<Gate>();
    auto ended = std::make_shared<std::atomic<int>>(0);
    auto stuck = [gate, ended](std::string&) {
        gate->wait();
        ++*ended;
        return std::vector<IpAddress>{};
    };
    std::string why;
    bool timed_out = false;
    // Earlier tests' lookups in this process have ended (their threads just after).
    for (int i = 0; i < 5000 && cellblock::gateway::lookups_in_progress() > 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_EQ(cellblock::gateway::lookups_in_progress(), 0);
    for (int i = 0; i < cellblock::gateway::kMaxLookups; ++i) {
        resolve_within("stuck.test.example", 0.001, why, timed_out, stuck);
        EXPECT_TRUE(timed_out);
    }
    // All of them still wait: the next is refused at once, without a thread.
    bool called = false;
    const auto found =
        resolve_within("next.test.example", 30, why, timed_out, [&called](std::string&) {
            called = true;
            return std::vector<IpAddress>{};
        });
    EXPECT_TRUE(found.empty());
    EXPECT_FALSE(called);
    EXPECT_FALSE(timed_out);
    EXPECT_EQ(why, "cannot resolve next.test.example: the gateway has 64 name lookups in progress");
    // Once they end, lookups run again.
    gate->release();
    for (int i = 0; i < 5000 && ended->load() < cellblock::gateway::kMaxLookups; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_EQ(ended->load(), cellblock::gateway::kMaxLookups);
    for (int i = 0; i < 5000 && cellblock::gateway::lookups_in_progress() > 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(cellblock::gateway::lookups_in_progress(), 0);
    const auto again = resolve_within("api.test.example", 30, why, timed_out, [](std::string&) {
        return std::vector<IpAddress>{*IpAddress::parse("127.0.0.1")};
    });
    EXPECT_EQ(again.size(), 1u) << why;
}

TEST(Resolve, PinsAndLiteralsNeedNoLookupAndNoDnsRefusesTheRest) {
    Config config;
    config.dns = false;
    config.pins["api.test.example"] = *IpAddress::parse("127.0.0.1");
    std::string why;
    bool timed_out = true;
    auto found = resolve("api.test.example", config, 1, why, timed_out);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].to_string(), "127.0.0.1");
    EXPECT_FALSE(timed_out);
    found = resolve("::1", config, 1, why, timed_out);
    ASSERT_EQ(found.size(), 1u);
    found = resolve("other.test.example", config, 1, why, timed_out);
    EXPECT_TRUE(found.empty());
    EXPECT_FALSE(timed_out);
    EXPECT_NE(why.find("resolves only the names it was given"), std::string::npos) << why;
}

}  // namespace
