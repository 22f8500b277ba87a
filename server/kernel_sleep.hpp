// Hibernation in kernel mode (docs/hibernation.md, "Kernel mode"): the one
// session of a `cellblock kernel` process sleeps after hibernate_after_s
// like a served one. Its snapshot is kept under
// STATE_DIR/kernel-snapshots/<pid>-<start ticks>/ (the process's own, so a
// later kernel removes what a dead one left) and its wake starts a new
// sandbox of the same image off the event loop (the relay keeps answering
// heartbeats meanwhile), then hands it over.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "cellblock/image.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/unique_fd.hpp"
#include "event_loop.hpp"
#include "inner_channels.hpp"
#include "session_core.hpp"
#include "session_snapshots.hpp"

namespace cellblock {

// Also the session's observer: a resume done, the snapshot leaves the new
// sandbox's /data/input (kernel mode keeps no audit of its own).
class KernelSleep : public SessionObserver {
  public:
    // A new sandbox is awake for the session: attach it (or dispose of it).
    using Woken = std::function<void(std::unique_ptr<RuncSandbox>, std::unique_ptr<InnerChannels>)>;
    // The wake failed: close the session with "resume_failed: <why>".
    using Failed = std::function<void(const std::string& why)>;

    KernelSleep(EventLoop& loop, zmq::context_t& context, std::string session_id, Image image,
                SandboxLimits limits, RuntimeSettings settings, RelayTransport transport,
                std::filesystem::path store_root);
    ~KernelSleep() override;  // waits for a wake under way, drops the snapshot
    KernelSleep(const KernelSleep&) = delete;
    KernelSleep& operator=(const KernelSleep&) = delete;

    void on_woken(Woken woken, Failed failed);
    // ProxyOptions::keep_snapshot and ::wake.
    bool keep(Sandbox& box, const nlohmann::json& report, std::string& why);
    void wake();
    // ProxyOptions::saving_snapshot and ::snapshot_unsaved: the snapshot is
    // sealed on a thread while the kernel writes it; keep() then waits, on
    // the loop, for what is left (one session per process: nobody else waits).
    void saving(Sandbox& box);
    void unsaved();

    void on_execution(const ExecutionRecord&) override {}
    void on_state(const std::string&, const std::string&) override {}
    void on_event(const std::string& session_id, const std::string& kind,
                  const std::string& detail) override;
    void on_closed(const std::string&, const std::string&) override {}

  private:
    struct Awake {
        std::unique_ptr<RuncSandbox> sandbox;
        std::unique_ptr<InnerChannels> channels;
        std::string error;
    };
    Awake start_sandbox();
    void finish();
    void stop_sealing();  // a streamed keep nobody waits for: stopped, dropped

    EventLoop& loop_;
    zmq::context_t& context_;
    std::string session_id_;
    Image image_;
    SandboxLimits limits_;
    RuntimeSettings settings_;
    RelayTransport transport_;
    std::filesystem::path root_;  // this process's own dir under the store root
    SnapshotStore store_;
    UniqueFd done_fd_;
    EventLoop::WatchId watch_{};
    std::future<Awake> waking_;
    std::atomic<bool> abandoned_{false};
    int wakes_ = 0;
    std::filesystem::path placed_in_;  // the new sandbox's input dir, until the restore read it
    // A keep begun as the save was sent (saving()), its thread, and what the
    // thread threw (read once it is joined).
    std::shared_ptr<SnapshotKeeping> streamed_;
    std::chrono::steady_clock::time_point streamed_at_;
    std::thread sealing_;
    std::string sealing_error_;
    Woken woken_;
    Failed failed_;
};

}  // namespace cellblock
