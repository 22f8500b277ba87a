// Decides each session's CPU weight and quota from samples of its cgroup, so
// that quiet sessions stay responsive next to abusive ones without starving
// anything.
//
// Every sandbox has a one-core CFS quota, but ten sandboxes with one core
// each oversubscribe two cores fivefold, and with equal weights a quiet
// kernel waits in the run queue behind them on every wake-up. The server
// samples each sandbox's CPU time and task count a few times a second and
// feeds them here, with whether an execution ran. What is penalised is what
// is abusive, and only once it is sustained (seconds, not one sample):
//  - a fork or thread storm: the task count at or above `storm_tasks`, or
//    growing by `storm_growth` per sample, for `storm_after`; or creeping up
//    (rising in `creep_rising` of the samples over `creep_after`, by
//    `creep_tasks` or more): ten fork bombs slow each other's forks to a few
//    tasks a second each, under the other two rules for tens of seconds;
//  - work left running with no execution: CPU above `busy_share` of a core
//    over `background_after` in which no execution ran.
// Either demotes the session to `demoted_weight` and caps its quota at
// `demoted_cpus`; `storm_cpus` for one creeping up, a fork bomb, whose every
// fork costs its neighbours kernel work that no weight governs (page tables
// copied and write-protected, TLB shootdowns to the other CPUs, rmap walks
// over pages shared by hundreds of processes). A burst that then stays, a
// big thread pool, keeps `demoted_cpus`: at a hundredth of a core its
// threads' own starts and ends outlasted 40 s. Either is a guaranteed share
// that still makes progress, never the starvation of cgroup cpu.idle. It is
// restored once it has been calm for `calm_after`: no storm, and without an
// execution at most `calm_share` of a core used and a runnable task in at
// most `calm_runnable` of the samples. A demoted spinner keeps wanting CPU,
// so it stays demoted rather than flapping. One demoted for a storm while
// the execution that grew it still runs is held (`storm_hold`): it is calm
// only once at most one of its tasks wants CPU, since at its cap a bomb adds
// few tasks or none, yet all of them wait to fork. A long execution is
// legitimate and is never demoted: once it has been CPU-bound for
// `long_after` it yields a step of weight (`long_steps`; its
// quota stays, and a weight matters only when CPU is contended), so a quiet
// session next to ten spinning cells still answers at once and work begun
// later is not held back by a spin begun earlier; the default weight returns
// when the execution ends. Short cells and bursts (a pandas import) never
// change anything.
//
// The sandboxes' common parent cgroup (`cellblock`) is one entity among the
// host's processes, and its weight goes to whatever inside it runs. The
// server gives it (`sandboxes_weight`), while the host's own processes
// contend for the CPU (host_contention.hpp; else one process's for all of
// them, so that a waking host process does not wait behind ten spinners),
// one process's weight per session holding the CPU (`hogging`: an execution
// past `interactive_run`, normal or yielding; a demoted one is owed
// nothing), so that no runnable session gets
// less than a host process does (one process for all of them let two host
// spinners take 0.65 of a core each while a pandas cell beside two spinning
// sessions got 0.2: bench figure 16); a yielding step moves a session's time
// to its neighbours, never to the host. While no session holds the CPU, one
// per interactive session (one that used CPU lately in executions of under
// `interactive_run`): a hundred sessions stepping weighed one process at the
// kernel's default and lost 35% of their throughput to preemption (figure
// 4). Interactive sessions are not counted beside hogs: they sleep between
// steps, and their weight served the spins beside them (the interactive p99
// of figure 8 grew 22-65x). The server itself joins a cgroup weighted as the
// sandboxes (runc_sandbox.hpp, join_servers_cgroup): it relays every
// message, and at one process's weight beside ten spinning sessions each
// round trip waited 30-65 ms for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace cellblock {

struct CpuFairnessPolicy {
    using Seconds = std::chrono::duration<double>;
    std::chrono::milliseconds interval{250};
    double busy_share = 0.05;     // of one core: above it, work in the background is loud
    double calm_share = 0.02;     // of one core: at most this, a demoted session is calm
    double calm_runnable = 0.25;  // of the samples with a runnable task, at most
    Seconds background_after{3.0};
    Seconds storm_after{1.0};
    Seconds calm_after{5.0};
    std::int64_t storm_tasks = 128;  // processes and threads in the cgroup (pids.current)
    std::int64_t storm_growth = 32;  // tasks added within one sample
    // Creeping growth: a pool started once rises in one or two samples, a
    // bomb in nearly all of them, however slowly.
    Seconds creep_after{2.0};
    double creep_rising = 0.75;    // of the samples in creep_after, at least
    std::int64_t creep_tasks = 8;  // added over creep_after, at least
    // A session demoted for a storm while an execution ran: until that
    // execution ends it is calm only if at most one task wanted CPU in at
    // most calm_runnable of the samples. Calm meant only "no longer
    // creeping", and the cap itself stops the creeping: six fork bombs were
    // restored after 5 s, demoted again 2 s later, and each had its whole
    // core a third of the time (docs/performance.md, "Fork bombs flapping").
    // The first hold lasts storm_hold at most: at a hundredth of a core the
    // children a loop has just forked queue for CPU as a bomb's do (5-13 of
    // 30 tasks runnable, against 30-47 of 55 in a bomb), so a loop forking
    // up to its pids limit, or a pool started one worker at a time, goes on
    // at its own quota after it. Demoted for a storm again in the same
    // execution (at its own quota a bomb is one again within seconds), it is
    // held twice as long each time: a bomb gets its core for 2 s in 17, then
    // in 32, 62..., where it had it for 2 s in 7; a loop still moves on. A
    // hold ends as soon as the task count fell by creep_tasks over
    // creep_after: the loop reached its limit and reaps its children (35
    // exits at a hundredth of a core, every one runnable, took 15 s more).
    // A bomb at its limit keeps its count.
    Seconds storm_hold{15.0};
    int normal_weight = 1024;  // cgroup v1 cpu.shares
    int demoted_weight = 64;
    double demoted_cpus = 0.05;  // CFS quota cap of a demoted session, in cores
    double storm_cpus = 0.01;    // the same, demoted for creeping growth
    // Active (it weighs on the sandboxes' parent): more than active_share of
    // a core used over the last active_span.
    Seconds active_span{1.0};
    double active_share = 0.002;
    // Interactive: active, at the normal level, and no execution running longer.
    Seconds interactive_run{1.0};
    // A long execution's first step needs it busy over the whole of long_after.
    Seconds long_after{2.0};
    struct LongStep {
        Seconds after;  // one execution has run this long, busy over long_after
        int weight;
    };
    // An eighth after 2 s: a quiet session next to ten spinning cells then
    // outweighs them all (at 10 s, as before, its p99 was 4-8x its quiet p99
    // from the third second of the noise on: bench figure 6); halving every
    // 20-45 s from there, so that work begun later is not held back by a
    // spin begun earlier. The parent's weight keeps counting the session as
    // one process (sandboxes_weight): the step moves its time to its
    // neighbours, never to the host.
    std::vector<LongStep> long_steps{
        {Seconds{2}, 128}, {Seconds{20}, 64}, {Seconds{45}, 32}, {Seconds{90}, 16}};
    // Memory growing while it holds the CPU (CpuSetting::growing): its
    // cgroup's memory rose by growing_bytes or more over growing_after, by
    // growing_per_cpu_s or more per second of CPU it used meanwhile, and
    // never fell by more than growing_slack from one sample to the next. A
    // memory bomb only ever adds, ~330 MB per second of CPU, most of it the
    // kernel zeroing pages (~30 MB/s at a tenth of a core); a pandas loop's
    // temporaries come and go, and where its heap does grow, it grows ~40 MB
    // per second of CPU (23 MB in 2 s at a quarter of a core, bench figure
    // 8). It counts as growing until it has not grown for calm_after.
    Seconds growing_after{2.0};
    std::int64_t growing_bytes = std::int64_t{16} << 20;
    double growing_per_cpu_s = 128.0 * (1 << 20);
    std::int64_t growing_slack = std::int64_t{1} << 20;
};

// What the cgroup is set to. cpus 0: the session's own quota.
struct CpuSetting {
    enum class Level { normal, yielding, demoted };
    Level level = Level::normal;
    int weight = 1024;
    double cpus = 0;
    // Holding the CPU (yielding or demoted) with its memory growing: every
    // new page is one the kernel zeroes, and that work and the cache it
    // evicts cost whatever shares its CPU, beyond what any weight governs
    // (while one does, serve --loud-cpus keeps the sessions holding the CPU
    // off one CPU).
    bool growing = false;
    bool operator==(const CpuSetting&) const = default;
};

// A change to apply, and the event that records it.
struct CpuChange {
    CpuSetting setting;
    // cpu_demoted, cpu_yielding, cpu_restored; cpu_memory_growing and
    // cpu_memory_steady when only `growing` changes.
    std::string event;
    std::string detail;  // why, with the figures and how long the previous level lasted
};

// One reading of the session taken by the server.
struct CpuSample {
    std::chrono::steady_clock::time_point at;
    std::uint64_t cpu_ns = 0;  // cumulative (cpuacct.usage)
    std::int64_t tasks = 0;    // pids.current; < 0 unknown
    // Runnable tasks seen at the sample, counted up to 2 (> 0: it wants
    // CPU, whether it got it or not; 2: more than one task does); < 0
    // unknown. A demoted spinner on a crowded host gets almost no CPU, so
    // what it used cannot tell whether it has calmed down; what it wants can.
    std::int64_t runnable = -1;
    // An execution ran at some point since the previous sample.
    bool executed = false;
    // How long the execution running now has run (none: the kernel is idle).
    std::optional<std::chrono::steady_clock::duration> running_for;
    // The cgroup's memory (memory.usage_in_bytes); < 0 unknown.
    std::int64_t memory_bytes = -1;
};

class CpuFairness {
  public:
    using Clock = std::chrono::steady_clock;
    explicit CpuFairness(CpuFairnessPolicy policy = {});

    // Feeds one sample; returns the change to apply when the setting changes.
    std::optional<CpuChange> observe(const CpuSample& sample);

    const CpuSetting& setting() const { return setting_; }
    // It used more than active_share of a core over the last active_span.
    bool active() const;
    // Active, at the normal level, and no execution had run interactive_run
    // at the last sample: it weighs on the sandboxes' parent.
    bool interactive() const;
    // Active, not interactive and not demoted: it holds the CPU in a long
    // execution (normal or yielding), runnable throughout.
    bool hogging() const { return active() && !interactive() && !demoted(); }
    bool demoted() const { return setting_.level == CpuSetting::Level::demoted; }
    const CpuFairnessPolicy& policy() const { return policy_; }
    Clock::time_point last_sample() const { return last_ ? last_->at : Clock::time_point{}; }

  private:
    // What happened between two samples.
    struct Interval {
        Clock::time_point start, end;
        double cpu_s = 0;
        std::int64_t tasks = -1;
        std::int64_t added = 0;  // tasks since the previous sample (0 when unknown)
        std::int64_t runnable = -1;
        std::int64_t memory = -1;  // at the end
        bool executed = false;
        bool storm(const CpuFairnessPolicy& p) const {
            return added >= p.storm_growth || tasks >= p.storm_tasks;
        }
    };
    // The intervals ending within the last `span`, if they cover all of it.
    std::optional<std::vector<const Interval*>> window(CpuFairnessPolicy::Seconds span) const;
    struct Abuse {
        std::string why;
        bool storm = false;     // a fork or thread storm (held while its execution runs)
        bool creeping = false;  // capped at storm_cpus
    };
    std::optional<Abuse> abuse() const;
    // Over growing_after, how much the memory rose (0 if it fell by more
    // than growing_slack on the way) and the CPU it used meanwhile; none: not
    // yet that long, or unknown.
    struct MemoryRise {
        std::int64_t bytes = 0;
        double cpu_s = 0;
    };
    std::optional<MemoryRise> memory_rise() const;
    // The level's change, if any (observe adds `growing`).
    std::optional<CpuChange> observe_level(const CpuSample& sample);
    // How the task count moved over creep_after (none: not yet that long).
    struct Growth {
        std::int64_t added = 0;   // net, over the window
        std::size_t rising = 0;   // samples in which it rose
        std::size_t samples = 0;  // in the window
    };
    std::optional<Growth> growth() const;
    // The task count creeping up over creep_after: what, if so.
    std::optional<std::string> creeping() const;
    // The task count fell by creep_tasks or more over creep_after.
    bool shrinking() const;
    // `held`: the execution's samples count too, and wanting CPU is more
    // than one task wanting it (see storm_hold).
    bool calm(bool held = false) const;
    // The execution that was running at a demotion for a storm still runs
    // at this sample.
    bool storm_execution_running(const CpuSample& sample) const;
    CpuSetting yielding_setting(const CpuSample& sample) const;
    CpuChange change_to(CpuSetting next, std::string event, std::string why);

    CpuFairnessPolicy policy_;
    std::optional<CpuSample> last_;
    std::deque<Interval> history_;
    CpuSetting setting_;
    std::string demoted_why_;
    // When the execution running at a demotion for a storm started, and how
    // many times it was demoted so (each hold twice as long as the one before).
    std::optional<Clock::time_point> storm_execution_;
    int storm_holds_ = 0;
    Clock::time_point since_{};  // when the current setting was applied
    // The last sample at which its memory was seen growing (memory_rise).
    std::optional<Clock::time_point> grew_at_;
    std::int64_t last_rise_ = 0;
    double last_rise_cpu_ = 0;
};

// cgroup v1's ceiling for cpu.shares (its floor is 2).
inline constexpr int kMaxCpuShares = 262144;

// The weight for the sandboxes' parent cgroup (v1 cpu.shares units): one
// normal session's per hogging session while any is, else one per interactive
// session; at least one, at most cgroup v1's ceiling (kMaxCpuShares).
int sandboxes_weight(std::size_t interactive, std::size_t hogging,
                     const CpuFairnessPolicy& policy = {});

// The CPUs the sessions holding the CPU are kept to (when: loud_on_cpus),
// as a cpuset list, from `serve --loud-cpus`: "auto" (the default) is
// every CPU the server may run on but the lowest, where it may run on two
// or more (so an interactive session, the server and its clients then have
// one that none of them is on); "all" (or "auto" on one CPU) is none: ""
// leaves every session on every CPU. Anything else must be a list of CPUs
// in `online`, such as "1" or "1-3,6"; std::invalid_argument says what is
// wrong with it.
std::string loud_cpu_list(const std::string& option, const std::vector<int>& online);

// When `--loud-cpus` keeps the sessions holding the CPU (yielding or
// demoted) to its CPUs: `growing` (the default) while any of them grows its
// memory at a bomb's pace (CpuSetting::growing), whose page zeroing and
// cache misses slow what shares its CPU beyond any weight: all of them, for
// a bomb kept apart alone leaves the free CPU to the spinners, which the
// scheduler then packs there beside the interactive sessions (the mixed row
// of bench figure 6 went from 1.5-1.7x to 2.0-2.9x); `holding` always,
// which also keeps the free CPU idle whenever the interactive work leaves
// it idle while a computation waits (1.4x as long beside nine interactive
// sessions: docs/performance.md).
enum class LoudCpusFor { growing, holding };
LoudCpusFor loud_cpus_for(const std::string& option);  // std::invalid_argument
// `any_growing`: a session of this server holding the CPU grows so.
bool loud_on_cpus(const CpuSetting& setting, LoudCpusFor rule, bool any_growing);

}  // namespace cellblock
