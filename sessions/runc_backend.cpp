// The runc backend (runc_backend.hpp): start or fork, per image.
#include "cellblock/runc_backend.hpp"
#include "cellblock/sandbox_tuning.hpp"

#include <sys/stat.h>

#include <cstdio>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "cellblock/error_names.hpp"
#include "cellblock/sandbox_pool.hpp"

namespace cellblock {
namespace {

// runc maps the container's root to an unprivileged host id, which must be
// able to reach the bundle: every ancestor of the state dir must be searchable.
// (A Swarm node has its own state; this is the runc backend's concern alone.)
void check_state_dir_reachable(const std::filesystem::path& state_dir) {
    for (auto p = state_dir.parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path()) {
        struct stat st {};
        if (::stat(p.c_str(), &st) == 0 && !(st.st_mode & S_IXOTH)) {
            char mode[8];
            std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
            throw std::runtime_error("state dir " + state_dir.string() + ": " + p.string() +
                                     " (mode " + mode +
                                     ") is not searchable by the sandboxes' mapped users; "
                                     "choose a state dir under /var/lib or /run, or chmod o+x it");
        }
    }
}

}  // namespace

RuncBackend::RuncBackend(RuntimeSettings settings) : settings_(std::move(settings)) {
    check_state_dir_reachable(settings_.state_dir);
}

RuncBackend::~RuncBackend() {
    std::lock_guard lock(zygotes_mutex_);
    zygotes_.clear();
}

std::unique_ptr<Sandbox> RuncBackend::start(const std::string& session_id, const Image& image,
                                            const SandboxLimits& limits, bool background) {
    RuntimeSettings settings = settings_;
    // A refill boots (and warms up) at a low CPU weight: on a busy machine it
    // yields to the sessions in use, whose next step would otherwise wait
    // behind a kernel starting. A cold start has a client waiting: default weight.
    if (background) settings.start_cpu_shares = tuning::kBackgroundCpuShares;
    if (!image.runtime.empty()) settings.runtime = image.runtime;
    if (image.zygote && runtime_kind(settings.runtime) == RuntimeKind::runc) {
        try {
            return fork_session(session_id, image, limits, settings);
        } catch (const ForkingRefused&) {
            // Booted like an image without a zygote (zygote_for logged why, once).
        }
    }
    return RuncSandbox::start(session_id, image, limits, settings);
}

std::unique_ptr<Sandbox> RuncBackend::restore(
    const std::string& session_id, const Image& image, const SandboxLimits& limits,
    const std::function<nlohmann::json(const RestoreDirs&)>& place) {
    RuntimeSettings settings = settings_;
    if (!image.runtime.empty()) settings.runtime = image.runtime;
    return RuncSandbox::restore(session_id, image, limits, settings, place);
}

std::optional<BackendRefusal> RuncBackend::refuse(const Image& image) const {
    if (runtime_installed(image.runtime)) return std::nullopt;
    return BackendRefusal{ename::UnknownRuntime,
                          "runtime '" + image.runtime + "' is not installed on this host"};
}

bool RuncBackend::can_serve(const Image& image, const SandboxLimits& a,
                            const SandboxLimits& b) const {
    const RuntimeKind kind =
        runtime_kind(image.runtime.empty() ? settings_.runtime : image.runtime);
    return a.disk_mb == b.disk_mb && a.shm_mb == b.shm_mb && a.output_mb == b.output_mb &&
           a.nofile == b.nofile && (kind != RuntimeKind::runsc || a.pids == b.pids);
}

std::shared_ptr<Zygote> RuncBackend::zygote_for(const Image& image,
                                                const RuntimeSettings& settings) {
    std::lock_guard lock(zygotes_mutex_);
    if (const auto it = refused_.find(image.name);
        it != refused_.end() && it->second.content_id == image.content_id) {
        throw ForkingRefused(it->second.why);
    }
    auto& zygote = zygotes_[image.name];
    if (zygote && (zygote->image().content_id != image.content_id || !zygote->alive())) {
        spdlog::info("zygote of image {}: {}", image.name,
                     zygote->alive() ? "a new version; replaced" : "gone; restarting it");
        // Nothing of the old version runs but the sessions forked from it.
        zygote->retire();
        zygote.reset();
    }
    if (!zygote) {
        try {
            zygote = Zygote::start(image, settings, tuning::kZygoteStartTimeout);
        } catch (const ForkingRefused& e) {
            spdlog::warn("zygote of image {}: {}; its sessions boot instead (docs/zygote.md)",
                         image.name, e.what());
            refused_[image.name] = {image.content_id, e.what()};
            zygotes_.erase(image.name);
            throw;
        }
    }
    return zygote;
}

std::unique_ptr<RuncSandbox> RuncBackend::fork_session(const std::string& session_id,
                                                       const Image& image,
                                                       const SandboxLimits& limits,
                                                       const RuntimeSettings& settings) {
    std::shared_ptr<Zygote> zygote = zygote_for(image, settings);
    try {
        return zygote->fork(session_id, limits, settings);
    } catch (const SandboxError& e) {
        if (zygote->alive()) throw;
        // The zygote died under this fork (or before it): once more with a new one.
        spdlog::warn("zygote of image {} failed a fork and is gone ({}); restarting it", image.name,
                     e.what());
        return zygote_for(image, settings)->fork(session_id, limits, settings);
    }
}

void RuncBackend::image_changed(const Image& image, bool removed) {
    std::shared_ptr<Zygote> old;
    {
        std::lock_guard lock(zygotes_mutex_);
        if (removed) refused_.erase(image.name);
        auto it = zygotes_.find(image.name);
        if (it == zygotes_.end() || !it->second) return;
        if (!removed && it->second->image().content_id == image.content_id) return;
        old = std::move(it->second);
        zygotes_.erase(it);
    }
    spdlog::info("zygote of image {}: {}; retired", image.name,
                 removed ? "the image is gone" : "a new version");
    old->retire();
}

nlohmann::json RuncBackend::extras() {
    std::lock_guard lock(zygotes_mutex_);
    nlohmann::json out = nlohmann::json::array();
    for (const auto& [name, zygote] : zygotes_) {
        if (!zygote) continue;
        out.push_back({{"kind", "zygote"},
                       {"image", name},
                       {"container_id", zygote->container_id()},
                       {"init_pid", zygote->init_pid()},
                       {"interpreter_pid", zygote->interpreter_pid()}});
    }
    for (const auto& [name, refusal] : refused_) {
        out.push_back({{"kind", "zygote_refused"}, {"image", name}, {"why", refusal.why}});
    }
    return out;
}

}  // namespace cellblock
