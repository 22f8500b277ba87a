// Where sandboxes live: the operations the pool and the server need from a
// placement backend. The runc backend (this host) and the Docker Swarm
// backend (swarm_backend.hpp) sit behind it; the pool, the policy and the
// relay do not know which one they use. docs/scale-out.md.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/sandbox.hpp"

namespace cellblock {

// A session a backend cannot run, said before anything starts: the ename the
// client gets (error_names.hpp) and why, in words.
struct BackendRefusal {
    std::string_view ename;
    std::string message;
};

class SandboxBackend {
  public:
    virtual ~SandboxBackend() = default;

    // "runc" (with the image's runtime: runc, runsc, crun) or "swarm".
    virtual std::string name() const = 0;

    // Starts a session's sandbox from an image and limits and returns once
    // it is started (its kernel may still be importing: the server's
    // readiness probe waits for the kernel). `background`: a pool refill,
    // which may start at a lower priority than a create a client waits for.
    // Throws SandboxError naming the step that failed. Called from the
    // pool's worker threads, several at once.
    virtual std::unique_ptr<Sandbox> start(const std::string& session_id, const Image& image,
                                           const SandboxLimits& limits, bool background) = 0;

    // The exact level's wake (docs/hibernation.md): a new sandbox of the
    // image, restored by its runtime from the image `place` puts in the dirs
    // it is given (with the session's files), returning the secrets of the
    // sandbox checkpointed (SandboxCheckpoint::restore_secrets). Blocks: off
    // the loop. Throws SandboxError; null where the backend has no restore.
    virtual std::unique_ptr<Sandbox> restore(
        const std::string& /*session_id*/, const Image& /*image*/, const SandboxLimits& /*limits*/,
        const std::function<nlohmann::json(const RestoreDirs&)>& /*place*/) {
        return nullptr;
    }

    // Why this backend cannot run a session of `image` (on the runtime the
    // image names, or the request chose), or nullopt when it can. Asked
    // before a create is queued, so a client learns it at once.
    virtual std::optional<BackendRefusal> refuse(const Image& image) const = 0;
    // Whether a warm sandbox started with `pooled` limits can serve a
    // session that asks for `wanted` (what apply_limits cannot change later).
    virtual bool can_serve(const Image& image, const SandboxLimits& pooled,
                           const SandboxLimits& wanted) const = 0;

    // What this backend runs for this server beyond the sessions the server
    // holds: [{kind, image, container_id, ...}] (`cellblock ls`).
    virtual nlohmann::json extras() { return nlohmann::json::array(); }

    // The pool is stopping: starts under way give up (SandboxError) as soon
    // as they can, rather than wait for a placement nobody will take.
    virtual void abandon_starts() {}

    // The pool now holds `image` (a rebuilt version), or the image is
    // `removed`: whatever the backend keeps for an older version (a zygote)
    // is let go.
    virtual void image_changed(const Image& /*image*/, bool /*removed*/) {}
};

}  // namespace cellblock
