// A running sandbox: an OCI container whose init is cellblock-shim, the
// session directory around it, and everything needed to destroy it without a trace.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellblock/connection_info.hpp"
#include "cellblock/host_ids.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

// A failure that names the step and the resource ("runc run cb-1f2e: ...").
class SandboxError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

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
    std::filesystem::path runtime_root() const { return state_dir / "runtime"; }
    std::filesystem::path sessions_dir() const { return state_dir / "sessions"; }
};

// The runtimes a session may ask for by name.
bool runtime_allowed(const std::string& name);  // runc, runsc, crun
// Whether `runtime` (a name looked up on the PATH cellblock gives its helpers,
// or a path) is an executable file on this host.
bool runtime_installed(const std::string& runtime);

// Peak and current figures read from the sandbox's cgroup.
struct SandboxUsage {
    std::uint64_t memory_peak_bytes = 0;
    std::uint64_t memory_bytes = 0;
    std::uint64_t cpu_ns = 0;
    std::uint64_t oom_kills = 0;
};

class Sandbox {
  public:
    // Creates the session directory (lock, bundle, capped ipc and output
    // mounts), writes the inner connection file, and starts the container
    // detached with the shim as init. Returns once the runtime has started it;
    // the kernel may still be importing. Throws SandboxError.
    // A zygote's container (zygote.hpp) is started here too, with its role.
    static std::unique_ptr<Sandbox> start(const std::string& session_id, const Image& image,
                                          const SandboxLimits& limits,
                                          const RuntimeSettings& settings,
                                          SandboxRole role = SandboxRole::session);
    ~Sandbox();  // destroy()
    Sandbox(const Sandbox&) = delete;
    Sandbox& operator=(const Sandbox&) = delete;

    const std::string& session_id() const { return session_id_; }
    const std::string& container_id() const { return container_id_; }
    // The inner connection as seen from the host (ipc paths in the session dir).
    const ConnectionInfo& inner_connection() const { return inner_; }
    std::filesystem::path dir() const { return dir_; }
    std::filesystem::path input_dir() const { return dir_ / "input"; }
    std::filesystem::path output_dir() const { return dir_ / "output"; }
    pid_t init_pid() const { return init_pid_; }
    // The host ids this sandbox's container ids map to, leased for its
    // lifetime: no other sandbox on the host runs as them meanwhile.
    const IdMapping& host_ids() const { return host_ids_.ids(); }

    // The runtime this sandbox runs on ("runc", "runsc", ...).
    const std::string& runtime() const { return settings_.runtime; }

    // Readable when the shim writes a status line or exits (EOF); the server
    // holds the other end, so the shim also sees EOF when the server dies.
    // Under runc/crun it is one end of a socketpair passed as the init's fd 3;
    // under runsc it is the one connection accepted on a socket in the ipc dir,
    // which is unlinked as soon as the shim is connected.
    int lifeline_fd() const { return lifeline_.get(); }
    // Reads what the shim reported; returns false once the shim is gone.
    bool read_lifeline();
    bool exited() const { return exited_; }
    // Why the kernel ended, in words: "kernel exited with status 1",
    // "kernel killed by signal 9 (memory limit of 512 MB reached)".
    std::string exit_description() const;
    bool memory_limit_hit() const;

    void interrupt();  // SIGINT to the kernel (through the shim: a signal, or a lifeline line)
    void kill();       // SIGKILL to every process of the sandbox
    void reap_init();  // waits for the killed init (a child of this subreaper)
    // Kills, deletes the container, unmounts and removes every file of the
    // session, removes its cgroup. Idempotent; never throws.
    void destroy();

    // Read from cgroup files opened once at start: this runs on every
    // execution's reply path, where a path lookup in cgroupfs (kernfs
    // revalidation per component) cost more than the read itself.
    SandboxUsage usage() const;
    // The sandbox's CPU weight relative to other sandboxes (cgroup v1
    // cpu.shares, 1024 = default; v2 cpu.weight is scaled to match).
    // Returns false when the sandbox has no CPU controller to write.
    bool set_cpu_weight(int shares);
    // The sandbox's CFS quota in cores per 100 ms period (cpu.cfs_quota_us,
    // v2 cpu.max); 0 or less: no quota. Returns false without such a file.
    bool set_cpu_quota(double cpus);
    // Processes and threads in the sandbox's cgroup (pids.current); -1 unknown.
    std::int64_t task_count() const;
    // 1 if one of them is runnable (state R) right now: the sandbox wants
    // CPU, whether it gets it or not; 0 none; -1 unknown. Reads /proc per
    // task, up to the first runnable one.
    int any_task_runnable() const;
    // Sets the nice value of every thread in the sandbox (the pool boots
    // refills at nice 19; a session's kernel runs at 0).
    void renice(int nice);
    const SandboxLimits& limits() const { return limits_; }
    // Records limits applied after start (a pooled sandbox handed to a session).
    void set_limits(const SandboxLimits& limits) { limits_ = limits; }
    const std::string& image_name() const { return image_name_; }
    // The image's preload modules (Image::preload).
    const std::vector<std::string>& preload() const { return preload_; }

    // Forked from a zygote rather than started by the runtime.
    bool forked() const { return forked_; }

  private:
    friend class Zygote;
    Sandbox() = default;
    // The session directory with its lock, host id lease, mounts and inner
    // connection file: everything before the sandbox's processes exist.
    static std::unique_ptr<Sandbox> prepare(const std::string& session_id, const Image& image,
                                            const SandboxLimits& limits,
                                            const RuntimeSettings& settings);
    bool forked_ = false;
    // A forked session's zygote, kept (with the root it runs on) until the
    // session is destroyed, whatever the pool does with it meanwhile.
    std::shared_ptr<void> keep_;
    std::string session_id_;
    std::string container_id_;
    std::filesystem::path dir_;
    RuntimeSettings settings_;
    SandboxLimits limits_;
    ConnectionInfo inner_;
    pid_t init_pid_ = -1;
    pid_t gofer_pid_ = -1;  // runsc: the gofer, also our child once runsc run returns
    UniqueFd lifeline_;
    UniqueFd lock_fd_;
    UniqueFd version_fd_;   // a stored image version held (hold_stored_version)
    HostIdLease host_ids_;  // released in destroy(), once nothing of the sandbox is left
    bool exited_ = false;
    bool destroyed_ = false;
    bool reaped_ = false;
    std::string shim_status_;
    std::string image_name_;
    std::vector<std::string> preload_;
    std::vector<std::filesystem::path> cgroup_dirs_;  // found once the container exists
    // Kept-open cgroup files (-1 where the controller or file is absent).
    struct CounterFiles {
        int memory_peak = -1, memory_usage = -1, oom_control = -1, cpu_usage = -1;
        int cpu_weight = -1, cpu_quota = -1, pids_current = -1;
        bool cpu_weight_v2 = false, cpu_quota_v2 = false;
    } counters_;
    void open_counters();
    void close_counters();
};

// Removes what earlier cellblock processes left behind: sessions whose lock
// is not held (their owner died) are killed, deleted, unmounted and removed.
// Returns the ids of the sessions reaped.
std::vector<std::string> reap_abandoned_sessions(const RuntimeSettings& settings);

// Removes cellblock's empty `cb-*` cgroups (every controller) that are older
// than `min_age`: what runs killed mid-way leave when their session
// directory is already gone. A cgroup with tasks is never removed (the
// kernel refuses), and the age keeps a sandbox that another server is
// creating at this moment out of reach. Returns the paths removed.
std::vector<std::filesystem::path> remove_orphan_cgroups(std::chrono::seconds min_age);

// The cgroup directories (one per v1 controller, or the v2 one) of a container.
std::vector<std::filesystem::path> sandbox_cgroup_dirs(const std::string& container_id);

// Applies memory, pids and CPU limits to a running sandbox's cgroup (a warm
// sandbox handed to a session with limits of its own).
void apply_cgroup_limits(const Sandbox& sandbox, const SandboxLimits& limits);

}  // namespace cellblock
