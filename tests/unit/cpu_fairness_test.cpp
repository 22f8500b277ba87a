#include "cellblock/cpu_fairness.hpp"

#include <gtest/gtest.h>

namespace cellblock {
namespace {

using namespace std::chrono_literals;
using Clock = CpuFairness::Clock;

// Feeds samples `step` apart in which the sandbox used `share` of a core;
// returns the weights the policy asked for, in order.
std::vector<int> feed(CpuFairness& f, Clock::time_point& now, std::uint64_t& cpu_ns, double share,
                      int samples, std::chrono::milliseconds step = 200ms) {
    std::vector<int> weights;
    for (int i = 0; i < samples; ++i) {
        now += step;
        cpu_ns += static_cast<std::uint64_t>(share * std::chrono::nanoseconds(step).count());
        if (auto w = f.observe(now, cpu_ns)) weights.push_back(*w);
    }
    return weights;
}

TEST(CpuFairness, QuietSessionKeepsItsWeight) {
    CpuFairness f;
    Clock::time_point now{};
    std::uint64_t cpu = 0;
    f.observe(now, cpu);
    // Short cells: a few ms of CPU per 200 ms, for a minute.
    EXPECT_TRUE(feed(f, now, cpu, 0.05, 300).empty());
    EXPECT_FALSE(f.demoted());
}

TEST(CpuFairness, SustainedBurnIsDemotedThenRestoredWhenItCalmsDown) {
    CpuFairness f;
    Clock::time_point now{};
    std::uint64_t cpu = 0;
    f.observe(now, cpu);
    // Two loud samples are not yet "without pause".
    EXPECT_TRUE(feed(f, now, cpu, 1.0, 2).empty());
    EXPECT_EQ(feed(f, now, cpu, 1.0, 1), std::vector<int>{f.policy().demoted_weight});
    EXPECT_TRUE(f.demoted());
    // Still loud: no further change.
    EXPECT_TRUE(feed(f, now, cpu, 0.9, 10).empty());
    // Between the thresholds: stays demoted.
    EXPECT_TRUE(feed(f, now, cpu, 0.4, 3).empty());
    EXPECT_EQ(feed(f, now, cpu, 0.0, 1), std::vector<int>{f.policy().normal_weight});
    EXPECT_FALSE(f.demoted());
}

TEST(CpuFairness, BurstsWithPausesAreNotDemoted) {
    CpuFairness f;
    Clock::time_point now{};
    std::uint64_t cpu = 0;
    f.observe(now, cpu);
    for (int i = 0; i < 20; ++i) {
        EXPECT_TRUE(feed(f, now, cpu, 1.0, 2).empty());
        EXPECT_TRUE(feed(f, now, cpu, 0.1, 1).empty());
    }
    EXPECT_FALSE(f.demoted());
}

TEST(CpuFairness, CounterResetOrSameInstantIsHarmless) {
    CpuFairness f;
    Clock::time_point now{};
    f.observe(now, 5'000'000'000);
    EXPECT_FALSE(f.observe(now, 6'000'000'000));      // no time passed
    EXPECT_FALSE(f.observe(now + 200ms, 1'000'000));  // counter went back: no CPU used
    EXPECT_FALSE(f.demoted());
}

}  // namespace
}  // namespace cellblock
