#include "gateway.hpp"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

#include "gateway_internal.hpp"

namespace cellblock::gateway {
using nlohmann::json;

namespace {

// Connections served at once across all sessions; past it a connection is
// refused unread (each one is a thread).
constexpr int kMaxThreads = 512;

void log_line(const std::string& text) {
    const std::string line = "cellblock-gateway: " + text + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}

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
    std::string connect_upstream_tls(Session& session, Side& upstream, const std::string& host,
                                     const std::string& where);

    int control_fd_;
    Config config_;
    bool configured_ = false;
    bool done_ = false;
    std::map<std::string, std::shared_ptr<Session>> sessions_;
    std::mutex send_mutex_;
    std::atomic<int> threads_{0};
};

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
    if (event.tls) message["upstream_tls_resumed"] = event.upstream_resumed;
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
    UniqueFd passed;
    int flags = 0;
    const ssize_t n = receive_with_fd(conn, &byte, 1, passed, flags);
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
    if (!stream || !inet || (flags & MSG_CTRUNC)) {
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

// A thread that runs `work` (the upstream's TLS handshake) while the caller
// does its own. join() waits for it; leaving without a join first shuts the
// socket down, so that a handshake still waiting ends at once.
class UpstreamHandshake {
  public:
    template <class F>
    UpstreamHandshake(int fd, F&& work) : fd_(fd), thread_(std::forward<F>(work)) {}
    UpstreamHandshake(const UpstreamHandshake&) = delete;
    UpstreamHandshake& operator=(const UpstreamHandshake&) = delete;
    void join() {
        if (thread_.joinable()) thread_.join();
    }
    ~UpstreamHandshake() {
        if (!thread_.joinable()) return;
        ::shutdown(fd_, SHUT_RDWR);
        thread_.join();
    }

  private:
    int fd_;
    std::thread thread_;
};

// The gateway's verified TLS to `where` on `upstream`, resuming the session's
// last TLS session with it. Returns why it failed, or "".
std::string Gateway::connect_upstream_tls(Session& session, Side& upstream, const std::string& host,
                                          const std::string& where) {
    upstream.ssl = SSL_new(config_.upstream_tls->context());
    if (upstream.ssl) session.resumption.attach(upstream.ssl, where);
    if (upstream.ssl && SSL_set_fd(upstream.ssl, upstream.fd) == 1 &&
        SSL_set_tlsext_host_name(upstream.ssl, host.c_str()) == 1 &&
        SSL_set1_host(upstream.ssl, host.c_str()) == 1 && SSL_connect(upstream.ssl) == 1)
        return "";
    const long verify = upstream.ssl ? SSL_get_verify_result(upstream.ssl) : 0;
    return "TLS to " + where + " failed: " +
           (verify != X509_V_OK ? std::string(X509_verify_cert_error_string(verify))
                                : openssl_errors());
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
    bool resolve_timed_out = false;
    const std::vector<IpAddress> addresses =
        resolve(event.host, config_, limits.request_timeout_s, why, resolve_timed_out);
    if (addresses.empty()) {
        refuse(resolve_timed_out ? 504 : 502, why);
        return;
    }
    // Only addresses outside the reserved ranges are tried, and the one
    // connected to is the one checked (no second lookup to rebind).
    std::vector<IpAddress> usable;
    std::optional<ReservedAddress> first_reserved;
    for (const auto& address : addresses) {
        if (auto reserved = reserved_address(address, config_.opted_in)) {
            if (!first_reserved) first_reserved = std::move(reserved);
        } else {
            usable.push_back(address);
        }
    }
    if (usable.empty()) {
        refuse(403, first_reserved->refusal(event.host) +
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
            // The upstream's handshake runs beside the code's: the host is
            // known from CONNECT, so the two need not wait for each other
            // (about half a millisecond of a small request here). Joined
            // before the upstream is used; on an early return, cut and joined.
            std::string upstream_error;
            UpstreamHandshake upstream_tls(upstream_fd.get(), [&] {
                upstream_error = connect_upstream_tls(session, upstream, event.host, where);
            });
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
            upstream_tls.join();
            if (!upstream_error.empty()) {
                refuse(502, upstream_error);
                return;
            }
            event.upstream_resumed = SSL_session_reused(upstream.ssl) == 1;
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

}  // namespace

int serve(int control_fd) {
    Gateway gateway(control_fd);
    return gateway.run();
}

}  // namespace cellblock::gateway
