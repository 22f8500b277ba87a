// The lifeline: a socket whose end of file tells the server its sandbox's init
// is gone, for runtimes that cannot pass a descriptor.
#include "sandbox_internal.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/image_builder.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;
using nlohmann::json;

// The lifeline of a runtime that cannot pass fds: a listening socket in the
// session's ipc dir (bind-mounted at /run/cellblock), connectable only by the
// sandbox's user.
int listen_lifeline(const fs::path& path, std::uint32_t owner, mode_t mode) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.string().size() >= sizeof addr.sun_path) {
        throw SandboxError("lifeline socket path too long: " + path.string());
    }
    std::memcpy(addr.sun_path, path.c_str(), path.string().size());
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw SandboxError("lifeline socket: " + errno_text());
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::chown(path.c_str(), owner, owner) != 0 || ::chmod(path.c_str(), mode) != 0 ||
        ::listen(fd.get(), 1) != 0 || ::fcntl(fd.get(), F_SETFL, O_NONBLOCK) != 0) {
        throw SandboxError("lifeline socket " + path.string() + ": " + errno_text());
    }
    return fd.release();
}

bool process_gone(pid_t pid) {
    const std::string stat = sandbox_detail::read_text("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    return paren == std::string::npos || stat.compare(paren + 1, 3, " Z ") == 0;
}

namespace {
// A connection that has yet to show its proof (LifelinePeer::proof): what it
// wrote so far of its first line, '\n' included once it came.
struct Unproven {
    UniqueFd fd;
    std::string line;
};
// At most this many unproven connections are held at once (the oldest goes):
// a sandbox that connects over and over delays its own adoption, never the
// server's wait past its timeout.
constexpr std::size_t kMaxUnproven = 8;

enum class Proof { pending, shown, refused };

// Reads what `c` has written, byte by byte (what follows the line is the
// lifeline's, not this check's), and judges its line once it is whole.
Proof read_proof(Unproven& c, const std::string& proof) {
    for (;;) {
        char byte = 0;
        const ssize_t n = ::recv(c.fd.get(), &byte, 1, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return Proof::pending;
        if (n != 1) return Proof::refused;
        c.line.push_back(byte);
        if (byte == '\n') return equal_secrets(c.line, proof) ? Proof::shown : Proof::refused;
        if (c.line.size() >= proof.size()) return Proof::refused;
    }
}

// Says the first refused connection and, at the end, how many followed: a
// sandbox can connect thousands of times a second, one line each would
// flood the server's log.
class Refusals {
  public:
    explicit Refusals(pid_t init) : init_(init) {}
    ~Refusals() {
        if (count_ > 1)
            spdlog::warn("lifeline {}: {} more connection(s) refused", init_, count_ - 1);
    }
    Refusals(const Refusals&) = delete;
    Refusals& operator=(const Refusals&) = delete;
    void operator()(const std::string& what) {
        if (count_++ == 0) spdlog::warn("lifeline {}: {}", init_, what);
    }

  private:
    pid_t init_;
    int count_ = 0;
};
}  // namespace

int accept_lifeline(int listener, pid_t init_pid, std::chrono::milliseconds timeout,
                    const LifelinePeer& peer) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<Unproven> unproven;
    Refusals refused(init_pid);
    for (;;) {
        // A sandbox that ended at once may still have connected first: accept before judging.
        for (;;) {
            UniqueFd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
            if (!fd) break;
            if (peer.only_init) {
                ucred cred{};
                socklen_t len = sizeof cred;
                if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
                    cred.pid != init_pid) {
                    refused(fmt::format("a connection from pid {} refused (not the init {})",
                                        cred.pid, init_pid));
                    continue;
                }
            }
            if (peer.proof.empty()) return fd.release();
            if (unproven.size() == kMaxUnproven) {
                refused("a connection refused (it did not show the shim's key in time)");
                unproven.erase(unproven.begin());
            }
            unproven.push_back({std::move(fd), {}});
        }
        if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) return -1;
        for (auto it = unproven.begin(); it != unproven.end();) {
            const Proof proof = read_proof(*it, peer.proof);
            if (proof == Proof::shown) {
                // The others not yet judged close with the vector: refused too, in the log.
                for (std::size_t i = 1; i < unproven.size(); ++i)
                    refused("a connection refused (the shim's came first)");
                return it->fd.release();
            }
            if (proof == Proof::refused) {
                refused("a connection refused (it did not show the shim's key)");
                it = unproven.erase(it);
            } else {
                ++it;
            }
        }
        if ((init_pid > 0 && process_gone(init_pid)) ||
            std::chrono::steady_clock::now() >= deadline) {
            return -1;
        }
        std::vector<pollfd> watched{{listener, POLLIN, 0}};
        for (const auto& c : unproven) watched.push_back({c.fd.get(), POLLIN, 0});
        ::poll(watched.data(), watched.size(), 50);
    }
}
}  // namespace cellblock::sandbox_detail

namespace cellblock {

std::uint64_t process_start_ticks(pid_t pid) {
    const std::string stat = sandbox_detail::read_text("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos) return 0;
    // Past the command: state is field 3, the start time field 22.
    std::istringstream fields(stat.substr(paren + 1));
    std::string field;
    for (int i = 3; i <= 22 && fields >> field; ++i) {
        if (i == 22) {
            std::uint64_t ticks = 0;
            std::from_chars(field.data(), field.data() + field.size(), ticks);
            return ticks;
        }
    }
    return 0;
}

}  // namespace cellblock
