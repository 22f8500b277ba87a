#include "gateway.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "cellblock/egress_rules.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/unique_fd.hpp"
#include "http_head.hpp"
#include "tls.hpp"

namespace cellblock::gateway {
using nlohmann::json;

namespace {

// Connections served at once across all sessions; past it a connection is
// closed unread (each one is a thread).
constexpr int kMaxThreads = 512;
constexpr std::size_t kRelayChunk = 64 * 1024;
constexpr std::size_t kSpliceChunk = 256 * 1024;

void log_line(const std::string& text) {
    const std::string line = "cellblock-gateway: " + text + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}

struct Config {
    std::vector<AddressRange> opted_in;         // reserved ranges the operator allows
    std::map<std::string, IpAddress> pins;      // name -> the address it resolves to
    std::unique_ptr<UpstreamTls> upstream_tls;  // for hosts with secrets
    bool dns = true;                            // false: only pinned names and IP literals resolve
};

// A credential for one host, added to that host's requests (never logged).
struct Secret {
    std::string host, header, value;
};

std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

struct Session {
    std::string id;
    NetworkLimits limits;
    std::vector<HostPattern> allow;
    std::vector<Secret> secrets;
    std::unique_ptr<SessionTls> tls;  // the session's CA: when it has secrets
    UniqueFd listener;
    std::atomic<std::int64_t> bytes{0};
    std::atomic<int> active{0};           // connections being served (counted at accept)
    std::uint64_t refused_at_accept = 0;  // over a cap; the accepting thread only
    std::atomic<bool> closed{false};
    std::mutex fds_mutex;
    std::set<int> fds;  // sockets of its connections: shut down when it is removed

    void track(int fd) {
        std::lock_guard lock(fds_mutex);
        fds.insert(fd);
        if (closed) ::shutdown(fd, SHUT_RDWR);
    }
    void untrack(int fd) {
        std::lock_guard lock(fds_mutex);
        fds.erase(fd);
    }
    void close_all() {
        closed = true;
        std::lock_guard lock(fds_mutex);
        for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
    }
};

// What one connection did, reported to the server when it ends.
struct Event {
    std::string method, host, reason, verdict = "refused";
    int port = 0, status = 0;
    std::int64_t up = 0, down = 0;
    bool tls = false;                  // the gateway terminated TLS (a host with secrets)
    std::vector<std::string> secrets;  // the names of the headers it added
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
};

struct Side;

// The body of the one request a connection carries (body_framing): what the
// client sends past it is dropped, never forwarded.
struct BodyLimit {
    BodyFraming::Kind kind = BodyFraming::Kind::none;
    unsigned long long left = 0;
    ChunkedScanner chunked;
    std::size_t dropped = 0;

    explicit BodyLimit(const BodyFraming& framing) : kind(framing.kind), left(framing.length) {}
    bool ended() const {
        return kind == BodyFraming::Kind::none ||
               (kind == BodyFraming::Kind::length && left == 0) ||
               (kind == BodyFraming::Kind::chunked && (chunked.done() || chunked.failed()));
    }
    bool malformed() const { return kind == BodyFraming::Kind::chunked && chunked.failed(); }
    // How many of `data`'s first bytes are body.
    std::size_t take(std::string_view data) {
        std::size_t n = 0;
        if (kind == BodyFraming::Kind::length) {
            n = static_cast<std::size_t>(std::min<unsigned long long>(left, data.size()));
            left -= n;
        } else if (kind == BodyFraming::Kind::chunked && !ended()) {
            n = chunked.feed(data);
        }
        dropped += data.size() - n;
        return n;
    }
};

class Gateway {
  public:
    explicit Gateway(int control_fd) : control_fd_(control_fd) {}
    int run();

  private:
    void on_control();
    void on_accept(const std::shared_ptr<Session>& session);
    void report(const Session& session, const Event& event);
    void handle(std::shared_ptr<Session> session, UniqueFd client);
    void serve_connection(Session& session, int client, const std::string& first, Event& event);
    void relay(Session& session, Side& client, Side& upstream, const std::string& first,
               bool read_status, BodyLimit* body, Event& event);

    int control_fd_;
    Config config_;
    bool configured_ = false;
    bool done_ = false;
    std::map<std::string, std::shared_ptr<Session>> sessions_;
    std::mutex send_mutex_;
    std::atomic<int> threads_{0};
};

std::string seconds_text(double s) {
    std::string text = std::to_string(s);
    while (text.find('.') != std::string::npos && (text.back() == '0' || text.back() == '.')) {
        const bool dot = text.back() == '.';
        text.pop_back();
        if (dot) break;
    }
    return text;
}

void set_timeouts(int fd, double seconds) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(seconds);
    tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool send_all(int fd, std::string_view data) {
    while (!data.empty()) {
        const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        data.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
}

// The addresses `host` stands for: a pinned name's address, an IP literal
// itself, or what the system resolver answers. Empty with `why` on failure.
std::vector<IpAddress> resolve(const std::string& host, const Config& config, std::string& why) {
    if (auto pin = config.pins.find(host); pin != config.pins.end()) return {pin->second};
    if (auto literal = IpAddress::parse(host)) return {*literal};
    if (!config.dns) {
        why = "cannot resolve " + host +
              ": this server resolves only the names it was given "
              "(--egress-resolve)";
        return {};
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc != 0) {
        why = "cannot resolve " + host + ": " + ::gai_strerror(rc);
        return {};
    }
    std::vector<IpAddress> out;
    for (addrinfo* a = found; a; a = a->ai_next) {
        char text[INET6_ADDRSTRLEN] = {};
        if (a->ai_family == AF_INET) {
            ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text,
                        sizeof text);
        } else if (a->ai_family == AF_INET6) {
            ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                        sizeof text);
        } else {
            continue;
        }
        if (auto ip = IpAddress::parse(text)) {
            const bool seen = std::any_of(out.begin(), out.end(), [&](const IpAddress& o) {
                return o.family == ip->family && o.bytes == ip->bytes;
            });
            if (!seen) out.push_back(*ip);
        }
    }
    ::freeaddrinfo(found);
    if (out.empty()) why = "cannot resolve " + host + ": no IPv4 or IPv6 address";
    return out;
}

// Connects to exactly `address` (the one that was checked), within `timeout_s`.
UniqueFd connect_to(const IpAddress& address, int port, double timeout_s, std::string& why,
                    bool& timed_out) {
    sockaddr_storage storage{};
    socklen_t length = 0;
    if (address.family == AF_INET) {
        auto* in = reinterpret_cast<sockaddr_in*>(&storage);
        in->sin_family = AF_INET;
        in->sin_port = htons(static_cast<std::uint16_t>(port));
        std::memcpy(&in->sin_addr, address.bytes.data(), 4);
        length = sizeof *in;
    } else {
        auto* in6 = reinterpret_cast<sockaddr_in6*>(&storage);
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(static_cast<std::uint16_t>(port));
        std::memcpy(&in6->sin6_addr, address.bytes.data(), 16);
        length = sizeof *in6;
    }
    UniqueFd fd(::socket(address.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) {
        why = std::string("socket: ") + std::strerror(errno);
        return {};
    }
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&storage), length) != 0) {
        if (errno != EINPROGRESS) {
            why = std::strerror(errno);
            return {};
        }
        pollfd p{fd.get(), POLLOUT, 0};
        const int ready = ::poll(&p, 1, static_cast<int>(timeout_s * 1000));
        if (ready == 0) {
            why = "no answer within " + seconds_text(timeout_s) + " s";
            timed_out = true;
            return {};
        }
        int error = 0;
        socklen_t size = sizeof error;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &size);
        if (ready < 0 || error != 0) {
            why = std::strerror(ready < 0 ? errno : error);
            return {};
        }
    }
    const int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    set_timeouts(fd.get(), timeout_s);
    return fd;
}

}  // namespace

void send_control(int control_fd, const json& message, int fd) {
    const std::string text = message.dump();
    if (text.size() > kMaxControlMessage) {
        throw std::runtime_error("control message of " + std::to_string(text.size()) +
                                 " bytes is above " + std::to_string(kMaxControlMessage));
    }
    iovec iov{const_cast<char*>(text.data()), text.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n;
    do {
        n = ::sendmsg(control_fd, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw std::system_error(errno, std::generic_category(), "gateway control");
}

bool receive_control(int control_fd, json& message, int& fd) {
    fd = -1;
    std::string buffer(kMaxControlMessage, '\0');
    iovec iov{buffer.data(), buffer.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
        n = ::recvmsg(control_fd, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw std::system_error(errno, std::generic_category(), "gateway control");
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (fd < 0) {
                fd = received;
            } else {
                ::close(received);  // one fd per message; more is not ours to keep
            }
        }
    }
    if (n == 0) return false;
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        if (fd >= 0) ::close(fd);
        fd = -1;
        throw std::runtime_error("control message truncated");
    }
    buffer.resize(static_cast<std::size_t>(n));
    message = json::parse(buffer, nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
        if (fd >= 0) ::close(fd);
        fd = -1;
        throw std::runtime_error("control message is not a JSON object");
    }
    return true;
}

namespace {

int Gateway::run() {
    while (!done_) {
        std::vector<pollfd> fds{{control_fd_, POLLIN, 0}};
        std::vector<std::shared_ptr<Session>> polled;
        for (auto& [id, session] : sessions_) {
            fds.push_back({session->listener.get(), POLLIN, 0});
            polled.push_back(session);
        }
        if (::poll(fds.data(), fds.size(), -1) < 0) {
            if (errno == EINTR) continue;
            log_line(std::string("poll: ") + std::strerror(errno));
            return 1;
        }
        if (fds[0].revents) on_control();
        for (std::size_t i = 1; i < fds.size(); ++i) {
            if (fds[i].revents & POLLIN) on_accept(polled[i - 1]);
        }
    }
    return 0;
}

void Gateway::on_control() {
    json message;
    int fd = -1;
    try {
        if (!receive_control(control_fd_, message, fd)) {
            done_ = true;  // the server is gone
            return;
        }
    } catch (const std::exception& e) {
        log_line(std::string("control: ") + e.what());
        return;
    }
    UniqueFd attached(fd);
    const std::string op = message.value("op", "");
    try {
        if (op == "config") {
            for (const auto& text : message.at("private")) {
                auto range = AddressRange::parse(text.get<std::string>());
                if (!range) throw std::runtime_error("not a CIDR: " + text.dump());
                config_.opted_in.push_back(*range);
            }
            for (const auto& [name, address] : message.at("resolve").items()) {
                auto ip = IpAddress::parse(address.get<std::string>());
                if (!ip) throw std::runtime_error("not an address: " + address.dump());
                config_.pins[normalise_host(name)] = *ip;
            }
            config_.dns = message.value("dns", true);
            config_.upstream_tls =
                std::make_unique<UpstreamTls>(message.value("extra_ca", std::string()));
            configured_ = true;
        } else if (op == "add") {
            if (!attached) throw std::runtime_error("add without a listener");
            auto session = std::make_shared<Session>();
            session->id = message.at("session").get<std::string>();
            SessionLimits limits;
            limits = SessionLimits::from_json(json{{"network", message.at("network")}}, limits);
            session->limits = limits.network;
            for (const auto& p : session->limits.allow)
                session->allow.push_back(HostPattern::parse(p));
            for (const auto& secret : message.value("secrets", json::array())) {
                session->secrets.push_back({secret.at("host").get<std::string>(),
                                            secret.at("header").get<std::string>(),
                                            secret.at("value").get<std::string>()});
            }
            if (!session->secrets.empty()) {
                session->tls =
                    std::make_unique<SessionTls>(CaPem{message.at("ca_key").get<std::string>(),
                                                       message.at("ca_cert").get<std::string>()});
            }
            session->listener = std::move(attached);
            if (auto old = sessions_.find(session->id); old != sessions_.end()) {
                old->second->close_all();
            }
            sessions_[session->id] = std::move(session);
        } else if (op == "remove") {
            auto it = sessions_.find(message.at("session").get<std::string>());
            if (it != sessions_.end()) {
                it->second->close_all();
                sessions_.erase(it);
            }
        } else {
            throw std::runtime_error("unknown op '" + op + "'");
        }
    } catch (const std::exception& e) {
        log_line("control " + op + ": " + e.what());
    }
}

void Gateway::on_accept(const std::shared_ptr<Session>& session) {
    UniqueFd client(::accept4(session->listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client) return;
    // The caps hold before a thread exists: a session that opens connections
    // and sends nothing holds at most max_connections of them.
    const bool over_session_cap = session->active >= session->limits.max_connections;
    if (over_session_cap || threads_ >= kMaxThreads) {
        const std::string why =
            over_session_cap
                ? "this session has " + std::to_string(session->limits.max_connections) +
                      " connections open already (network.max_connections)"
                : "the gateway serves " + std::to_string(kMaxThreads) + " connections at once";
        const std::string answer = error_response(429, "cellblock: " + why);
        [[maybe_unused]] ssize_t n =
            ::send(client.get(), answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        // One event for the first refusal and then one per hundred: a flood of
        // connections is not a flood of audit rows.
        if (++session->refused_at_accept % 100 == 1) {
            Event event;
            event.status = 429;
            event.reason =
                why + " (" + std::to_string(session->refused_at_accept) + " refused so far)";
            report(*session, event);
        }
        return;
    }
    ++threads_;
    ++session->active;
    std::thread([this, session, fd = client.release()] {
        handle(session, UniqueFd(fd));
        --threads_;
    }).detach();
}

void Gateway::report(const Session& session, const Event& event) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - event.started)
                        .count();
    json message = {{"op", "event"},          {"session", session.id},
                    {"host", event.host},     {"port", event.port},
                    {"method", event.method}, {"status", event.status},
                    {"bytes_up", event.up},   {"bytes_down", event.down},
                    {"duration_ms", ms},      {"verdict", event.verdict},
                    {"reason", event.reason}};
    if (event.tls) message["tls"] = "terminated";
    if (!event.secrets.empty()) message["secrets_added"] = event.secrets;
    std::lock_guard lock(send_mutex_);
    try {
        send_control(control_fd_, message);
    } catch (const std::exception& e) {
        log_line(std::string("report: ") + e.what());
    }
}

// The sandbox's forwarder hands over the code's own TCP connection: one byte
// with the socket attached (SCM_RIGHTS), so bytes then go between the code and
// the gateway with no copy in the sandbox. Anything that sends no socket is
// itself the client, its first byte already read into `first`. A passed
// descriptor that is not a TCP stream socket is refused (the sandbox chose it).
UniqueFd take_passed_socket(int conn, double timeout_s, std::string& first, std::string& why) {
    pollfd p{conn, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) {
        why = "no request within " + seconds_text(timeout_s) + " s (network.request_timeout_s)";
        return {};
    }
    char byte = 0;
    iovec iov{&byte, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
        n = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    UniqueFd passed;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (!passed) {
                passed.reset(fd);
            } else {
                ::close(fd);
            }
        }
    }
    if (n <= 0) {
        why = "closed before a request";
        return {};
    }
    if (!passed) {
        first.assign(1, byte);
        return {};
    }
    int type = 0, domain = 0;
    socklen_t size = sizeof type;
    const bool stream =
        ::getsockopt(passed.get(), SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM;
    size = sizeof domain;
    const bool inet = ::getsockopt(passed.get(), SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 &&
                      (domain == AF_INET || domain == AF_INET6);
    if (!stream || !inet || (msg.msg_flags & MSG_CTRUNC)) {
        why = "the forwarder passed a descriptor that is not a TCP connection";
        return {};
    }
    return passed;
}

void Gateway::handle(std::shared_ptr<Session> session, UniqueFd client) {
    Event event;
    std::string first;
    UniqueFd passed =
        take_passed_socket(client.get(), session->limits.request_timeout_s, first, event.reason);
    if (!passed && first.empty()) {
        --session->active;
        report(*session, event);
        return;
    }
    if (passed) client = std::move(passed);  // the forwarder's connection closes here
    session->track(client.get());
    try {
        serve_connection(*session, client.get(), first, event);
    } catch (const std::exception& e) {
        event.reason = std::string("gateway error: ") + e.what();
    }
    session->untrack(client.get());
    --session->active;
    report(*session, event);
}

// One end of a relayed connection: a socket, with TLS when the gateway
// terminates it (a host with secrets).
struct Side {
    int fd = -1;
    SSL* ssl = nullptr;
    Side(int f) : fd(f) {}
    Side(const Side&) = delete;
    Side& operator=(const Side&) = delete;
    ~Side() {
        if (ssl) SSL_free(ssl);
    }
    static constexpr ssize_t kNothing = -2;  // a TLS record without data: read again later
    // Bytes read, 0 at the end, -1 on error, kNothing.
    ssize_t read(char* buf, std::size_t n) {
        if (!ssl) {
            ssize_t r;
            do {
                r = ::recv(fd, buf, n, 0);
            } while (r < 0 && errno == EINTR);
            return r;
        }
        const int r = SSL_read(ssl, buf, static_cast<int>(std::min<std::size_t>(n, INT32_MAX)));
        if (r > 0) return r;
        switch (SSL_get_error(ssl, r)) {
            case SSL_ERROR_ZERO_RETURN:
                return 0;
            case SSL_ERROR_WANT_READ:
            case SSL_ERROR_WANT_WRITE:
                return kNothing;
            case SSL_ERROR_SYSCALL:
                return errno == 0 ? 0 : -1;  // errno 0: the peer closed without close_notify
            default:
                return -1;
        }
    }
    bool write_all(std::string_view data) {
        if (!ssl) return send_all(fd, data);
        while (!data.empty()) {
            const int n = SSL_write(
                ssl, data.data(), static_cast<int>(std::min<std::size_t>(data.size(), INT32_MAX)));
            if (n <= 0) return false;
            data.remove_prefix(static_cast<std::size_t>(n));
        }
        return true;
    }
    bool pending() const { return ssl && SSL_pending(ssl) > 0; }
    void shutdown_write() {
        if (ssl) SSL_shutdown(ssl);
        ::shutdown(fd, SHUT_WR);
    }
};

// The head at the start of what `side` sends, every size bounded.
// The whole head must come within `timeout_s` (a client that sends a byte now
// and then does not keep a connection: no slowloris).
HeadParse read_head(Side& side, std::string& buffer, double timeout_s, std::string& why,
                    bool& timed_out) {
    HeadParse parsed;
    char chunk[4096];
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout_s));
    for (;;) {
        if (!side.pending()) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            pollfd p{side.fd, POLLIN, 0};
            const int ready = left.count() > 0 ? ::poll(&p, 1, static_cast<int>(left.count())) : 0;
            if (ready < 0 && errno == EINTR) continue;
            if (ready <= 0) {
                timed_out = true;
                why = "no complete request within " + seconds_text(timeout_s) +
                      " s (network.request_timeout_s)";
                parsed.status = HeadParse::Status::incomplete;
                return parsed;
            }
        }
        const ssize_t n = side.read(chunk, sizeof chunk);
        if (n == Side::kNothing) continue;
        if (n <= 0) {
            timed_out = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
            why = buffer.empty() ? "closed before a request" : "closed mid-request";
            parsed.status = HeadParse::Status::incomplete;
            return parsed;
        }
        buffer.append(chunk, static_cast<std::size_t>(n));
        parsed = parse_request_head(buffer);
        if (parsed.status != HeadParse::Status::incomplete) return parsed;
    }
}

void Gateway::serve_connection(Session& session, int client_fd, const std::string& first,
                               Event& event) {
    const NetworkLimits& limits = session.limits;
    set_timeouts(client_fd, limits.request_timeout_s);
    Side client(client_fd);
    const auto refuse = [&](int status, const std::string& why) {
        event.status = status;
        event.reason = why;
        client.write_all(error_response(status, "cellblock: " + why));
        client.shutdown_write();
        // Read what the client still sends (briefly) so that closing does not
        // reset the connection before it has read the answer.
        char sink[4096];
        set_timeouts(client_fd, 1);
        for (int i = 0; i < 64 && client.read(sink, sizeof sink) > 0; ++i) {
        }
    };

    // The request head, every size bounded (http_head.hpp).
    std::string buffer = first;
    std::string why;
    bool timed_out = false;
    HeadParse parsed = read_head(client, buffer, limits.request_timeout_s, why, timed_out);
    if (parsed.status == HeadParse::Status::incomplete) {
        if (timed_out) {
            refuse(408, why);
        } else {
            event.reason = why;
        }
        return;
    }
    if (parsed.status == HeadParse::Status::error) {
        refuse(parsed.error_status, parsed.error);
        return;
    }
    HttpRequestHead& head = parsed.head;
    event.method = head.method.substr(0, 32);
    const TargetParse target = proxy_target(head);
    if (!target.ok) {
        refuse(target.error_status, target.error);
        return;
    }
    event.host = target.target.host;
    event.port = target.target.port;
    const std::string where = event.host + ":" + std::to_string(event.port);

    if (session.closed) {
        refuse(503, "the session is closing");
        return;
    }
    const bool allowed =
        std::any_of(session.allow.begin(), session.allow.end(),
                    [&](const HostPattern& p) { return p.matches(event.host, event.port); });
    if (!allowed) {
        refuse(403, where + " is not in this session's allowlist");
        return;
    }
    if (session.bytes >= limits.max_bytes) {
        refuse(403, "this session has used its " + std::to_string(limits.max_bytes) +
                        " bytes (network.max_bytes)");
        return;
    }
    const std::vector<IpAddress> addresses = resolve(event.host, config_, why);
    if (addresses.empty()) {
        refuse(502, why);
        return;
    }
    // Only addresses outside the reserved ranges are tried, and the one
    // connected to is the one checked (no second lookup to rebind).
    std::vector<IpAddress> usable;
    std::string reserved_why;
    for (const auto& address : addresses) {
        if (auto reserved = reserved_address(address, config_.opted_in)) {
            if (reserved_why.empty()) reserved_why = *reserved;
        } else {
            usable.push_back(address);
        }
    }
    if (usable.empty()) {
        refuse(403, event.host + " resolves to " + reserved_why +
                        "; the gateway does not connect to private, loopback, link-local or "
                        "metadata addresses");
        return;
    }
    UniqueFd upstream_fd;
    timed_out = false;
    for (const auto& address : usable) {
        std::string failure;
        upstream_fd = connect_to(address, event.port, limits.request_timeout_s, failure, timed_out);
        if (upstream_fd) break;
        why = "cannot connect to " + where + " (" + address.to_string() + "): " + failure;
    }
    if (!upstream_fd) {
        refuse(timed_out ? 504 : 502, why);
        return;
    }
    session.track(upstream_fd.get());
    struct Untrack {
        Session& s;
        int fd;
        ~Untrack() { s.untrack(fd); }
    } untrack{session, upstream_fd.get()};
    Side upstream(upstream_fd.get());

    std::string_view rest(buffer);
    rest.remove_prefix(head.head_bytes);
    std::string first_to_upstream;
    bool read_status = !target.target.tunnel;
    std::optional<BodyLimit> body;  // plain HTTP and terminated TLS: one request's body
    if (target.target.tunnel) {
        event.status = 200;
        if (!client.write_all("HTTP/1.1 200 Connection established\r\n\r\n")) {
            event.reason = "client closed";
            return;
        }
        const bool has_secret =
            session.tls && std::any_of(session.secrets.begin(), session.secrets.end(),
                                       [&](const Secret& s) { return s.host == event.host; });
        if (!has_secret) {
            first_to_upstream.assign(rest);
        } else {
            // A host with secrets: the gateway is the TLS server the code
            // talks to (a leaf of the session's CA), reads the request, adds
            // the secrets and sends it on over its own verified TLS.
            if (!rest.empty()) {
                event.reason = "the client sent data before the tunnel was up";
                return;
            }
            event.tls = true;
            client.ssl = SSL_new(session.tls->server_context(event.host));
            if (!client.ssl || SSL_set_fd(client.ssl, client_fd) != 1 ||
                SSL_accept(client.ssl) != 1) {
                event.reason = "TLS with the session's code failed: " + openssl_errors();
                return;
            }
            std::string inner;
            parsed = read_head(client, inner, limits.request_timeout_s, why, timed_out);
            if (parsed.status == HeadParse::Status::incomplete) {
                event.reason = "inside the tunnel: " + why;
                return;
            }
            if (parsed.status == HeadParse::Status::error) {
                refuse(parsed.error_status, parsed.error);
                return;
            }
            HttpRequestHead& request = parsed.head;
            event.method = "CONNECT " + request.method.substr(0, 24);
            if (request.target.empty() || request.target[0] != '/') {
                refuse(400, "inside a tunnel a request names a path (origin form), not " +
                                request.target.substr(0, 64));
                return;
            }
            for (const auto& [name, value] : request.headers) {
                if (lower(name) != "host") continue;
                std::string host = value;
                if (const auto colon = host.rfind(':'); colon != std::string::npos &&
                                                        host.find(']') == std::string::npos &&
                                                        host.find(':') == colon) {
                    host.resize(colon);
                }
                if (normalise_host(host) != event.host) {
                    refuse(400, "the request's Host " + value.substr(0, 64) +
                                    " is not the tunnel's host " + event.host);
                    return;
                }
            }
            upstream.ssl = SSL_new(config_.upstream_tls->context());
            if (!upstream.ssl || SSL_set_fd(upstream.ssl, upstream_fd.get()) != 1 ||
                SSL_set_tlsext_host_name(upstream.ssl, event.host.c_str()) != 1 ||
                SSL_set1_host(upstream.ssl, event.host.c_str()) != 1 ||
                SSL_connect(upstream.ssl) != 1) {
                const long verify = upstream.ssl ? SSL_get_verify_result(upstream.ssl) : 0;
                refuse(502,
                       "TLS to " + where + " failed: " +
                           (verify != X509_V_OK ? std::string(X509_verify_cert_error_string(verify))
                                                : openssl_errors()));
                return;
            }
            // The secrets replace whatever the code sent under their names.
            std::vector<std::pair<std::string, std::string>> headers;
            for (auto& header : request.headers) {
                const bool replaced = std::any_of(
                    session.secrets.begin(), session.secrets.end(), [&](const Secret& s) {
                        return s.host == event.host && lower(s.header) == lower(header.first);
                    });
                if (!replaced) headers.push_back(std::move(header));
            }
            for (const auto& secret : session.secrets) {
                if (secret.host != event.host) continue;
                headers.emplace_back(secret.header, secret.value);
                event.secrets.push_back(secret.header);
            }
            request.headers = std::move(headers);
            ProxyTarget origin = target.target;
            origin.tunnel = false;
            origin.origin_form = request.target;
            const BodyFraming framing = body_framing(request);
            if (!framing.ok) {
                refuse(400, framing.error);
                return;
            }
            body.emplace(framing);
            const std::string_view inner_rest = std::string_view(inner).substr(request.head_bytes);
            first_to_upstream = forward_head(request, origin);
            first_to_upstream.append(inner_rest.substr(0, body->take(inner_rest)));
            read_status = true;
        }
    } else {
        const BodyFraming framing = body_framing(head);
        if (!framing.ok) {
            refuse(400, framing.error);
            return;
        }
        body.emplace(framing);
        first_to_upstream = forward_head(head, target.target);
        first_to_upstream.append(rest.substr(0, body->take(rest)));
        if (body->malformed()) {
            refuse(400, "malformed chunked body");
            return;
        }
    }
    event.verdict = "allowed";
    relay(session, client, upstream, first_to_upstream, read_status, body ? &*body : nullptr,
          event);
    if (body && body->dropped > 0 && event.reason.empty()) {
        event.reason = std::to_string(body->dropped) +
                       " bytes after the request's body were dropped (one request per connection)";
    }
}

void Gateway::relay(Session& session, Side& client, Side& upstream, const std::string& first,
                    bool read_status, BodyLimit* body, Event& event) {
    // Relays both ways until both ends are done, a side is idle for
    // request_timeout_s, or the session's byte budget is spent.
    const NetworkLimits& limits = session.limits;
    const auto charge = [&](std::size_t n) {
        return session.bytes.fetch_add(static_cast<std::int64_t>(n)) +
                   static_cast<std::int64_t>(n) <=
               limits.max_bytes;
    };
    if (!first.empty()) {
        if (!charge(first.size())) {
            event.reason = "byte cap (network.max_bytes) reached";
            event.verdict = "cut";
            return;
        }
        if (!upstream.write_all(first)) {
            event.reason = "upstream closed";
            return;
        }
        event.up += static_cast<std::int64_t>(first.size());
    }
    bool open[2] = {true, true};  // client -> upstream, upstream -> client
    Side* from[2] = {&client, &upstream};
    Side* to[2] = {&upstream, &client};
    std::vector<char> chunk(kRelayChunk);
    // Bytes that need no look (a tunnel; a response after its status line)
    // move socket -> pipe -> socket with splice(2): the kernel moves them and
    // the gateway never copies them. TLS the gateway terminates, and a
    // request's body (its framing is checked), go through `chunk`.
    struct Pipe {
        UniqueFd r, w;
    } pipes[2];
    if (!client.ssl && !upstream.ssl) {
        for (auto& pipe : pipes) {
            int fds[2];
            if (::pipe2(fds, O_CLOEXEC) != 0) break;
            pipe.r.reset(fds[0]);
            pipe.w.reset(fds[1]);
            ::fcntl(fds[1], F_SETPIPE_SZ, static_cast<int>(kSpliceChunk));  // best effort
        }
    }
    const int idle_ms = static_cast<int>(limits.request_timeout_s * 1000);
    while (open[0] || open[1]) {
        pollfd fds[2] = {{open[0] ? client.fd : -1, POLLIN, 0},
                         {open[1] ? upstream.fd : -1, POLLIN, 0}};
        const bool buffered = (open[0] && client.pending()) || (open[1] && upstream.pending());
        const int ready = ::poll(fds, 2, buffered ? 0 : idle_ms);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0 || (ready == 0 && !buffered)) {
            event.reason = ready == 0 ? "idle for " + seconds_text(limits.request_timeout_s) +
                                            " s (network.request_timeout_s)"
                                      : std::string("poll: ") + std::strerror(errno);
            return;
        }
        for (int side = 0; side < 2; ++side) {
            if (!open[side]) continue;
            if (!(fds[side].revents & (POLLIN | POLLHUP | POLLERR)) && !from[side]->pending())
                continue;
            const bool zero_copy = pipes[side].r && !(side == 0 && body) &&
                                   !(side == 1 && read_status && event.down == 0);
            if (zero_copy) {
                const ssize_t n = ::splice(from[side]->fd, nullptr, pipes[side].w.get(), nullptr,
                                           kSpliceChunk, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
                if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                if (n <= 0) {
                    open[side] = false;
                    to[side]->shutdown_write();
                    if (side == 1) open[0] = false;
                    continue;
                }
                if (!charge(static_cast<std::size_t>(n))) {
                    event.reason = "byte cap (network.max_bytes " +
                                   std::to_string(limits.max_bytes) + ") reached; connection cut";
                    event.verdict = "cut";
                    return;
                }
                for (ssize_t left = n; left > 0;) {
                    const ssize_t m = ::splice(pipes[side].r.get(), nullptr, to[side]->fd, nullptr,
                                               static_cast<std::size_t>(left), SPLICE_F_MOVE);
                    if (m < 0 && errno == EINTR) continue;
                    if (m <= 0) {
                        event.reason = side == 0 ? "upstream closed" : "client closed";
                        return;
                    }
                    left -= m;
                }
                (side == 0 ? event.up : event.down) += n;
                continue;
            }
            const ssize_t n = from[side]->read(chunk.data(), chunk.size());
            if (n == Side::kNothing) continue;
            if (n <= 0) {
                open[side] = false;
                to[side]->shutdown_write();
                if (side == 1) open[0] = false;  // the response is complete: done
                continue;
            }
            std::size_t size = static_cast<std::size_t>(n);
            if (side == 0 && body) {
                size = body->take(std::string_view(chunk.data(), size));
                if (body->malformed()) {
                    event.reason = "malformed chunked body; connection closed";
                    return;
                }
                if (size == 0) continue;  // past the body: dropped
            }
            if (side == 1 && event.down == 0 && read_status) {
                event.status = response_status(std::string_view(chunk.data(), size));
            }
            if (!charge(size)) {
                event.reason = "byte cap (network.max_bytes " + std::to_string(limits.max_bytes) +
                               ") reached; connection cut";
                event.verdict = "cut";
                return;
            }
            if (!to[side]->write_all(std::string_view(chunk.data(), size))) {
                event.reason = side == 0 ? "upstream closed" : "client closed";
                return;
            }
            (side == 0 ? event.up : event.down) += static_cast<std::int64_t>(size);
        }
    }
}

}  // namespace

int serve(int control_fd) {
    Gateway gateway(control_fd);
    return gateway.run();
}

}  // namespace cellblock::gateway
