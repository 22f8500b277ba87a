#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>

#include "gateway_internal.hpp"

namespace cellblock::gateway {

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

void relay(Session& session, Side& client, Side& upstream, const std::string& first,
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

}  // namespace cellblock::gateway
