// Whether the host's own processes contend with the sandboxes for the CPU:
// what decides whether the sessions holding the CPU weigh one process each
// against the host, or one process together (sandboxes_weight,
// cpu_fairness.hpp).
//
// Both ways cost someone. Counted as one process together, two host
// spinners took 0.65 of a core each while a pandas cell beside two spinning
// sessions got 0.2 (bench figure 16, issue 33 §4). Counted as one process
// each, ten spinning sessions outweigh every process of the host tenfold,
// and the kernel's EEVDF scheduler then lets a waking host process wait for
// the next tick (4 ms at HZ 250) and often for tens of ms: a client on the
// host driving a quiet session saw its `1+1` p99 at 9-15x its quiet p99
// (figure 6, §3), all of it in the client's own run-queue wait (`perf sched
// latency`: the server's and the quiet kernel's waits stayed under 5 ms).
// Raising the weight of a host process is not ours to do, and a shorter
// time slice for it, or a longer one for the spinners, changed nothing here
// (6.18, PREEMPT_NONE): only the weight does.
//
// So the hogs count as processes only while the host's processes contend:
// judged at one process's weight over `window`, the host's processes
// (everything outside the sandboxes' and the servers' cgroups) used at least
// `host_share` of what the sandboxes used, and at least `min_host_cores`. A
// host process that wants all the CPU it can get takes, at equal weight, as
// much as all the sandboxes together (or a whole core); an interactive one
// (a client stepping sessions, a shell) takes what its bursts need, a small
// part of what ten spinners take. While counted, the host's use no longer
// tells (each host process then gets a session's share, whatever it wants),
// so every `recheck_every` the one-process weight is tried again for a
// window and judged anew: a host spinner that is still there regains, for
// that second, what it had before.
//
// Servers sharing a host judge each on its own readings (the same host-wide
// figures); the shared parent holds the last figure written, and a server
// writes only when its own figure changes, so a server that counts and one
// that does not agree again by the next check.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

namespace cellblock {

// CPU time used so far, in nanoseconds: by the whole host (every CPU's busy
// time, /proc/stat), by the sandboxes' parent cgroup, and by the servers'.
struct HostCpuReading {
    std::chrono::steady_clock::time_point at;
    std::uint64_t host_busy_ns = 0;
    std::uint64_t sandboxes_ns = 0;
    std::uint64_t servers_ns = 0;
};

struct HostContentionPolicy {
    using Seconds = std::chrono::duration<double>;
    Seconds window{1.0};
    double host_share = 0.75;
    double min_host_cores = 0.25;
    Seconds recheck_every{15.0};
};

class HostContention {
  public:
    using Clock = std::chrono::steady_clock;
    explicit HostContention(HostContentionPolicy policy = {});

    // Feeds one reading (none: the host's figures could not be read, and the
    // hogs count, as they did before this judgement existed); `hogs`: whether
    // any session on the host holds the CPU (with none the question does not
    // arise, and it is judged afresh when one does). Returns whether the hogs
    // count one process each.
    bool observe(const std::optional<HostCpuReading>& reading, bool hogs);

    bool counted() const { return counted_; }
    // Whether the last full window was judged and the host's processes did
    // not contend: false while a window is still being gathered (the first
    // after sessions began to hold the CPU, or a re-check), and while counted.
    // What `serve --cpu-idle` needs before it makes the sandboxes' parent idle.
    bool calm() const { return calm_; }
    // The last judgement, with its figures ("" before the first): for the log
    // and server_info.
    const std::string& why() const { return why_; }
    // Whether the last observe() changed counted().
    bool changed() const { return changed_; }

  private:
    void judge();

    HostContentionPolicy policy_;
    std::deque<HostCpuReading> window_;  // at one process's weight, since it was last set
    bool counted_ = false;
    bool calm_ = false;
    bool changed_ = false;
    Clock::time_point counted_since_{};
    std::string why_;
};

// The host's reading now, or none if /proc/stat or the parent cgroup's CPU
// accounting cannot be read (a host without the controller: no local
// sandboxes to weigh). The servers' cgroup may be missing (counted 0).
std::optional<HostCpuReading> read_host_cpu();

}  // namespace cellblock
