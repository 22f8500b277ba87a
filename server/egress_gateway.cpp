#include "egress_gateway.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "cellblock/egress_rules.hpp"
#include "gateway.hpp"

namespace cellblock {
using nlohmann::json;

EgressGateway::EgressGateway(EgressOptions options) : options_(std::move(options)) {
    for (const auto& text : options_.private_ranges) {
        if (!AddressRange::parse(text)) {
            throw std::runtime_error("--egress-private " + text + ": not an address or CIDR range");
        }
    }
    for (const auto& [name, address] : options_.resolve) {
        if (normalise_host(name).empty() || IpAddress::parse(name)) {
            throw std::runtime_error("--egress-resolve " + name + "=" + address +
                                     ": not a host name");
        }
        if (!IpAddress::parse(address)) {
            throw std::runtime_error("--egress-resolve " + name + "=" + address +
                                     ": not an IPv4 or IPv6 address");
        }
    }
    if (::access(options_.binary.c_str(), X_OK) != 0) {
        throw std::runtime_error("egress gateway " + options_.binary.string() +
                                 " is not an executable (build it, or leave --egress-allow out)");
    }
    start();
}

EgressGateway::~EgressGateway() { stop(); }

void EgressGateway::start() {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
        throw std::runtime_error(std::string("egress gateway: socketpair: ") +
                                 std::strerror(errno));
    }
    UniqueFd ours(pair[0]), theirs(pair[1]);
    const std::string binary = options_.binary.string();
    const std::string uid = std::to_string(options_.uid), gid = std::to_string(options_.gid);
    const pid_t pid = ::fork();
    if (pid < 0) {
        throw std::runtime_error(std::string("egress gateway: fork: ") + std::strerror(errno));
    }
    if (pid == 0) {
        // The control socket becomes fd 3; nothing else of the server goes with it.
        if (::dup2(theirs.get(), 3) != 3) ::_exit(127);
        const int devnull = ::open("/dev/null", O_RDWR);
        if (devnull >= 0) {
            ::dup2(devnull, STDIN_FILENO);
            ::dup2(devnull, STDOUT_FILENO);
        }
        ::closefrom(4);
        sigset_t none;
        sigemptyset(&none);
        ::sigprocmask(SIG_SETMASK, &none, nullptr);
        const char* argv[] = {binary.c_str(), "--uid", uid.c_str(), "--gid", gid.c_str(), nullptr};
        const char* envp[] = {"PATH=/usr/bin:/bin", nullptr};
        ::execve(binary.c_str(), const_cast<char* const*>(argv), const_cast<char* const*>(envp));
        ::_exit(127);
    }
    pid_ = pid;
    control_ = std::move(ours);
    json resolve = json::object();
    for (const auto& [name, address] : options_.resolve) resolve[normalise_host(name)] = address;
    send({{"op", "config"}, {"private", options_.private_ranges}, {"resolve", resolve}});
    for (const auto& [id, entry] : sessions_) {
        send({{"op", "add"}, {"session", id}, {"network", entry.network}}, entry.listener.get());
    }
    spdlog::info("egress gateway: pid {} as uid {}", pid_, options_.uid);
}

void EgressGateway::stop() {
    if (pid_ > 0) {
        ::kill(pid_, SIGKILL);
        int status = 0;
        while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
        }
        pid_ = -1;
    }
    control_.reset();
}

void EgressGateway::send(const json& message, int fd) {
    gateway::send_control(control_.get(), message, fd);
}

void EgressGateway::add_session(const std::string& session_id, const std::filesystem::path& path,
                                const NetworkLimits& network) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.string().size() >= sizeof addr.sun_path) {
        throw std::runtime_error("egress socket path too long: " + path.string());
    }
    std::strcpy(addr.sun_path, path.c_str());
    UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener) throw std::runtime_error(std::string("egress socket: ") + std::strerror(errno));
    ::unlink(path.c_str());
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::chmod(path.c_str(), 0666) != 0 || ::listen(listener.get(), 64) != 0) {
        throw std::runtime_error("egress socket " + path.string() + ": " + std::strerror(errno));
    }
    Entry entry{std::move(listener), network.to_json()};
    send({{"op", "add"}, {"session", session_id}, {"network", entry.network}},
         entry.listener.get());
    sessions_[session_id] = std::move(entry);
}

void EgressGateway::remove_session(const std::string& session_id) {
    if (sessions_.erase(session_id) == 0) return;
    try {
        send({{"op", "remove"}, {"session", session_id}});
    } catch (const std::exception& e) {
        spdlog::warn("egress gateway: remove {}: {}", session_id, e.what());
    }
}

std::vector<json> EgressGateway::read_events(bool& restarted) {
    restarted = false;
    std::vector<json> events;
    for (;;) {
        json message;
        int fd = -1;
        bool open = true;
        try {
            // Non-blocking: what is waiting now, no more.
            pollfd p{control_.get(), POLLIN, 0};
            if (::poll(&p, 1, 0) <= 0) break;
            open = gateway::receive_control(control_.get(), message, fd);
        } catch (const std::exception& e) {
            spdlog::warn("egress gateway: {}", e.what());
            break;
        }
        if (fd >= 0) ::close(fd);
        if (!open) {
            int status = 0;
            ::waitpid(pid_, &status, 0);
            spdlog::error(
                "egress gateway (pid {}) ended ({}); starting it again with {} session(s)", pid_,
                WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                    : "status " + std::to_string(WEXITSTATUS(status)),
                sessions_.size());
            pid_ = -1;
            control_.reset();
            start();
            restarted = true;
            break;
        }
        if (message.value("op", "") == "event") events.push_back(std::move(message));
    }
    return events;
}

}  // namespace cellblock
