// Warm sandboxes per image, started in the background, and the worker
// threads that do slow sandbox work (cold starts, destruction) off the
// server's loop.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/sandbox_backend.hpp"

namespace cellblock {

// The server's connected channels to a kernel (server/inner_channels.hpp):
// made by the server's probe, carried here with the sandbox, never opened.
struct InnerChannels;

// Waits until the sandbox's kernel answers (kernel_info), or throws
// SandboxError. Provided by the server (it needs ZMQ); the channels it
// returns travel with the sandbox. `background` is true for a pool refill,
// which no client waits for (the probe may then do more, e.g. warm the
// kernel up).
using ReadinessProbe = std::function<std::shared_ptr<InnerChannels>(Sandbox&, bool background)>;

// A started sandbox whose kernel answered, with the probe's channels.
struct WarmSandbox {
    std::unique_ptr<Sandbox> sandbox;
    std::shared_ptr<InnerChannels> channels;
    explicit operator bool() const { return sandbox != nullptr; }
};

struct PoolImage {
    Image image;
    SandboxLimits limits;  // what pooled sandboxes of this image are started with
    int target = 0;        // warm sandboxes to keep
};

// A started sandbox, or why starting failed; delivered to the loop.
struct StartResult {
    std::uint64_t ticket = 0;
    WarmSandbox warm;
    std::string error;  // empty on success
    double start_ms = 0;
};

class SandboxPool {
  public:
    // `notify` is called from a worker thread whenever a StartResult or a
    // warm sandbox is ready (the server wakes its loop with it); it must not block.
    // Sandboxes are started by `backend` (sandbox_backend.hpp), on the
    // worker threads.
    SandboxPool(std::shared_ptr<SandboxBackend> backend, ReadinessProbe probe,
                std::vector<PoolImage> images, std::function<void()> notify, int workers = 2);
    ~SandboxPool();  // stops workers, destroys every sandbox still held
    SandboxPool(const SandboxPool&) = delete;
    SandboxPool& operator=(const SandboxPool&) = delete;

    // A warm sandbox of `image` that the backend says can serve `limits`
    // (SandboxBackend::can_serve), or nullptr; a session that asks for
    // another runtime is a cold start with a copy of the image.
    // The rest of its limits are applied to it here (Sandbox::apply_limits).
    // Never blocks on sandbox work. Refill is scheduled in the background.
    WarmSandbox take(const std::string& image, const SandboxLimits& limits);

    // Starts a sandbox in the background (cold start); its StartResult with
    // the returned ticket arrives through drain_results(). Cold starts run
    // in the order they were asked for (before refills, after destructions);
    // tickets grow in that order.
    std::uint64_t start_cold(const std::string& session_id, const Image& image,
                             const SandboxLimits& limits);
    // Drops a cold start that no worker has begun; false once one has (its
    // StartResult will still arrive).
    bool cancel_cold(std::uint64_t ticket);
    std::vector<StartResult> drain_results();

    // Destroys a sandbox in the background.
    void dispose(std::unique_ptr<Sandbox> sandbox);

    // The pool of `config.image.name` from now on holds `config` (a rebuilt
    // image's new version, or target 0 once its name is gone): the warm
    // sandboxes of the old version are destroyed, refills not yet begun are
    // dropped, and one that finishes booting the old version is destroyed
    // instead of pooled. An image without a pool gets one.
    void replace_image(PoolImage config);

    // {image: {ready, starting, target, failures, last_error}}
    nlohmann::json state() const;
    // The warm sandboxes held: [{image, container_id, init_pid}] (`cellblock ls`).
    nlohmann::json warm_sandboxes() const;
    // What the backend runs besides sessions (SandboxBackend::extras: the
    // runc backend's zygotes, the Swarm's nodes).
    nlohmann::json extras();
    SandboxBackend& backend() { return *backend_; }
    std::size_t ready(const std::string& image) const;
    // Blocks until every image has `target` ready sandboxes or the timeout passes (tests,
    // benchmarks).
    bool wait_until_full(std::chrono::milliseconds timeout) const;

  private:
    struct Job {
        enum Kind { refill, cold, destroy } kind;
        std::string image;
        std::string session_id;
        Image image_def;
        SandboxLimits limits;
        std::uint64_t ticket = 0;
        std::unique_ptr<Sandbox> sandbox;
        // A refill after a take waits a moment: the new session's first
        // steps usually follow at once, and a kernel booting beside them on
        // a small machine would slow them (see kRefillDelay).
        std::chrono::steady_clock::time_point not_before{};
        std::uint64_t generation = 0;  // the slot's, when a refill was queued
    };
    struct Slot {
        PoolImage config;
        std::deque<WarmSandbox> ready;
        int starting = 0;
        int failures = 0;
        std::string last_error;
        std::uint64_t generation = 0;  // bumped by replace_image
    };

    void work();
    void schedule_refills_locked(std::chrono::milliseconds delay = {});
    void dispose_locked(std::unique_ptr<Sandbox> sandbox);
    WarmSandbox start_and_probe(const std::string& session_id, const Image& image,
                                const SandboxLimits& limits, bool background);

    std::shared_ptr<SandboxBackend> backend_;
    ReadinessProbe probe_;
    std::function<void()> notify_;
    mutable std::mutex mutex_;
    mutable std::condition_variable changed_;
    std::map<std::string, Slot> slots_;
    std::deque<Job> jobs_;
    std::vector<StartResult> results_;
    std::uint64_t next_ticket_ = 1;
    bool stopping_ = false;
    std::vector<std::thread> workers_;
};

// A fresh session id: 16 lowercase hex characters from a CSPRNG.
std::string make_session_id();

}  // namespace cellblock
