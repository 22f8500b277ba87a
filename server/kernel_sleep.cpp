#include "kernel_sleep.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <utility>

#include <spdlog/spdlog.h>

#include "cellblock/session_dir.hpp"
#include "cellblock/signer.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

// Field 22 of /proc/PID/stat, the process's start in clock ticks since
// boot, or "" when it is gone: with the pid, who a process is.
std::string start_ticks(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) return "";
    std::istringstream fields(line.substr(close + 2));
    std::string field;
    for (int i = 3; i <= 22 && fields >> field; ++i) {
        if (i == 22) return field;
    }
    return "";
}

// Removes the dirs of kernel processes that are gone (one killed while its
// session slept) and returns this process's own.
fs::path own_root(const fs::path& root) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
        const std::string name = entry.path().filename().string();
        const auto dash = name.find('-');
        pid_t pid = 0;
        try {
            pid = static_cast<pid_t>(std::stol(name.substr(0, dash)));
        } catch (const std::exception&) {
            continue;  // not one of ours
        }
        if (dash == std::string::npos || pid <= 0) continue;
        if (start_ticks(pid) == name.substr(dash + 1)) continue;  // its kernel lives
        spdlog::info("removing {}: its kernel process is gone", entry.path().string());
        fs::remove_all(entry.path(), ec);
    }
    return root / (std::to_string(::getpid()) + "-" + start_ticks(::getpid()));
}

}  // namespace

KernelSleep::KernelSleep(EventLoop& loop, zmq::context_t& context, std::string session_id,
                         Image image, SandboxLimits limits, RuntimeSettings settings,
                         RelayTransport transport, std::filesystem::path store_root)
    : loop_(loop),
      context_(context),
      session_id_(std::move(session_id)),
      image_(std::move(image)),
      limits_(limits),
      settings_(std::move(settings)),
      transport_(transport),
      root_(own_root(store_root)),
      store_(root_),
      done_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (!done_fd_) throw std::system_error(errno, std::generic_category(), "eventfd");
    watch_ = loop_.watch_fd(done_fd_.get(), [this] { finish(); });
}

KernelSleep::~KernelSleep() {
    loop_.unwatch(watch_);
    abandoned_ = true;
    if (waking_.valid()) waking_.wait();  // its sandbox goes with the future's value
    stop_sealing();
    store_.remove(session_id_);
    std::error_code ec;
    fs::remove_all(root_, ec);
}

void KernelSleep::on_woken(Woken woken, Failed failed) {
    woken_ = std::move(woken);
    failed_ = std::move(failed);
}

bool KernelSleep::keep(Sandbox& box, const nlohmann::json& report, std::string& why) {
    const SandboxFiles* files = box.files();
    if (!files) {
        why = "the " + box.runtime() +
              " backend's sandboxes keep no files on this host: no snapshot can be kept";
        return false;
    }
    if (!streamed_) {
        return store_.keep_from(session_id_, files->output_dir(), files->input_dir(), report, why);
    }
    streamed_->written = true;  // the kernel answered: its file is whole
    sealing_.join();
    const auto keeping = std::move(streamed_);
    streamed_.reset();
    if (!sealing_error_.empty()) {
        why = std::exchange(sealing_error_, "");
        store_.abandon(*keeping);
        return false;
    }
    try {
        log_kept(session_id_, store_.finish_keep(*keeping), report,
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                           streamed_at_)
                     .count());
        return true;
    } catch (const std::exception& e) {
        why = why_not_kept(e);
    }
    return false;
}

void KernelSleep::saving(Sandbox& box) {
    const SandboxFiles* files = box.files();
    if (!files) return;
    stop_sealing();
    try {
        streamed_ = store_.begin_streamed_keep(session_id_, files->output_dir(), files->input_dir(),
                                               std::chrono::hours(1));
    } catch (const std::exception&) {
        return;  // keep() checks again after the save, and says why
    }
    streamed_at_ = std::chrono::steady_clock::now();
    sealing_ = std::thread([this, keeping = streamed_] {
        try {
            keeping->seal();
        } catch (const std::exception& e) {
            sealing_error_ = why_not_kept(e);
        }
    });
}

void KernelSleep::unsaved() { stop_sealing(); }

void KernelSleep::stop_sealing() {
    if (!streamed_) return;
    streamed_->cancelled = true;
    if (sealing_.joinable()) sealing_.join();
    store_.abandon(*streamed_);
    streamed_.reset();
    sealing_error_.clear();
}

void KernelSleep::wake() {
    if (waking_.valid()) return;  // one wake at a time
    ++wakes_;
    spdlog::info("session {}: waking in a new sandbox", session_id_);
    waking_ = std::async(std::launch::async, [this] {
        Awake awake = start_sandbox();
        const std::uint64_t one = 1;
        [[maybe_unused]] auto n = ::write(done_fd_.get(), &one, sizeof one);
        return awake;
    });
}

KernelSleep::Awake KernelSleep::start_sandbox() {
    Awake awake;
    try {
        // A container id of its own: the old sandbox's may still be going.
        const std::string id = session_id_ + "-w" + std::to_string(wakes_);
        awake.sandbox = RuncSandbox::start(id, image_, limits_, settings_);
        const SandboxFiles* files = awake.sandbox->files();
        if (!files) throw SnapshotError("the new sandbox keeps no files on this host");
        store_.place(session_id_, files->input_dir());
        awake.channels = probe_kernel(context_, *awake.sandbox, std::chrono::seconds(60), 64 << 20,
                                      &abandoned_, transport_);
    } catch (const std::exception& e) {
        awake.error = e.what();
    }
    return awake;
}

void KernelSleep::finish() {
    std::uint64_t count = 0;
    [[maybe_unused]] auto n = ::read(done_fd_.get(), &count, sizeof count);
    if (!waking_.valid()) return;
    Awake awake = waking_.get();
    if (!awake.error.empty() || !awake.channels) {
        spdlog::error("session {}: the wake failed: {}", session_id_, awake.error);
        if (failed_) failed_(awake.error);
        return;
    }
    // The snapshot was placed in the new sandbox: it leaves the store.
    store_.remove(session_id_);
    placed_in_ = awake.sandbox->files()->input_dir();
    if (woken_) woken_(std::move(awake.sandbox), std::move(awake.channels));
}

void KernelSleep::on_event(const std::string&, const std::string& kind, const std::string&) {
    if (kind != "resumed" || placed_in_.empty()) return;
    ::unlink((placed_in_ / kSnapshotFile).c_str());
    placed_in_.clear();
}

}  // namespace cellblock
