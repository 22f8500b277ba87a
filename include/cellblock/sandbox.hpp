// A session's sandbox as the server sees it, whatever backend runs it: its
// lifecycle, and the capabilities a backend may offer (files, CPU controls,
// processes on this host). The runc backend's settings are in runc_sandbox.hpp.
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
#include "cellblock/session_dir.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

// A failure that names the step and the resource ("runc run cb-1f2e: ...").
class SandboxError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Peak and current figures read from the sandbox's cgroup.
struct SandboxUsage {
    std::uint64_t memory_peak_bytes = 0;
    std::uint64_t memory_bytes = 0;
    std::uint64_t cpu_ns = 0;
    std::uint64_t oom_kills = 0;
};

// What a backend's sandbox may offer beyond the lifecycle every sandbox has
// (Sandbox below asks for each; null where the backend does not offer it).

// The session's /data/input and /data/output are directories on this host,
// which the server writes and reads for file transfers.
class SandboxFiles {
  public:
    virtual std::filesystem::path input_dir() const = 0;
    virtual std::filesystem::path output_dir() const = 0;
    // Where an upload is written before it is moved into input_dir() (the
    // same filesystem), out of the sandbox's sight.
    virtual std::filesystem::path staging_dir() const = 0;

  protected:
    ~SandboxFiles() = default;
};

// CPU controls and the figures CPU fairness needs (cgroup cpu and pids).
class SandboxCpu {
  public:
    // CPU weight (cgroup v1 cpu.shares scale, 1024 = default); false when
    // the write failed.
    virtual bool set_cpu_weight(int shares) = 0;
    // CFS quota in cores per period; 0 or less: none.
    virtual bool set_cpu_quota(double cpus) = 0;
    // cgroup cpu.idle: the sandbox's tasks run only when no sibling that is
    // not idle wants the CPU (SCHED_IDLE as a group); false when the write
    // failed. A weight cannot be written while idle.
    virtual bool set_cpu_idle(bool idle) = 0;
    // Processes and threads (pids.current); -1 unknown.
    virtual std::int64_t task_count() const = 0;
    // How many of its tasks are runnable now, counting up to `at_most`
    // (reading stops there); -1 unknown.
    virtual int runnable_tasks(int at_most) const = 0;
    // Nice value of every thread (pool refills boot at 19).
    virtual void renice(int nice) = 0;
    // Every thread's EEVDF slice in microseconds, 0 the kernel's default
    // (sched_slice.hpp): short while the session is interactive.
    virtual void set_slice(std::uint32_t us) = 0;
    // The CPUs its tasks may run on (cgroup cpuset.cpus, a list such as "1"
    // or "1-3"); empty: the ones it was started with. False without a
    // cpuset controller for it, or when the write was refused.
    virtual bool set_cpus(const std::string& cpus) = 0;

  protected:
    ~SandboxCpu() = default;
};

// The exact level of hibernation (docs/hibernation.md): a sandbox its
// runtime checkpoints whole (runsc), its kernel's channels bridged by its
// shim so that it can let go of every host socket first.
class SandboxCheckpoint {
  public:
    // The shim closes every host socket it holds (kQuiesceLine) and the
    // lifeline ends; false with why when it did not say so within `wait`
    // (the sandbox then runs on as it was).
    virtual bool quiesce(std::chrono::milliseconds wait, std::string& why) = 0;
    // The runtime's image of the quiesced sandbox into `image_dir`
    // (kCheckpointImage); returns once the sandbox has ended. Blocks: off
    // the loop. Throws SandboxError with the runtime's words.
    virtual void checkpoint(const std::filesystem::path& image_dir) = 0;
    // What its restore needs that the sandbox must not see: the kernel's
    // key ("inner_key") and the key its shim shows ("adopt_key").
    virtual nlohmann::json restore_secrets() const = 0;

  protected:
    ~SandboxCheckpoint() = default;
};

// Where a restore puts what it was kept with: the runtime's image into
// `image_dir`, the session's files into its new output and input dirs, as
// the user `uid` (SandboxBackend::restore).
struct RestoreDirs {
    std::filesystem::path image_dir, output_dir, input_dir;
    std::uint32_t uid = 0;
};

// The sandbox's processes run on this host, as this server's children.
class HostProcess {
  public:
    // The session directory (ipc, input, output, log, bundle).
    virtual const SessionDir& session_dir() const = 0;
    // The init's pid on this host.
    virtual pid_t init_pid() const = 0;
    // The host ids its container ids map to.
    virtual IdMapping host_ids() const = 0;
    // Forked from a zygote rather than started by the runtime.
    virtual bool forked() const = 0;
    // Waits for a killed init (our child: we are a subreaper).
    virtual void reap_init() = 0;

  protected:
    ~HostProcess() = default;
};

// A session's sandbox, wherever its backend placed it (sandbox_backend.hpp):
// the seam between the pool, the policy and the relay, which hold only this,
// and the backends (runc on this host: runc_sandbox.hpp; a Docker Swarm
// service: swarm_backend.hpp). Every backend starts, watches, interrupts,
// kills and destroys its sandboxes and reports their usage; what only some
// can do is a capability (files(), cpu(), host_process()), null where absent.
class Sandbox {
  public:
    virtual ~Sandbox() = default;
    Sandbox(const Sandbox&) = delete;
    Sandbox& operator=(const Sandbox&) = delete;

    const std::string& session_id() const { return session_id_; }
    // The backend's name for it: the runc container id, the Swarm service id.
    const std::string& container_id() const { return container_id_; }
    // The inner connection as seen from the server (ipc paths in the session
    // dir, or the host and ports a Swarm node publishes).
    const ConnectionInfo& inner_connection() const { return inner_; }
    const SandboxLimits& limits() const { return limits_; }
    // Records limits applied after start (a pooled sandbox handed to a session).
    void set_limits(const SandboxLimits& limits) { limits_ = limits; }
    const std::string& image_name() const { return image_name_; }
    // The image's preload modules (Image::preload).
    const std::vector<std::string>& preload() const { return preload_; }

    // The backend ("runc", "runsc", "crun", "swarm").
    virtual const std::string& runtime() const = 0;

    // Readable when something about the sandbox's life changed (the shim
    // wrote a line, it exited, its node was lost); read_lifeline() then
    // says whether it still lives.
    virtual int lifeline_fd() const = 0;
    virtual bool read_lifeline() = 0;
    virtual bool exited() const = 0;
    // Why the kernel ended, in words: "kernel exited with status 1",
    // "kernel killed by signal 9 (memory limit of 512 MB reached)",
    // "node worker-2 is down".
    virtual std::string exit_description() const = 0;
    // Whether the sandbox's memory limit was reached (its kernel then dies
    // with the OOM killer's signal).
    virtual bool memory_limit_hit() const = 0;
    // The end of what the shim and the kernel wrote to stderr (for errors).
    virtual std::string log_tail() const = 0;
    // Ended because the machine it ran on was lost, with all its state.
    virtual bool node_lost() const = 0;
    // Still running, but not for long: its node is being drained (a Swarm
    // worker set to availability "drain"; the engine stops the task once its
    // stop grace is over). The session moves: it hibernates and wakes in a
    // new sandbox elsewhere (docs/restarts.md, "Drained nodes"). Said through
    // lifeline_fd like an exit; read_lifeline() stays true.
    virtual bool moving() const { return false; }
    // Whether kill() leaves the kernel running for a while (a Swarm task is
    // stopped with its service's stop grace, which its shim holds while a
    // front is attached): the relay first asks the kernel itself to exit
    // (cellblock_exit_request).
    virtual bool kill_is_slow() const { return false; }
    // Memory and CPU figures (0 where the backend cannot read one).
    virtual SandboxUsage usage() const = 0;
    // What the kernel reported of its own cgroup on a reply
    // (cellblock_ipykernel's `metadata.cellblock_source.usage`). A sandbox
    // whose cgroups the server cannot read (a Swarm task, on another node)
    // keeps it as its usage() from then and says true; any other ignores it
    // (false): the host's readings are the ones to trust. The session's own
    // code can change what its kernel reports, so a kept report is only ever
    // that session's own figure, never a judge of another.
    virtual bool take_reported_usage(const SandboxUsage&) { return false; }

    // SIGINT to the kernel. False where the backend cannot signal it: the
    // relay then sends the kernel an interrupt_request on its control channel.
    virtual bool interrupt() = 0;
    virtual void kill() = 0;  // ends every process of the sandbox
    // Kills and removes every trace of the session. Idempotent; never throws.
    virtual void destroy() = 0;
    // Memory, pids and CPU limits for a sandbox handed over from the pool.
    // Throws SandboxError where they cannot be applied.
    virtual void apply_limits(const SandboxLimits& limits) = 0;

    // What a restarted server needs to take the sandbox back after a crash
    // (docs/restarts.md): sealed in the session's live row, read by its
    // backend's adopt. Null for a sandbox that cannot be adopted.
    virtual std::optional<nlohmann::json> adoption_record() const { return std::nullopt; }

    // Capabilities.
    virtual SandboxFiles* files() { return nullptr; }
    virtual SandboxCpu* cpu() { return nullptr; }
    virtual HostProcess* host_process() { return nullptr; }
    virtual SandboxCheckpoint* checkpointable() { return nullptr; }

  protected:
    Sandbox() = default;
    std::string session_id_;
    std::string container_id_;
    ConnectionInfo inner_;
    SandboxLimits limits_;
    std::string image_name_;
    std::vector<std::string> preload_;
};

}  // namespace cellblock
