// One connection through the gateway, as the steps its checks run in: the
// request (head, target), admission by the session's policy (closing,
// allowlist, byte cap), the upstream (resolved, reserved ranges refused,
// the checked address connected), then what goes upstream first: a
// tunnel's bytes as they come, a terminated tunnel's request with the
// session's secrets added, or a plain request's head and body. A step that
// fails has answered the client (or not, when the client is gone) and filled
// the connection's event; the caller stops there.
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "gateway_internal.hpp"

namespace cellblock::gateway {
namespace {

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

class Connection {
  public:
    Connection(const Config& config, Session& session, int client_fd, Event& event)
        : config_(config),
          session_(session),
          limits_(session.limits),
          client_fd_(client_fd),
          client_(client_fd),
          event_(event) {}
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    ~Connection() {
        if (upstream_fd_) session_.untrack(upstream_fd_.get());
    }

    void serve(const std::string& first) {
        set_timeouts(client_fd_, limits_.request_timeout_s);
        if (!read_request(first) || !admit() || !connect_upstream()) return;
        const bool ready = target_.tunnel ? open_tunnel() : forward_request();
        if (!ready) return;
        event_.verdict = "allowed";
        relay(session_, client_, *upstream_, first_to_upstream_, read_status_,
              body_ ? &*body_ : nullptr, event_);
        if (body_ && body_->dropped > 0 && event_.reason.empty()) {
            event_.reason =
                std::to_string(body_->dropped) +
                " bytes after the request's body were dropped (one request per connection)";
        }
    }

  private:
    // The client is answered `status` and the event says why.
    bool refuse(int status, const std::string& why) {
        event_.status = status;
        event_.reason = why;
        client_.write_all(error_response(status, "cellblock: " + why));
        client_.shutdown_write();
        // Read what the client still sends (briefly) so that closing does not
        // reset the connection before it has read the answer.
        char sink[4096];
        set_timeouts(client_fd_, 1);
        for (int i = 0; i < 64 && client_.read(sink, sizeof sink) > 0; ++i) {
        }
        return false;
    }
    // The connection ends without an answer (the client is gone or broke
    // the protocol below HTTP); the event says why.
    bool drop(const std::string& why) {
        event_.reason = why;
        return false;
    }

    // The request head, every size bounded (http_head.hpp), and its target.
    bool read_request(const std::string& first) {
        buffer_ = first;
        std::string why;
        bool timed_out = false;
        HeadParse parsed = read_head(client_, buffer_, limits_.request_timeout_s, why, timed_out);
        if (parsed.status == HeadParse::Status::incomplete) {
            return timed_out ? refuse(408, why) : drop(why);
        }
        if (parsed.status == HeadParse::Status::error) {
            return refuse(parsed.error_status, parsed.error);
        }
        head_ = std::move(parsed.head);
        event_.method = head_.method.substr(0, 32);
        const TargetParse target = proxy_target(head_);
        if (!target.ok) return refuse(target.error_status, target.error);
        target_ = target.target;
        event_.host = target_.host;
        event_.port = target_.port;
        where_ = event_.host + ":" + std::to_string(event_.port);
        return true;
    }

    // What the session's policy says of the target, before any lookup.
    bool admit() {
        if (session_.closed) return refuse(503, "the session is closing");
        const bool allowed =
            std::any_of(session_.allow.begin(), session_.allow.end(),
                        [&](const HostPattern& p) { return p.matches(event_.host, event_.port); });
        if (!allowed) return refuse(403, where_ + " is not in this session's allowlist");
        if (session_.bytes >= limits_.max_bytes) {
            return refuse(403, "this session has used its " + std::to_string(limits_.max_bytes) +
                                   " bytes (network.max_bytes)");
        }
        return true;
    }

    // Only addresses outside the reserved ranges are tried, and the one
    // connected to is the one checked (no second lookup to rebind).
    bool connect_upstream() {
        std::string why;
        bool timed_out = false;
        const std::vector<IpAddress> addresses =
            resolve(event_.host, config_, limits_.request_timeout_s, why, timed_out);
        if (addresses.empty()) return refuse(timed_out ? 504 : 502, why);
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
            return refuse(403, first_reserved->refusal(event_.host) +
                                   "; the gateway does not connect to private, loopback, "
                                   "link-local or metadata addresses");
        }
        timed_out = false;
        for (const auto& address : usable) {
            std::string failure;
            upstream_fd_ =
                connect_to(address, event_.port, limits_.request_timeout_s, failure, timed_out);
            if (upstream_fd_) break;
            why = "cannot connect to " + where_ + " (" + address.to_string() + "): " + failure;
        }
        if (!upstream_fd_) return refuse(timed_out ? 504 : 502, why);
        session_.track(upstream_fd_.get());
        upstream_.emplace(upstream_fd_.get());
        return true;
    }

    // CONNECT: established, then either the code's bytes as they come, or,
    // for a host with secrets, the gateway's own TLS on both sides.
    bool open_tunnel() {
        event_.status = 200;
        if (!client_.write_all("HTTP/1.1 200 Connection established\r\n\r\n")) {
            return drop("client closed");
        }
        std::string_view rest(buffer_);
        rest.remove_prefix(head_.head_bytes);
        const bool has_secret =
            session_.tls && std::any_of(session_.secrets.begin(), session_.secrets.end(),
                                        [&](const Secret& s) { return s.host == event_.host; });
        if (!has_secret) {
            first_to_upstream_.assign(rest);
            read_status_ = false;
            return true;
        }
        if (!rest.empty()) return drop("the client sent data before the tunnel was up");
        return terminate_tls();
    }

    // The gateway is the TLS server the code talks to (a leaf of the
    // session's CA), reads the request, adds the secrets and sends it on
    // over its own verified TLS.
    bool terminate_tls() {
        event_.tls = true;
        // The upstream's handshake runs beside the code's: the host is known
        // from CONNECT, so the two need not wait for each other (about half a
        // millisecond of a small request here). Joined before the upstream is
        // used; on an early return, cut and joined.
        std::string upstream_error;
        UpstreamHandshake upstream_tls(upstream_fd_.get(),
                                       [&] { upstream_error = upstream_tls_handshake(); });
        client_.ssl = SSL_new(session_.tls->server_context(event_.host));
        if (!client_.ssl || SSL_set_fd(client_.ssl, client_fd_) != 1 ||
            SSL_accept(client_.ssl) != 1) {
            return drop("TLS with the session's code failed: " + openssl_errors());
        }
        std::string inner, why;
        bool timed_out = false;
        HeadParse parsed = read_head(client_, inner, limits_.request_timeout_s, why, timed_out);
        if (parsed.status == HeadParse::Status::incomplete)
            return drop("inside the tunnel: " + why);
        if (parsed.status == HeadParse::Status::error) {
            return refuse(parsed.error_status, parsed.error);
        }
        HttpRequestHead& request = parsed.head;
        event_.method = "CONNECT " + request.method.substr(0, 24);
        if (request.target.empty() || request.target[0] != '/') {
            return refuse(400, "inside a tunnel a request names a path (origin form), not " +
                                   request.target.substr(0, 64));
        }
        if (!same_host(request)) return false;
        upstream_tls.join();
        if (!upstream_error.empty()) return refuse(502, upstream_error);
        event_.upstream_resumed = SSL_session_reused(upstream_->ssl) == 1;
        add_secrets(request);
        ProxyTarget origin = target_;
        origin.tunnel = false;
        origin.origin_form = request.target;
        const BodyFraming framing = body_framing(request);
        if (!framing.ok) return refuse(400, framing.error);
        body_.emplace(framing);
        const std::string_view inner_rest = std::string_view(inner).substr(request.head_bytes);
        first_to_upstream_ = forward_head(request, origin);
        first_to_upstream_.append(inner_rest.substr(0, body_->take(inner_rest)));
        read_status_ = true;
        return true;
    }

    // Every Host header inside a terminated tunnel names the tunnel's host.
    bool same_host(const HttpRequestHead& request) {
        for (const auto& [name, value] : request.headers) {
            if (lower(name) != "host") continue;
            std::string host = value;
            if (const auto colon = host.rfind(':'); colon != std::string::npos &&
                                                    host.find(']') == std::string::npos &&
                                                    host.find(':') == colon) {
                host.resize(colon);
            }
            if (normalise_host(host) != event_.host) {
                return refuse(400, "the request's Host " + value.substr(0, 64) +
                                       " is not the tunnel's host " + event_.host);
            }
        }
        return true;
    }

    // The secrets replace whatever the code sent under their names.
    void add_secrets(HttpRequestHead& request) {
        std::vector<std::pair<std::string, std::string>> headers;
        for (auto& header : request.headers) {
            const bool replaced =
                std::any_of(session_.secrets.begin(), session_.secrets.end(), [&](const Secret& s) {
                    return s.host == event_.host && lower(s.header) == lower(header.first);
                });
            if (!replaced) headers.push_back(std::move(header));
        }
        for (const auto& secret : session_.secrets) {
            if (secret.host != event_.host) continue;
            headers.emplace_back(secret.header, secret.value);
            event_.secrets.push_back(secret.header);
        }
        request.headers = std::move(headers);
    }

    // The gateway's verified TLS to the target, resuming the session's last
    // TLS session with it. Returns why it failed, or "".
    std::string upstream_tls_handshake() {
        Side& upstream = *upstream_;
        upstream.ssl = SSL_new(config_.upstream_tls->context());
        if (upstream.ssl) session_.resumption.attach(upstream.ssl, where_);
        if (upstream.ssl && SSL_set_fd(upstream.ssl, upstream.fd) == 1 &&
            SSL_set_tlsext_host_name(upstream.ssl, event_.host.c_str()) == 1 &&
            SSL_set1_host(upstream.ssl, event_.host.c_str()) == 1 && SSL_connect(upstream.ssl) == 1)
            return "";
        const long verify = upstream.ssl ? SSL_get_verify_result(upstream.ssl) : 0;
        return "TLS to " + where_ + " failed: " +
               (verify != X509_V_OK ? std::string(X509_verify_cert_error_string(verify))
                                    : openssl_errors());
    }

    // Plain HTTP: the head in origin form and what of the body came with it.
    bool forward_request() {
        const BodyFraming framing = body_framing(head_);
        if (!framing.ok) return refuse(400, framing.error);
        body_.emplace(framing);
        std::string_view rest(buffer_);
        rest.remove_prefix(head_.head_bytes);
        first_to_upstream_ = forward_head(head_, target_);
        first_to_upstream_.append(rest.substr(0, body_->take(rest)));
        if (body_->malformed()) return refuse(400, "malformed chunked body");
        read_status_ = true;
        return true;
    }

    const Config& config_;
    Session& session_;
    const NetworkLimits& limits_;
    int client_fd_;
    Side client_;
    Event& event_;
    std::string buffer_;  // what the client sent first: the head and what followed it
    HttpRequestHead head_;
    ProxyTarget target_;
    std::string where_;  // host:port, for messages
    UniqueFd upstream_fd_;
    // Declared after upstream_fd_: its TLS is freed before the socket closes.
    std::optional<Side> upstream_;
    std::string first_to_upstream_;
    bool read_status_ = true;
    std::optional<BodyLimit> body_;  // plain HTTP and terminated TLS: one request's body
};

}  // namespace

void serve_connection(const Config& config, Session& session, int client_fd,
                      const std::string& first, Event& event) {
    Connection(config, session, client_fd, event).serve(first);
}

}  // namespace cellblock::gateway
