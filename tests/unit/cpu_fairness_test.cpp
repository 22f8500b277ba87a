#include "cellblock/cpu_fairness.hpp"

#include <gtest/gtest.h>

namespace cellblock {
namespace {

using namespace std::chrono_literals;
using Clock = CpuFairness::Clock;

struct Feeder {
    CpuFairness f;
    Clock::time_point now{};
    std::uint64_t cpu_ns = 0;
    Feeder() { f.observe(now, cpu_ns, false); }
    // Samples 200 ms apart in which the sandbox used `share` of a core;
    // returns the weights the policy asked for, in order.
    std::vector<int> feed(double share, bool sustained, int samples) {
        std::vector<int> weights;
        for (int i = 0; i < samples; ++i) {
            now += 200ms;
            cpu_ns += static_cast<std::uint64_t>(share * 200e6);
            if (auto w = f.observe(now, cpu_ns, sustained)) weights.push_back(*w);
        }
        return weights;
    }
};

TEST(CpuFairness, ShortCellsBackToBackAreNeverDemotedHoweverMuchCpuTheyAddUpTo) {
    Feeder x;
    EXPECT_TRUE(x.feed(0.9, /*sustained=*/false, 300).empty());
    EXPECT_FALSE(x.f.demoted());
}

TEST(CpuFairness, IdleSessionUsingNoCpuIsNotDemoted) {
    Feeder x;
    EXPECT_TRUE(x.feed(0.001, /*sustained=*/true, 300).empty());
    EXPECT_FALSE(x.f.demoted());
}

TEST(CpuFairness, LongBurnIsDemotedThenRestoredWhenItStops) {
    Feeder x;
    const int demoted = x.f.policy().demoted_weight, normal = x.f.policy().normal_weight;
    // One loud sample is not yet "without pause".
    EXPECT_TRUE(x.feed(0.2, true, 1).empty());
    // A contended spinner gets only a fraction of a core: still loud.
    EXPECT_EQ(x.feed(0.2, true, 1), std::vector<int>{demoted});
    EXPECT_TRUE(x.f.demoted());
    EXPECT_TRUE(x.feed(1.0, true, 10).empty());
    // The execution ended (or the background work stopped).
    EXPECT_EQ(x.feed(0.5, false, 1), std::vector<int>{normal});
    EXPECT_FALSE(x.f.demoted());
    EXPECT_TRUE(x.feed(0.5, false, 5).empty());
}

TEST(CpuFairness, BackgroundBurnAfterTheCellEndedIsDemotedToo) {
    Feeder x;
    // Idle since the previous sample, yet burning: a fork bomb left running.
    EXPECT_EQ(x.feed(0.3, true, 2), std::vector<int>{x.f.policy().demoted_weight});
    EXPECT_EQ(x.feed(0.0, true, 1), std::vector<int>{x.f.policy().normal_weight});
}

TEST(CpuFairness, CounterGoingBackOrNoTimePassingIsHarmless) {
    Feeder x;
    EXPECT_FALSE(x.f.observe(x.now, 123'000'000'000, true));  // no time passed: ignored
    EXPECT_FALSE(x.f.observe(x.now + 200ms, 10'000'000'000, false));
    // The counter went back (a reset): counted as no CPU used, twice in a row.
    EXPECT_FALSE(x.f.observe(x.now + 400ms, 1'000'000, true));
    EXPECT_FALSE(x.f.observe(x.now + 600ms, 2'000'000, true));
    EXPECT_FALSE(x.f.demoted());
}

}  // namespace
}  // namespace cellblock
