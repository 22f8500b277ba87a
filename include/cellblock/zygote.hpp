// A per-image zygote: an interpreter that imported the kernel and the image's
// preload once, from which sessions are forked (docs/zygote.md). Each fork
// becomes a Sandbox with the isolation of a booted one: namespaces of its
// own (a user namespace mapping the session's own host id range), cgroups of
// its own, private mounts, no capabilities, no_new_privs, the session seccomp
// profile and the lifeline; it never depends on the zygote after the fork.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "cellblock/runc_sandbox.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

// The BPF program libseccomp makes of an OCI seccomp section (what runc
// would load), as raw `struct sock_filter` bytes. Throws SandboxError.
std::string compile_seccomp_bpf(const nlohmann::json& profile);

// The host does not let a fork contain itself (no unprivileged user
// namespaces, or no mounts in them): the zygote asked once, at its start. The
// image's sessions are booted instead (RuncBackend).
class ForkingRefused : public SandboxError {
  public:
    using SandboxError::SandboxError;
};

class Zygote : public std::enable_shared_from_this<Zygote> {
  public:
    // Starts the zygote container of `image` and waits until it has imported
    // everything and answers. Throws SandboxError (with the zygote's log), or
    // ForkingRefused (the container is destroyed again) when this host does
    // not let a fork do what a session's containment needs.
    static std::shared_ptr<Zygote> start(const Image& image, const RuntimeSettings& settings,
                                         std::chrono::milliseconds timeout);
    ~Zygote();  // destroys the container; the sessions forked from it go on
    Zygote(const Zygote&) = delete;
    Zygote& operator=(const Zygote&) = delete;

    // A new session forked from the zygote, contained and running its
    // kernel (which may still be starting: probe it as a booted one).
    // Serialised per zygote. Throws SandboxError; the zygote is then
    // alive() or not, which the caller checks before the next fork.
    std::unique_ptr<RuncSandbox> fork(const std::string& session_id, const SandboxLimits& limits,
                                      const RuntimeSettings& settings);

    bool alive();
    // Ends the zygote's processes: it forks no more (its image has a new
    // version). Its files stay until the last session forked from it is gone.
    void retire();
    const Image& image() const { return image_; }
    // The zygote container's init (the shim), and the interpreter itself.
    pid_t init_pid() const { return box_->init_pid(); }
    pid_t interpreter_pid() const { return interpreter_pid_; }
    const std::string& container_id() const { return box_->container_id(); }

  private:
    class ForkInProgress;  // fork's steps (sessions/zygote_fork.cpp)
    Zygote() = default;
    Image image_;
    std::unique_ptr<RuncSandbox> box_;
    UniqueFd control_;
    pid_t interpreter_pid_ = -1;
    std::mutex mutex_;
};

}  // namespace cellblock
