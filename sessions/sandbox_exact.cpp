// The exact level of hibernation on runsc (docs/hibernation.md): a bridged
// sandbox quiesced, checkpointed by the runtime, and restored into a new
// session dir whose shim is woken and connects its lifeline again by key.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "process.hpp"
#include "sandbox_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;
namespace protocol = sandbox_protocol;

namespace {

using Clock = std::chrono::steady_clock;

// How long the runtime's sandbox may take to end after its checkpoint, and
// a restored one to take SIGUSR1 and connect its lifeline.
constexpr auto kEndAfterCheckpoint = std::chrono::seconds(30);
constexpr auto kWakeShim = std::chrono::seconds(30);

int remaining_ms(Clock::time_point deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return static_cast<int>(std::max<std::int64_t>(0, left.count()));
}

}  // namespace

bool RuncSandbox::quiesce(std::chrono::milliseconds wait, std::string& why) {
    if (!bridged_ || exited_ || !lifeline_) {
        why = "the sandbox's shim does not bridge its kernel's channels, or has ended";
        return false;
    }
    const std::string line = std::string(protocol::kQuiesceLine) + "\n";
    if (::send(lifeline_.get(), line.data(), line.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(line.size())) {
        why = "its shim's lifeline: " + errno_text();
        return false;
    }
    const auto deadline = Clock::now() + wait;
    std::string pending;
    for (;;) {
        pollfd p{lifeline_.get(), POLLIN, 0};
        if (::poll(&p, 1, remaining_ms(deadline)) == 0) {
            why = "its shim did not answer within " + std::to_string(wait.count()) + " ms";
            return false;
        }
        char buf[256];
        const ssize_t n = ::recv(lifeline_.get(), buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            exited_ = true;
            why = "the sandbox ended: " + exit_description();
            return false;
        }
        if (n < 0) continue;
        pending.append(buf, static_cast<std::size_t>(n));
        for (auto end = pending.find('\n'); end != std::string::npos; end = pending.find('\n')) {
            const std::string said = pending.substr(0, end);
            pending.erase(0, end + 1);
            if (said == protocol::kQuietLine) {
                // It closes its end after saying so: nothing more comes.
                lifeline_.reset();
                return true;
            }
            if (said == protocol::kNotQuietLine) {
                why = "its shim does not bridge the kernel's channels";
                return false;
            }
            shim_status_ += said + "\n";  // a kernel-exit line, for exit_description
        }
    }
}

void RuncSandbox::checkpoint(const fs::path& image_dir) {
    const SessionDir paths(dir());
    UniqueFd log_fd(::open(paths.shim_log().c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
    const auto result = run_process(
        runtime_argv(settings_,
                     {"checkpoint", "--image-path=" + image_dir.string(), container_id_}),
        -1, log_fd.get());
    if (result.exit_code != 0) {
        throw SandboxError(settings_.runtime + " checkpoint " + container_id_ + ": " +
                           sandbox_detail::log_tail(paths.shim_log()));
    }
    // The runtime ends the sandbox after its checkpoint and drops its state
    // itself; a delete before its init has gone can time out.
    const auto deadline = Clock::now() + kEndAfterCheckpoint;
    while (init_pid_ > 0 && !process_gone(init_pid_)) {
        if (Clock::now() >= deadline) {
            throw SandboxError(settings_.runtime + " checkpoint " + container_id_ +
                               ": the sandbox did not end after it");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    exited_ = true;
    reap_init();
}

json RuncSandbox::restore_secrets() const {
    return {{"inner_key", inner_.key}, {"adopt_key", adopt_key_}};
}

std::unique_ptr<RuncSandbox> RuncSandbox::restore(
    const std::string& session_id, const Image& image, const SandboxLimits& limits,
    const RuntimeSettings& settings, const std::function<json(const RestoreDirs&)>& place) {
    std::unique_ptr<RuncSandbox> box = prepare(session_id, image, limits, settings);
    box->write_bundle(image, SandboxRole::session);
    const SessionDir paths(box->dir());
    const fs::path image_dir = box->dir() / "checkpoint";
    if (::mkdir(image_dir.c_str(), 0700) != 0) {
        throw SandboxError("mkdir " + image_dir.string() + ": " + errno_text());
    }
    const std::uint32_t uid = box->host_ids().host_uid(kSandboxUid);
    const json secrets = place({image_dir, paths.output(), paths.input(), uid});
    // The restored kernel knows the key it was started with; the shim, its own.
    box->inner_.key = secrets.value("inner_key", "");
    box->adopt_key_ = secrets.value("adopt_key", "");
    if (box->inner_.key.empty() || !protocol::well_formed_adopt_key(box->adopt_key_)) {
        throw SandboxError("the snapshot's secrets name no kernel key or shim key");
    }
    const fs::path lifeline_socket = paths.lifeline_socket();
    // Root's, 0666 in the sticky ipc dir, as for an adoption.
    UniqueFd listener(listen_lifeline(lifeline_socket, 0, 0666));
    const fs::path log = paths.shim_log();
    UniqueFd log_fd(::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600));
    if (!log_fd) throw SandboxError("open " + log.string() + ": " + errno_text());
    const fs::path pid_file = box->dir() / "init.pid";
    const int exit_code = box->launch({"restore", "--detach", "--pid-file", pid_file.string(),
                                       "--image-path=" + image_dir.string(), "--bundle",
                                       paths.bundle().string(), box->container_id_},
                                      -1, log_fd.get(), pid_file);
    if (exit_code != 0 || box->init_pid_ <= 0) {
        throw SandboxError(settings.runtime + " restore " + box->container_id_ + ": " +
                           sandbox_detail::log_tail(log));
    }
    // The image is in the sandbox now; it holds the whole session: gone at once.
    std::error_code ec;
    fs::remove_all(image_dir, ec);
    // The shim waits, quiesced, for SIGUSR1 (runsc's init pid is the
    // Sentry: the runtime delivers it). Tried until the restore has ended.
    const auto deadline = Clock::now() + kWakeShim;
    for (;;) {
        const auto kill = run_process(runtime_argv(settings, {"kill", box->container_id_, "USR1"}),
                                      -1, log_fd.get());
        if (kill.exit_code == 0) break;
        if (Clock::now() >= deadline) {
            throw SandboxError(settings.runtime + " kill " + box->container_id_ +
                               " USR1: the restored sandbox did not take it; log: " +
                               sandbox_detail::log_tail(log));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const LifelinePeer shim{.only_init = false, .proof = protocol::adopt_line(box->adopt_key_)};
    box->lifeline_.reset(accept_lifeline(
        listener.get(), box->init_pid_,
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()), shim));
    listener.reset();
    ::unlink(lifeline_socket.c_str());
    if (!box->lifeline_) {
        throw SandboxError("the restored sandbox's shim did not connect its lifeline; log: " +
                           sandbox_detail::log_tail(log));
    }
    const std::string line = protocol::adopted_line();
    if (::send(box->lifeline_.get(), line.data(), line.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(line.size())) {
        throw SandboxError("the restored shim's lifeline ended before it was answered: " +
                           errno_text());
    }
    box->cgroup_dirs_ = sandbox_cgroup_dirs(box->container_id_);
    box->open_counters();
    return box;
}

}  // namespace cellblock
