// The runc backend's sandbox: an OCI container on this host whose init is
// cellblock-shim, the session directory around it, and everything needed to
// destroy it without a trace. runsc and crun run the same bundle.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/sandbox.hpp"

namespace cellblock {

struct RuntimeSettings {
    std::string runtime = "runc";       // runc, crun or runsc (a binary on PATH or a path)
    std::filesystem::path state_dir;    // root of everything cellblock keeps
    std::filesystem::path libexec_dir;  // holds cellblock-shim and the kernel launcher
    // Where each sandbox leases its own host id range (host_ids.hpp).
    HostIdPool host_ids;
    // The CPU weight (cgroup v1 cpu.shares) a sandbox starts with; 0 leaves
    // the runtime's default. The pool starts its refills at a low weight so
    // that a kernel booting in the background does not slow the sessions in
    // use; the sandbox gets the default back when a session takes it.
    int start_cpu_shares = 0;
    // How long a session's sandbox outlives its server, waiting to be
    // adopted by the next start (kAdoptGraceEnv; runc and crun); 0: it ends
    // with its server. Server mode only.
    int adopt_grace_ms = 0;
    std::filesystem::path runtime_root() const { return state_dir / "runtime"; }
    std::filesystem::path sessions_dir() const { return state_dir / "sessions"; }
};

// The runtimes a session may ask for by name.
bool runtime_allowed(const std::string& name);  // runc, runsc, crun
// Whether `runtime` (a name looked up on the PATH cellblock gives its helpers,
// or a path) is an executable file on this host.
bool runtime_installed(const std::string& runtime);

// Why the kernel ended, in words, from everything the shim wrote on its
// lifeline (its last "kernel-exit" line, sandbox_protocol.hpp): "the kernel
// exited with status 1", "the kernel was killed by signal 9", ...
std::string describe_kernel_exit(std::string_view lifeline_text);

// A sandbox of this host's OCI runtime: every capability (sandbox.hpp).
class RuncSandbox final : public Sandbox,
                          public SandboxFiles,
                          public SandboxCpu,
                          public HostProcess,
                          public SandboxCheckpoint {
  public:
    // Creates the session directory (lock, bundle, capped ipc and output
    // mounts), writes the inner connection file, and starts the container
    // detached with the shim as init. Returns once the runtime has started it;
    // the kernel may still be importing. Throws SandboxError.
    // A zygote's container (zygote.hpp) is started here too, with its role.
    static std::unique_ptr<RuncSandbox> start(const std::string& session_id, const Image& image,
                                              const SandboxLimits& limits,
                                              const RuntimeSettings& settings,
                                              SandboxRole role = SandboxRole::session);
    ~RuncSandbox() override;  // destroy()

    // A server that restarts adopts the sandboxes its last process left
    // running (docs/restarts.md, phase 2; sandbox_adopt.cpp). The record is
    // what it needs beside the session's dir: the init's pid and start time,
    // the inner connection with its key (the copy in the sandbox is the
    // sandbox's to change), the host ids and the runtime; under runsc also
    // the gofer's pid and the key its shim shows (kAdoptKeyLine). Null for a
    // sandbox that cannot be adopted (one started without a grace, a fork
    // whose zygote cannot be).
    std::optional<nlohmann::json> adoption_record() const override;
    // Takes the sandbox back: its session lock and host id lease, an init
    // that is still the record's (pid, start time, in the container's
    // cgroup), and its shim's lifeline, which the shim connects again within
    // `wait` (only the init's connection is taken; under runsc, only one that
    // shows the record's key first). Throws SandboxError
    // naming what does not match; the sandbox is then the reaper's.
    // A fork's record names its zygote's (forked_from): the zygote is
    // adopted first and held, as `zygote`, for as long as the fork lives.
    static std::unique_ptr<RuncSandbox> adopt(const std::string& session_id,
                                              const nlohmann::json& record, const Image& image,
                                              const SandboxLimits& limits,
                                              const RuntimeSettings& settings,
                                              std::chrono::milliseconds wait,
                                              std::shared_ptr<RuncSandbox> zygote = nullptr);
    // adopt() in two steps, so that a start adopting many sandboxes waits
    // for their shims once, not once each (a shim tries every
    // kAdoptRetryMs): begin_adoption checks the record and listens at the
    // lifeline's path; finish_adoption takes the init's connection. Either
    // throws SandboxError as adopt() does; an Adoption dropped unfinished
    // destroys its sandbox, as a failed adopt() does.
    struct Adoption {
        std::unique_ptr<RuncSandbox> box;
        UniqueFd listener;
    };
    static Adoption begin_adoption(const std::string& session_id, const nlohmann::json& record,
                                   const Image& image, const SandboxLimits& limits,
                                   const RuntimeSettings& settings,
                                   std::shared_ptr<RuncSandbox> zygote = nullptr);
    static std::unique_ptr<RuncSandbox> finish_adoption(Adoption adoption,
                                                        std::chrono::milliseconds wait);

    // The runtime this sandbox runs on ("runc", "runsc", ...).
    const std::string& runtime() const override { return settings_.runtime; }
    SandboxFiles* files() override { return this; }
    SandboxCpu* cpu() override { return this; }
    HostProcess* host_process() override { return this; }
    // An exact-level image's runsc sandbox only (its shim bridges).
    SandboxCheckpoint* checkpointable() override { return bridged_ ? this : nullptr; }

    // The exact level (sandbox_exact.cpp). The restore: a prepared session
    // dir and bundle of the image, `place` puts the image and the session's
    // files there and returns the secrets (restore_secrets of the sandbox
    // checkpointed), then `runsc restore`, SIGUSR1 to the quiesced shim, and
    // its lifeline taken back by its key. Blocks; throws SandboxError.
    static std::unique_ptr<RuncSandbox> restore(
        const std::string& session_id, const Image& image, const SandboxLimits& limits,
        const RuntimeSettings& settings,
        const std::function<nlohmann::json(const RestoreDirs&)>& place);
    bool quiesce(std::chrono::milliseconds wait, std::string& why) override;
    void checkpoint(const std::filesystem::path& image_dir) override;
    nlohmann::json restore_secrets() const override;

    // HostProcess.
    const SessionDir& session_dir() const override { return dir_; }
    const std::filesystem::path& dir() const { return dir_.root(); }
    pid_t init_pid() const override { return init_pid_; }
    // The host ids this sandbox's container ids map to, leased for its
    // lifetime: no other sandbox on the host runs as them meanwhile.
    IdMapping host_ids() const override { return host_ids_.ids(); }
    bool forked() const override { return forked_; }

    // Readable when the shim writes a status line or exits (EOF); the server
    // holds the other end, so the shim also sees EOF when the server dies.
    // Under runc/crun it is one end of a socketpair passed as the init's fd 3;
    // under runsc it is the one connection accepted on a socket in the ipc dir,
    // which is unlinked as soon as the shim is connected.
    int lifeline_fd() const override { return lifeline_.get(); }
    // Reads what the shim reported; returns false once the shim is gone.
    bool read_lifeline() override;
    bool exited() const override { return exited_; }
    std::string exit_description() const override;
    bool memory_limit_hit() const override;
    std::string log_tail() const override;             // log/shim.log
    bool node_lost() const override { return false; }  // this host runs it

    // SIGINT to the kernel (through the shim: a signal, or a lifeline line).
    bool interrupt() override;
    void kill() override;       // SIGKILL to every process of the sandbox
    void reap_init() override;  // waits for the killed init (a child of this subreaper)
    // Kills, deletes the container, unmounts and removes every file of the
    // session, removes its cgroup. Idempotent; never throws.
    void destroy() override;
    // cgroup writes (apply_cgroup_limits).
    void apply_limits(const SandboxLimits& limits) override;

    // Read from cgroup files opened once at start: this runs on every
    // execution's reply path, where a path lookup in cgroupfs (kernfs
    // revalidation per component) cost more than the read itself.
    SandboxUsage usage() const override;
    // SandboxFiles: the session directory's input/, output/ and partial/.
    std::filesystem::path input_dir() const override { return dir_.input(); }
    std::filesystem::path output_dir() const override { return dir_.output(); }
    std::filesystem::path staging_dir() const override { return dir_.staging(); }

    // SandboxCpu.
    // cgroup v1 cpu.shares (v2 cpu.weight is scaled to match). False when
    // the sandbox has no CPU controller to write.
    bool set_cpu_weight(int shares) override;
    // cpu.cfs_quota_us per 100 ms period (v2 cpu.max); false without such a file.
    bool set_cpu_quota(double cpus) override;
    // cpu.idle (v1 since Linux 5.15, and v2); false without such a file.
    bool set_cpu_idle(bool idle) override;
    // pids.current of the sandbox's cgroup; -1 unknown.
    std::int64_t task_count() const override;
    // Reads /proc per task, up to the at_most-th runnable one (state R):
    // the sandbox wants CPU, whether it gets it or not.
    int runnable_tasks(int at_most) const override;
    void renice(int nice) override;
    void set_slice(std::uint32_t us) override;
    // cpuset.cpus of its cgroup; "" writes the parent cgroup's effective CPUs.
    bool set_cpus(const std::string& cpus) override;

  private:
    friend class Zygote;
    RuncSandbox() = default;
    // The session directory with its lock, host id lease, mounts and inner
    // connection file: everything before the sandbox's processes exist.
    static std::unique_ptr<RuncSandbox> prepare(const std::string& session_id, const Image& image,
                                                const SandboxLimits& limits,
                                                const RuntimeSettings& settings);
    void write_bundle(const Image& image, SandboxRole role);
    // The runtime's `args` (run or restore, detached), the init's pid taken
    // from `pid_file`; under runsc its Sentry and gofer registered as ours.
    // Returns the runtime's exit code.
    int launch(const std::vector<std::string>& args, int pass_fd, int log_fd,
               const std::filesystem::path& pid_file);
    bool forked_ = false;
    // Its kernel's channels pass through its shim (an exact-level image's).
    bool bridged_ = false;
    // A forked session's zygote, kept (with the root it runs on) until the
    // session is destroyed, whatever the pool does with it meanwhile.
    std::shared_ptr<void> keep_;
    // A fork's zygote's sandbox, which keep_ holds (its record is the fork's).
    const RuncSandbox* zygote_box_ = nullptr;
    SessionDir dir_;
    RuntimeSettings settings_;
    pid_t init_pid_ = -1;
    pid_t gofer_pid_ = -1;  // runsc: the gofer, also our child once runsc run returns
    // runsc: what the shim shows a server adopting it (kAdoptKeyLine), given
    // to it on its first lifeline; empty for a runtime that passes fds.
    std::string adopt_key_;
    UniqueFd lifeline_;
    UniqueFd lock_fd_;
    UniqueFd version_fd_;   // a stored image version held (hold_stored_version)
    HostIdLease host_ids_;  // released in destroy(), once nothing of the sandbox is left
    bool exited_ = false;
    bool destroyed_ = false;
    bool reaped_ = false;
    std::string shim_status_;
    // adoption_record(), made once: nothing in it changes while the sandbox
    // lives, and a session's live row asks for it after every execution
    // (reads of /proc each time: a sixth of the server's CPU per step).
    mutable std::optional<nlohmann::json> adoption_record_;
    std::vector<std::filesystem::path> cgroup_dirs_;  // found once the container exists
    // Kept-open cgroup files (none where the controller or file is absent).
    struct CounterFiles {
        UniqueFd memory_peak, memory_usage, oom_control, cpu_usage;
        UniqueFd cpu_weight, cpu_quota, cpu_idle, pids_current;
        bool cpu_weight_v2 = false, cpu_quota_v2 = false;
    } counters_;
    void open_counters();
    // runsc: makes adopt_key_ and sends it on the lifeline (kAdoptKeyLine).
    void give_adopt_key();
    void close_counters();
};

// Removes what earlier cellblock processes left behind: sessions whose lock
// is not held (their owner died) are killed, deleted, unmounted and removed.
// Returns the ids of the sessions reaped.
std::vector<std::string> reap_abandoned_sessions(const RuntimeSettings& settings);

// /proc/PID/stat's start time (clock ticks since boot); 0 if there is no
// such process. With the pid, what names one process for its whole life.
std::uint64_t process_start_ticks(pid_t pid);

// Waits up to `timeout` until the cgroups of closed sandboxes whose last
// processes were slow to die are removed (a server waits for them before it
// exits, so that it leaves nothing behind). True when none are left.
bool await_cgroup_removals(std::chrono::milliseconds timeout);

// Removes cellblock's empty `cb-*` cgroups (every controller) that are older
// than `min_age`: what runs killed mid-way leave when their session
// directory is already gone. A cgroup with tasks is never removed (the
// kernel refuses), and the age keeps a sandbox that another server is
// creating at this moment out of reach. Returns the paths removed.
std::vector<std::filesystem::path> remove_orphan_cgroups(std::chrono::seconds min_age);

// Sets the CPU weight of the sandboxes' common parent cgroup (`cellblock`;
// v1 cpu.shares units, converted for v2's cpu.weight): what the sandboxes
// together weigh against the host's processes (cpu_fairness.hpp). False if
// there is no such cgroup or it refused. The parent is shared by every server
// on the host: the last writer's figure holds.
bool set_sandboxes_cpu_weight(int shares);

// Sets cpu.idle of the sandboxes' parent cgroup: while set, every process of
// the host that is not idle runs before any sandbox, and the parent's weight
// cannot be written (serve --cpu-idle, cpu_fairness.hpp). False if there is
// no such file or it refused.
bool set_sandboxes_cpu_idle(bool idle);

// Moves this process (all its threads, and the children it starts later) into
// the servers' cgroup (`cellblock-servers`, beside the sandboxes' parent),
// created if missing. Every server on the host shares it. Returns why not, or
// "" once joined.
std::string join_servers_cgroup();

// Sets the servers' cgroup's CPU weight (v1 cpu.shares units): the servers
// relay every message of every session, so they weigh what the sandboxes do
// (a server uses CPU only for the messages it is given, so the weight costs
// no one anything while it is idle). False if there is no such cgroup.
bool set_servers_cpu_weight(int shares);

// The cgroup layout, named once: sandboxes live in the `cellblock` cgroup
// (kSandboxesCgroup, oci_bundle.hpp) of every hierarchy; the servers in
// `cellblock-servers` beside it (cpu only).
inline constexpr const char* kCgroupRoot = "/sys/fs/cgroup";
inline constexpr const char* kServersCgroup = "cellblock-servers";
// Whether the host mounts the unified (v2) hierarchy alone at kCgroupRoot.
bool cgroup_v2();
// The hierarchies' roots: kCgroupRoot on v2; on v1 each mounted hierarchy
// under it (the named and hybrid ones too), without the symlinked aliases.
std::vector<std::filesystem::path> cgroup_hierarchies();
// The `cellblock` cgroup in each hierarchy, whether it exists or not.
std::vector<std::filesystem::path> sandboxes_cgroup_parents();
// The cgroup directories (one per v1 hierarchy, or the v2 one) of a container.
std::vector<std::filesystem::path> sandbox_cgroup_dirs(const std::string& container_id);

// Applies memory, pids and CPU limits to a running sandbox's cgroup (a warm
// sandbox handed to a session with limits of its own).
void apply_cgroup_limits(const RuncSandbox& sandbox, const SandboxLimits& limits);

}  // namespace cellblock
