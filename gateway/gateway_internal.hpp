// What the egress gateway's files share (private to gateway/): the state of
// a session and of one connection, and the steps gateway.cpp runs in order.
// upstream.cpp: resolving and connecting; relay.cpp: the head, and bytes both
// ways; control.cpp: the server's socket. gateway.cpp: the process's loop
// and the order of the checks.
#pragma once

#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/egress_rules.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/unique_fd.hpp"
#include "http_head.hpp"
#include "tls.hpp"

namespace cellblock::gateway {

inline constexpr std::size_t kRelayChunk = 64 * 1024;    // read and written (TLS, bodies)
inline constexpr std::size_t kSpliceChunk = 256 * 1024;  // moved by splice(2)

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

inline std::string lower(std::string_view s) {
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
    UpstreamResumption resumption;    // TLS sessions with its secret hosts' upstreams
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
    bool upstream_resumed = false;     // and resumed its TLS session with the upstream
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

// ---- relay.cpp ----

std::string seconds_text(double s);         // 1.5 -> "1.5", 60 -> "60"
void set_timeouts(int fd, double seconds);  // SO_RCVTIMEO and SO_SNDTIMEO
bool send_all(int fd, std::string_view data);

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
// and then does not keep a connection: no slowloris). Incomplete with `why`
// (and `timed_out`) when it does not.
HeadParse read_head(Side& side, std::string& buffer, double timeout_s, std::string& why,
                    bool& timed_out);

// Relays both ways until both ends are done, a side is idle for
// request_timeout_s, or the session's byte budget is spent; `first` goes
// upstream before anything else.
void relay(Session& session, Side& client, Side& upstream, const std::string& first,
           bool read_status, BodyLimit* body, Event& event);

// ---- connection.cpp ----

// One connection, from its head to the end of its relay; `first` is what
// the client sent before the gateway took the connection over.
void serve_connection(const Config& config, Session& session, int client_fd,
                      const std::string& first, Event& event);

// ---- upstream.cpp ----

// The addresses `host` stands for: a pinned name's address, an IP literal
// itself, or what the system resolver answers within `timeout_s` (never
// under config.dns false). Empty with `why` on failure; `timed_out` says
// the resolver took longer.
std::vector<IpAddress> resolve(const std::string& host, const Config& config, double timeout_s,
                               std::string& why, bool& timed_out);

// Runs `lookup` on a thread of its own and waits at most `timeout_s` for
// it: a resolver that takes longer (a slow or unreachable DNS server, whose
// own timeouts are seconds per attempt) costs the connection its request
// timeout, not more; the late answer is dropped when it comes.
// At most kMaxLookups run at once (those given up on included); past that a
// name is refused at once with why.
using Lookup = std::function<std::vector<IpAddress>(std::string& why)>;
inline constexpr int kMaxLookups = 64;
int lookups_in_progress();
std::vector<IpAddress> resolve_within(const std::string& host, double timeout_s, std::string& why,
                                      bool& timed_out, Lookup lookup);

// Connects to exactly `address` (the one that was checked), within `timeout_s`.
UniqueFd connect_to(const IpAddress& address, int port, double timeout_s, std::string& why,
                    bool& timed_out);

}  // namespace cellblock::gateway
