// The runc backend: sandboxes on this host, started by the image's OCI
// runtime (runc, runsc, crun) or forked from the image's zygote.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_backend.hpp"
#include "cellblock/zygote.hpp"

namespace cellblock {

class RuncBackend final : public SandboxBackend {
  public:
    // Throws when a sandbox's mapped user could not reach the state dir's
    // bundles (an ancestor that others cannot search), naming it and its mode.
    explicit RuncBackend(RuntimeSettings settings);
    ~RuncBackend() override;

    std::string name() const override { return "runc"; }
    // Each image (or a session's request, through a copy of it) names its
    // runtime. A zygote image under runc is forked from its zygote (one is
    // started, or restarted after a crash, when needed).
    std::unique_ptr<Sandbox> start(const std::string& session_id, const Image& image,
                                   const SandboxLimits& limits, bool background) override;
    // Mount sizes and rlimits are fixed at start; under runsc the pids limit
    // is an rlimit too (enforced inside the Sentry, where the host cannot
    // change it).
    // The image's runtime must be installed on this host.
    std::unique_ptr<Sandbox> restore(
        const std::string& session_id, const Image& image, const SandboxLimits& limits,
        const std::function<nlohmann::json(const RestoreDirs&)>& place) override;
    std::optional<BackendRefusal> refuse(const Image& image) const override;
    bool can_serve(const Image& image, const SandboxLimits& pooled,
                   const SandboxLimits& wanted) const override;
    // The zygotes running: [{kind: zygote, image, container_id, init_pid, interpreter_pid}],
    // and the zygote images whose sessions boot because the host refused
    // forking: [{kind: zygote_refused, image, why}].
    nlohmann::json extras() override;
    // A zygote of an older version, or of an image that is gone, is retired
    // at once (its forked sessions keep what they run on until they end).
    void image_changed(const Image& image, bool removed) override;

    const RuntimeSettings& settings() const { return settings_; }

  private:
    std::unique_ptr<RuncSandbox> fork_session(const std::string& session_id, const Image& image,
                                              const SandboxLimits& limits,
                                              const RuntimeSettings& settings);
    std::shared_ptr<Zygote> zygote_for(const Image& image, const RuntimeSettings& settings);

    RuntimeSettings settings_;
    // One zygote per image name (of the version last asked for). A session
    // forked from one keeps it (and the files it runs on) until it ends.
    std::mutex zygotes_mutex_;
    std::map<std::string, std::shared_ptr<Zygote>> zygotes_;
    // Per image name: the version (content id) whose zygote found that this
    // host refuses forking, and why. Its sessions boot; a new version asks again.
    struct Refusal {
        std::string content_id;
        std::string why;
    };
    std::map<std::string, Refusal> refused_;
};

}  // namespace cellblock
