// Keeps a quiet session responsive next to sessions that burn CPU without
// pause (a spin loop, a fork bomb, a long computation).
//
// Every sandbox has a one-core CFS quota, but ten sandboxes with one core
// each oversubscribe two cores fivefold, and with equal weights a quiet
// kernel waits in the run queue behind them on every wake-up (the benchmark
// measured 44-70 ms of run-queue wait per 1+1 round trip). So the server
// samples each sandbox's CPU time a few times a second. A sample is loud
// when the sandbox used CPU (more than `loud_share` of a core) while either
// one execution had been running for `long_execution` or more, or no
// execution ran at all during the sample (work left in the background).
// Short cells back to back are never loud, however much CPU they add up to:
// that is the interactive use the weight protects. After `loud_samples`
// loud samples in a row the sandbox's CPU weight drops to `demoted_weight`;
// the first sample that is not loud restores it. The weight matters only
// under contention: a demoted sandbox alone on the machine still gets its
// whole quota. The share threshold is low on purpose: on a contended
// machine a spinning sandbox gets only a fraction of a core.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

namespace cellblock {

struct CpuFairnessPolicy {
    std::chrono::milliseconds interval{100};
    std::chrono::milliseconds long_execution{200};
    double loud_share = 0.05;  // of one core, over a sample
    int loud_samples = 2;      // in a row
    int normal_weight = 1024;  // cgroup v1 cpu.shares
    int demoted_weight = 16;
};

class CpuFairness {
  public:
    using Clock = std::chrono::steady_clock;
    explicit CpuFairness(CpuFairnessPolicy policy = {}) : policy_(policy) {}

    // A new sample of the sandbox's total CPU time. `sustained`: an
    // execution has run for long_execution or more, or none ran since the
    // previous sample. Returns the weight to apply when it changes.
    std::optional<int> observe(Clock::time_point now, std::uint64_t cpu_ns, bool sustained) {
        if (!last_) {
            last_ = Sample{now, cpu_ns};
            return std::nullopt;
        }
        const double wall_ns = std::chrono::duration<double, std::nano>(now - last_->at).count();
        if (wall_ns <= 0) return std::nullopt;
        const double used = cpu_ns >= last_->cpu_ns ? double(cpu_ns - last_->cpu_ns) : 0.0;
        last_ = Sample{now, cpu_ns};
        const bool loud = sustained && used / wall_ns > policy_.loud_share;
        loud_streak_ = loud ? loud_streak_ + 1 : 0;
        if (!demoted_ && loud_streak_ >= policy_.loud_samples) {
            demoted_ = true;
            return policy_.demoted_weight;
        }
        if (demoted_ && !loud) {
            demoted_ = false;
            return policy_.normal_weight;
        }
        return std::nullopt;
    }
    bool demoted() const { return demoted_; }
    const CpuFairnessPolicy& policy() const { return policy_; }
    Clock::time_point last_sample() const { return last_ ? last_->at : Clock::time_point{}; }

  private:
    struct Sample {
        Clock::time_point at;
        std::uint64_t cpu_ns;
    };
    CpuFairnessPolicy policy_;
    std::optional<Sample> last_;
    int loud_streak_ = 0;
    bool demoted_ = false;
};

}  // namespace cellblock
