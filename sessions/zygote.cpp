// A per-image zygote (zygote.hpp, docs/zygote.md): its start, with the
// seccomp program every fork installs (compiled in seccomp.cpp), its end. A fork, the host's half
// of it, is in zygote_fork.cpp.
#include "cellblock/zygote.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/fd_passing.hpp"
#include "cellblock/sandbox_pool.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/sandbox_tuning.hpp"
#include "cellblock/session_dir.hpp"
#include "sandbox_internal.hpp"
#include "zygote_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;
using namespace zygote_detail;
namespace protocol = sandbox_protocol;

namespace {

// How often a starting zygote's socket is looked for.
constexpr std::chrono::milliseconds kStartPoll{20};
// The largest reply of the zygote that is read whole.
constexpr size_t kMaxReplyBytes = 65536;
// The zygote's RLIMIT_NOFILE bounds what a fork may set for its session (it
// cannot raise it): as high as this process may give (runc sets it after it
// has become the zygote's user), within the kernel's fs.nr_open default.
constexpr int kNofileUnknown = 65536;
constexpr rlim_t kMaxNofile = 1 << 20;

}  // namespace

namespace zygote_detail {

int zygote_nofile() {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_max == RLIM_INFINITY) {
        return kNofileUnknown;
    }
    return static_cast<int>(std::min(limit.rlim_max, kMaxNofile));
}

bool wait_readable(int fd, std::chrono::milliseconds timeout) {
    pollfd p{fd, POLLIN, 0};
    for (;;) {
        const int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
        if (r < 0 && errno == EINTR) continue;
        return r > 0;
    }
}

void send_request(int socket, const std::string& data, const std::vector<int>& fds) {
    if (data.size() > static_cast<size_t>(protocol::kMaxRequestBytes)) {
        throw SandboxError("zygote: a request of " + std::to_string(data.size()) +
                           " bytes, more than the zygote reads (" +
                           std::to_string(protocol::kMaxRequestBytes) + ")");
    }
    if (send_with_fds(socket, data, fds) != static_cast<ssize_t>(data.size())) {
        throw SandboxError("zygote: send: " + errno_text());
    }
}

json receive_reply(int socket, std::chrono::milliseconds timeout) {
    if (!wait_readable(socket, timeout)) throw SandboxError("zygote: no reply");
    std::string buf(kMaxReplyBytes, '\0');
    const ssize_t n = ::recv(socket, buf.data(), buf.size(), 0);
    if (n <= 0) throw SandboxError("zygote: the zygote closed its socket");
    buf.resize(static_cast<size_t>(n));
    json reply = json::parse(buf, nullptr, false);
    if (!reply.is_object()) throw SandboxError("zygote: a reply that is not a JSON object");
    if (reply.contains(protocol::kReplyError)) {
        throw SandboxError("zygote: " + reply[protocol::kReplyError].get<std::string>());
    }
    return reply;
}

}  // namespace zygote_detail

std::shared_ptr<Zygote> Zygote::start(const Image& image, const RuntimeSettings& settings,
                                      std::chrono::milliseconds timeout) {
    // The fork's directories are detached mounts with their attributes set
    // (detached_tree): a kernel older than 5.12 cannot, and boots instead.
    if (::mount_setattr(-1, "", AT_EMPTY_PATH, nullptr, 0) != 0 && errno == ENOSYS) {
        throw ForkingRefused("this kernel has no mount_setattr (Linux 5.12)");
    }
    std::shared_ptr<Zygote> zygote(new Zygote());
    zygote->image_ = image;
    SandboxLimits limits = image.limits;
    limits.nofile = std::max(limits.nofile, zygote_nofile());
    zygote->box_ =
        RuncSandbox::start(make_session_id(), image, limits, settings, SandboxRole::zygote);
    RuncSandbox& box = *zygote->box_;
    const fs::path socket_path = SessionDir(box.dir()).zygote_socket();
    const fs::path log = SessionDir(box.dir()).shim_log();
    // The socket appears once the zygote has imported everything.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        struct stat st {};
        if (::lstat(socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) break;
        if (!box.read_lifeline() || std::chrono::steady_clock::now() > deadline) {
            throw SandboxError("zygote of image " + image.name +
                               (box.exited()
                                    ? " ended while starting (" + box.exit_description() + ")"
                                    : " did not start in time") +
                               ": " + log_tail(log));
        }
        std::this_thread::sleep_for(kStartPoll);
    }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (socket_path.string().size() >= sizeof addr.sun_path) {
        throw SandboxError("zygote socket path too long: " + socket_path.string());
    }
    std::strcpy(addr.sun_path, socket_path.c_str());
    zygote->control_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!zygote->control_ ||
        ::connect(zygote->control_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        throw SandboxError("connect " + socket_path.string() + ": " + errno_text());
    }
    // The filter every session installs on itself before its first own code.
    const std::string bpf = compile_seccomp_bpf(make_seccomp_profile(RuntimeKind::runc));
    send_request(zygote->control_.get(), std::string(protocol::kSeccompRequest) + " " + bpf, {});
    const json reply = receive_reply(zygote->control_.get(), kStepTimeout);
    zygote->interpreter_pid_ = reply.value(protocol::kReplyPid, -1);
    if (reply.contains(protocol::kReplyRefused)) {
        const json& refused = reply[protocol::kReplyRefused];
        const std::string why = refused.is_string() ? refused.get<std::string>() : refused.dump();
        throw ForkingRefused("this host does not let a zygote's fork contain itself: " + why);
    }
    // Warm imports this root could not import: its sessions import them
    // themselves, at their own cost. Each named on one line of at most 300
    // characters (the text comes from the image's code).
    if (reply.contains(protocol::kReplySkipped) && reply[protocol::kReplySkipped].is_array()) {
        for (const auto& skipped : reply[protocol::kReplySkipped]) {
            std::string line = skipped.is_string() ? skipped.get<std::string>() : "?";
            if (line.size() > 300) line = line.substr(0, 300) + "...";
            for (char& c : line)
                if (static_cast<unsigned char>(c) < 0x20) c = ' ';
            spdlog::warn(
                "zygote of image {}: warm import {} skipped; its sessions import it themselves "
                "(docs/images.md)",
                image.name, line);
        }
    }
    // A pool worker that started it may run at a low priority; its forks take
    // the priority of the thread that asks for each (see fork), which they
    // can lower but not raise: the zygote itself runs at 0.
    box.renice(0);
    spdlog::info("zygote of image {} ready: container {}, interpreter pid {}", image.name,
                 box.container_id(), zygote->interpreter_pid_);
    return zygote;
}

Zygote::~Zygote() {
    if (box_) box_->destroy();
    reap_child(interpreter_pid_);  // orphaned to us once its shim died
}

void Zygote::retire() {
    std::lock_guard lock(mutex_);
    control_.reset();
    // The interpreter has no PID namespace to end with its init: it ends by
    // its parent-death signal when the shim does.
    box_->kill();
    box_->reap_init();
    reap_child(interpreter_pid_);  // orphaned to us once its shim died
}

bool Zygote::alive() {
    std::lock_guard lock(mutex_);
    return box_ && box_->read_lifeline() && control_;
}

}  // namespace cellblock
