// A session's sandbox as the server sees it, whatever backend runs it, and
// the settings of the runc backend (runc_sandbox.hpp).
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

// A session's sandbox, wherever its backend placed it (sandbox_backend.hpp):
// the seam between the pool, the policy and the relay, which hold only this,
// and the backends (runc on this host: runc_sandbox.hpp; a Docker Swarm
// service: swarm_backend.hpp). Figures a backend cannot give read as 0 or
// -1 and controls it cannot apply answer false; every backend can be
// interrupted, killed and destroyed.
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
    // The session directory on this host (input, output, ipc), or empty
    // where the sandbox has none here (a Swarm service on another node).
    virtual std::filesystem::path dir() const { return {}; }
    std::filesystem::path input_dir() const {
        return dir().empty() ? dir() : SessionDir(dir()).input();
    }
    std::filesystem::path output_dir() const {
        return dir().empty() ? dir() : SessionDir(dir()).output();
    }
    // The init's pid on this host; -1 where it runs elsewhere.
    virtual pid_t init_pid() const { return -1; }
    // The host ids its container ids map to (empty where not on this host).
    virtual IdMapping host_ids() const { return {0, 0}; }
    // Forked from a zygote rather than started by the runtime.
    virtual bool forked() const { return false; }

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
    virtual bool memory_limit_hit() const { return false; }
    // The end of what the shim and the kernel wrote to stderr (for errors).
    virtual std::string log_tail() const { return {}; }
    // Ended because the machine it ran on was lost, with all its state.
    virtual bool node_lost() const { return false; }

    // SIGINT to the kernel. False where the backend cannot signal it: the
    // relay then sends the kernel an interrupt_request on its control channel.
    virtual bool interrupt() = 0;
    virtual void kill() = 0;     // ends every process of the sandbox
    virtual void reap_init() {}  // waits for a killed init, where it is our child
    // Kills and removes every trace of the session. Idempotent; never throws.
    virtual void destroy() = 0;
    // Memory, pids and CPU limits for a sandbox handed over from the pool.
    // Throws SandboxError where they cannot be applied.
    virtual void apply_limits(const SandboxLimits& limits) = 0;

    virtual SandboxUsage usage() const { return {}; }
    // CPU weight (cgroup v1 cpu.shares scale, 1024 = default); false where
    // there is nothing to write.
    virtual bool set_cpu_weight(int /*shares*/) { return false; }
    // CFS quota in cores per period; 0 or less: none. False where unsupported.
    virtual bool set_cpu_quota(double /*cpus*/) { return false; }
    // Processes and threads (pids.current); -1 unknown.
    virtual std::int64_t task_count() const { return -1; }
    // 1 if one of its tasks is runnable now, 0 none, -1 unknown.
    virtual int any_task_runnable() const { return -1; }
    // Nice value of every thread (pool refills boot at 19).
    virtual void renice(int /*nice*/) {}

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
