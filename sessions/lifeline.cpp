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
int listen_lifeline(const fs::path& path, std::uint32_t owner) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.string().size() >= sizeof addr.sun_path) {
        throw SandboxError("lifeline socket path too long: " + path.string());
    }
    std::memcpy(addr.sun_path, path.c_str(), path.string().size());
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw SandboxError("lifeline socket: " + errno_text());
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::chown(path.c_str(), owner, owner) != 0 || ::chmod(path.c_str(), 0600) != 0 ||
        ::listen(fd.get(), 1) != 0 || ::fcntl(fd.get(), F_SETFL, O_NONBLOCK) != 0) {
        throw SandboxError("lifeline socket " + path.string() + ": " + errno_text());
    }
    return fd.release();
}

bool process_gone(pid_t pid) {
    const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    return paren == std::string::npos || stat.compare(paren + 1, 3, " Z ") == 0;
}

// Accepts the shim's connection; -1 if the sandbox ended or the time passed first.
int accept_lifeline(int listener, pid_t init_pid, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        // A sandbox that ended at once may still have connected first: accept before judging.
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) return fd;
        if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) return -1;
        if ((init_pid > 0 && process_gone(init_pid)) ||
            std::chrono::steady_clock::now() >= deadline) {
            return -1;
        }
        pollfd p{listener, POLLIN, 0};
        ::poll(&p, 1, 50);
    }
}
}  // namespace cellblock::sandbox_detail
