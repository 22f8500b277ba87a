// Keeps a quiet session responsive next to sessions that burn CPU without
// pause (a spin loop, a fork bomb, a long computation).
//
// Every sandbox has a one-core CFS quota, but ten sandboxes with one core
// each oversubscribe two cores tenfold, and with equal weights a quiet
// kernel waits in the run queue behind them on every wake-up (the benchmark
// measured 44-70 ms of run-queue wait per 1+1 round trip). So the server
// samples each sandbox's CPU time a few times a second, and a sandbox that
// has used more than `loud_share` of a core for `loud_samples` samples in a
// row gets a low CPU weight until it calms down (below `quiet_share` for one
// sample). The weight matters only under contention: a demoted sandbox
// alone on the machine still gets its whole quota.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

namespace cellblock {

struct CpuFairnessPolicy {
    std::chrono::milliseconds interval{200};
    double loud_share = 0.5;    // of one core, sustained
    double quiet_share = 0.25;  // of one core, to be restored
    int loud_samples = 3;       // consecutive samples above loud_share
    int normal_weight = 1024;   // cgroup v1 cpu.shares
    int demoted_weight = 16;
};

class CpuFairness {
  public:
    using Clock = std::chrono::steady_clock;
    explicit CpuFairness(CpuFairnessPolicy policy = {}) : policy_(policy) {}

    // A new sample of the sandbox's total CPU time; returns the weight to
    // apply when it changes.
    std::optional<int> observe(Clock::time_point now, std::uint64_t cpu_ns) {
        if (!last_) {
            last_ = Sample{now, cpu_ns};
            return std::nullopt;
        }
        const double wall_ns = std::chrono::duration<double, std::nano>(now - last_->at).count();
        if (wall_ns <= 0) return std::nullopt;
        const double used = cpu_ns >= last_->cpu_ns ? double(cpu_ns - last_->cpu_ns) : 0.0;
        const double share = used / wall_ns;
        last_ = Sample{now, cpu_ns};
        if (!demoted_) {
            loud_streak_ = share > policy_.loud_share ? loud_streak_ + 1 : 0;
            if (loud_streak_ >= policy_.loud_samples) {
                demoted_ = true;
                return policy_.demoted_weight;
            }
        } else if (share < policy_.quiet_share) {
            demoted_ = false;
            loud_streak_ = 0;
            return policy_.normal_weight;
        }
        return std::nullopt;
    }
    bool demoted() const { return demoted_; }
    const CpuFairnessPolicy& policy() const { return policy_; }

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
