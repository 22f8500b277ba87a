#include "egress_gateway.hpp"

#include "unix_address.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "cellblock/egress_rules.hpp"
#include "gateway.hpp"
#include "tls.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

constexpr std::size_t kMaxSecretBytes = 8192;
constexpr std::size_t kMaxExtraCaBytes = 48 * 1024;  // it travels in one control message

std::string read_small_file(const std::filesystem::path& path, std::size_t max, bool private_only,
                            const std::string& what) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) throw std::runtime_error(what + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw std::runtime_error(what + ": not a regular file");
    }
    if (private_only && (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)) {
        throw std::runtime_error(what +
                                 ": must be owned by the server's user and readable by "
                                 "no one else (chmod 600)");
    }
    if (static_cast<std::size_t>(st.st_size) > max) {
        throw std::runtime_error(what + ": larger than " + std::to_string(max) + " bytes");
    }
    std::string text(static_cast<std::size_t>(st.st_size), '\0');
    std::size_t got = 0;
    while (got < text.size()) {
        const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
        if (n <= 0) throw std::runtime_error(what + ": read failed");
        got += static_cast<std::size_t>(n);
    }
    return text;
}

// Writes `text` at `path` as a new file (whatever was there is replaced:
// the directory is writable by the sandbox, so nothing there is trusted).
void write_new_file(const std::filesystem::path& path, const std::string& text) {
    ::unlink(path.c_str());
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (!fd) throw std::runtime_error(path.string() + ": " + std::strerror(errno));
    std::string_view rest(text);
    while (!rest.empty()) {
        const ssize_t n = ::write(fd.get(), rest.data(), rest.size());
        if (n <= 0) throw std::runtime_error(path.string() + ": " + std::strerror(errno));
        rest.remove_prefix(static_cast<std::size_t>(n));
    }
}

}  // namespace

std::string read_secret(const std::string& value_from) {
    std::string value;
    if (value_from.starts_with("env:")) {
        const char* v = std::getenv(value_from.substr(4).c_str());
        if (!v || !*v) {
            throw std::runtime_error("secret " + value_from +
                                     ": not set in the server's environment");
        }
        value = v;
    } else if (value_from.starts_with("file:")) {
        value =
            read_small_file(value_from.substr(5), kMaxSecretBytes, true, "secret " + value_from);
        while (!value.empty() && (value.back() == '\n' || value.back() == '\r')) value.pop_back();
    } else {
        throw std::runtime_error("secret " + value_from + ": not env:NAME or file:/path");
    }
    if (value.empty() || value.find_first_of(std::string("\r\n\0", 3)) != std::string::npos) {
        throw std::runtime_error("secret " + value_from + ": empty, or holds a line break or NUL");
    }
    return value;
}

void EgressSettings::add_resolve(const std::string& item) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
        throw std::runtime_error("--egress-resolve " + item + ": expected NAME=ADDRESS");
    }
    resolve[item.substr(0, eq)] = item.substr(eq + 1);
}

void EgressSettings::apply_to(ServerPolicy& policy) const {
    NetworkLimits& maxima = policy.maxima.network;
    if (allow.empty()) {
        if (!secrets.empty()) {
            throw std::runtime_error(
                "--egress-secret needs a gateway: name what sessions may reach with "
                "--egress-allow");
        }
        return;
    }
    maxima.mode = "gateway";
    for (const auto& text : allow) {
        try {
            maxima.allow.push_back(HostPattern::parse(text).to_string());
        } catch (const std::exception& e) {
            throw std::runtime_error("--egress-allow " + text + ": " + e.what());
        }
    }
    policy.defaults.network.allow = maxima.allow;
    for (const auto& text : secrets) {
        try {
            maxima.secrets.push_back(NetworkSecret::parse(text));
        } catch (const std::exception& e) {
            throw std::runtime_error("--egress-secret " + text + ": " + e.what());
        }
    }
}

void EgressSettings::check(const NetworkLimits& maxima) const {
    if (!maxima.gateway() && (!private_ranges.empty() || !resolve.empty() || !ca.empty())) {
        throw std::runtime_error(
            "--egress-private, --egress-resolve and --egress-ca need a gateway: name what "
            "sessions may reach with --egress-allow");
    }
}

std::unique_ptr<EgressGateway> start_egress_gateway(const EgressSettings& settings,
                                                    const NetworkLimits& maxima,
                                                    const std::filesystem::path& binary) {
    settings.check(maxima);
    if (!maxima.gateway()) return nullptr;
    EgressOptions egress;
    egress.binary = binary;
    egress.private_ranges = settings.private_ranges;
    egress.resolve = settings.resolve;
    egress.extra_ca_file = settings.ca;
    egress.dns = !settings.no_dns;
    // A secret the server offers must be there now, not at a session's create.
    for (const auto& secret : maxima.secrets) (void)read_secret(secret.value_from);
    const passwd* user = ::getpwnam(settings.user.c_str());
    if (!user || user->pw_uid == 0) {
        throw std::runtime_error("--egress-user " + settings.user +
                                 ": not an unprivileged user of this host");
    }
    egress.uid = user->pw_uid;
    egress.gid = user->pw_gid;
    return std::make_unique<EgressGateway>(std::move(egress));
}

EgressGateway::EgressGateway(EgressOptions options) : options_(std::move(options)) {
    if (!options_.extra_ca_file.empty()) {
        extra_ca_ = read_small_file(options_.extra_ca_file, kMaxExtraCaBytes, false,
                                    "--egress-ca " + options_.extra_ca_file);
    }
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
        // The relay's priority (nice -10, server/relay_priority.hpp) is not
        // the gateway's: it works for sessions, on bytes they choose, and
        // must not outrank them or the host.
        errno = 0;
        if (::getpriority(PRIO_PROCESS, 0) < 0 && errno == 0) ::setpriority(PRIO_PROCESS, 0, 0);
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
    send({{"op", "config"},
          {"private", options_.private_ranges},
          {"resolve", resolve},
          {"extra_ca", extra_ca_},
          {"dns", options_.dns}});
    for (const auto& [id, entry] : sessions_) send(entry.add, entry.listener.get());
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

std::string EgressGateway::add_session(const std::string& session_id,
                                       const std::filesystem::path& ipc_dir,
                                       const NetworkLimits& network,
                                       std::chrono::seconds lifetime) {
    json add = {{"op", "add"}, {"session", session_id}, {"network", network.to_json()}};
    std::string bundle = read_small_file(kSystemCaBundle, 16u << 20, false, kSystemCaBundle);
    if (!network.secrets.empty()) {
        json values = json::array();
        std::vector<std::string> hosts;
        for (const auto& secret : network.secrets) {
            values.push_back({{"host", secret.host},
                              {"header", secret.header},
                              {"value", read_secret(secret.value_from)}});
            if (std::find(hosts.begin(), hosts.end(), secret.host) == hosts.end())
                hosts.push_back(secret.host);
        }
        const gateway::CaPem ca = gateway::make_session_ca(session_id, hosts, lifetime);
        add["secrets"] = std::move(values);
        add["ca_key"] = ca.key;
        add["ca_cert"] = ca.cert;
        if (!bundle.empty() && bundle.back() != '\n') bundle += '\n';
        bundle += ca.cert;
    }
    write_new_file(ipc_dir / kEgressCaBundleName, bundle);
    const std::filesystem::path path = ipc_dir / kEgressSocketName;
    const auto addr = unix_address(path.native());
    if (!addr) throw std::runtime_error("egress socket path too long: " + path.string());
    UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener) throw std::runtime_error(std::string("egress socket: ") + std::strerror(errno));
    ::unlink(path.c_str());
    if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0 ||
        ::chmod(path.c_str(), 0666) != 0 || ::listen(listener.get(), 64) != 0) {
        throw std::runtime_error("egress socket " + path.string() + ": " + std::strerror(errno));
    }
    Entry entry{std::move(listener), std::move(add)};
    send(entry.add, entry.listener.get());
    sessions_[session_id] = std::move(entry);
    return bundle;
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
        const UniqueFd unused(fd);  // the control channel passes none this way
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

EgressEvents::EgressEvents(EventLoop& loop, EgressGateway& gateway, Handler on_event)
    : loop_(loop), gateway_(gateway), on_event_(std::move(on_event)) {
    watch_ = loop_.watch_fd(gateway_.control_fd(), [this] { read(); });
}

EgressEvents::~EgressEvents() { loop_.unwatch(watch_); }

void EgressEvents::read() {
    bool restarted = false;
    for (const auto& event : gateway_.read_events(restarted)) {
        EgressEvent e;
        e.session_id = event.value("session", "");
        e.bytes =
            event.value("bytes_up", std::uint64_t{0}) + event.value("bytes_down", std::uint64_t{0});
        e.allowed = event.value("verdict", "") == "allowed";
        e.detail = event;
        e.detail.erase("op");
        e.detail.erase("session");
        on_event_(e);
    }
    if (restarted) {
        loop_.unwatch(watch_);
        watch_ = loop_.watch_fd(gateway_.control_fd(), [this] { read(); });
    }
}

}  // namespace cellblock
