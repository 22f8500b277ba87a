#include "egress_tunnel.hpp"

#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <spdlog/spdlog.h>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/signer.hpp"
#include "multipart.hpp"
#include "unix_address.hpp"

namespace cellblock {

namespace protocol = sandbox_protocol;

namespace {

constexpr std::uint64_t kWindow = protocol::kTunnelWindowBytes;
constexpr std::size_t kChunk = protocol::kTunnelChunkBytes;
// Messages handled per turn, so that one busy tunnel does not hold the loop.
constexpr int kMessagesPerTurn = 256;
constexpr std::size_t kMaxFrames = 4;

std::optional<std::uint64_t> decimal(std::string_view digits) {
    std::uint64_t value = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size()) {
        return std::nullopt;
    }
    return value;
}

}  // namespace

struct EgressTunnel::Connection {
    std::string id;
    UniqueFd gateway;
    EventLoop::WatchId watch = 0;
    std::string to_gateway;                     // received from the task, not yet written
    std::uint64_t received = 0, delivered = 0;  // task -> gateway
    std::uint64_t sent = 0, acked = 0;          // gateway -> task
    bool task_ended = false;                    // the task sent eof
    bool gateway_ended = false;                 // the gateway's side ended; eof sent
    bool shut = false;                          // SHUT_WR done on the gateway's socket
};

EgressTunnel::EgressTunnel(EventLoop& loop, zmq::context_t& context, EgressTunnelSettings settings)
    : loop_(loop),
      settings_(std::move(settings)),
      socket_(context, zmq::socket_type::dealer),
      monitor_(context, zmq::socket_type::pair) {
    char public_key[41] = {}, secret_key[41] = {};
    if (zmq_curve_keypair(public_key, secret_key) != 0) {
        throw std::runtime_error("the egress tunnel needs CurveZMQ, which this libzmq lacks: " +
                                 std::string(zmq_strerror(zmq_errno())));
    }
    socket_.set(zmq::sockopt::linger, 0);
    // Bounded by the protocol, not by the queue: at most a window of data
    // per connection is unacknowledged, so nothing the front sends is dropped.
    socket_.set(zmq::sockopt::sndhwm, 0);
    socket_.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(kChunk) + 64);
    socket_.set(zmq::sockopt::curve_serverkey, settings_.server_key);
    socket_.set(zmq::sockopt::curve_publickey, std::string(public_key));
    socket_.set(zmq::sockopt::curve_secretkey, std::string(secret_key));
    static std::atomic<std::uint64_t> monitors{0};
    const std::string monitor_address =
        "inproc://egress-tunnel-monitor-" + std::to_string(++monitors);
    if (zmq_socket_monitor(socket_.handle(), monitor_address.c_str(),
                           ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
        throw std::runtime_error("the egress tunnel's monitor: " +
                                 std::string(zmq_strerror(zmq_errno())));
    }
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.connect(monitor_address);
    socket_.connect(settings_.endpoint);
    watch_ = loop_.watch(socket_, [this] { on_tunnel(); });
    monitor_watch_ = loop_.watch(monitor_, [this] { on_monitor(); });
    say_hello();
}

EgressTunnel::~EgressTunnel() {
    for (auto& [id, c] : connections_) {
        if (c->watch) loop_.unwatch(c->watch);
    }
    loop_.unwatch(watch_);
    loop_.unwatch(monitor_watch_);
    zmq_socket_monitor(socket_.handle(), nullptr, 0);
}

void EgressTunnel::on_monitor() {
    Multipart event;
    while (recv_multipart(monitor_, event, kMaxFrames)) {
        // [u16 event, u32 value][endpoint]; only handshakes are asked for.
        event = Multipart{};
        if (++handshakes_ == 1) continue;  // the first: hello is queued already
        ++counts_.reconnects;
        spdlog::warn(
            "session {}: egress tunnel to its task connected again after a break: its "
            "{} open connection(s) are closed",
            settings_.session_id, connections_.size());
        while (!connections_.empty()) drop(connections_.begin()->first);
        counts_.greeted = false;
        say_hello();
    }
}

void EgressTunnel::say_hello() {
    // The maximum message size bounds what comes back (data, kChunk); the
    // trust store (a few hundred KiB) only goes out.
    const std::string signature =
        Signer(settings_.signing_key).sign(settings_.trust_store, "", "", "");
    send({protocol::kTunnelHello, "", settings_.trust_store, signature});
}

void EgressTunnel::send(std::initializer_list<std::string_view> frames) {
    std::size_t left = frames.size();
    for (std::string_view frame : frames) {
        --left;
        zmq::message_t message(frame.data(), frame.size());
        const auto flags = zmq::send_flags::dontwait |
                           (left > 0 ? zmq::send_flags::sndmore : zmq::send_flags::none);
        if (!socket_.send(message, flags)) {
            // With no high-water mark this happens only when no peer is
            // connected yet and ZMQ cannot queue (it queues for a DEALER).
            ++counts_.send_failures;
            return;
        }
    }
    EventLoop::note_touched(socket_.handle());
}

void EgressTunnel::on_tunnel() {
    for (int n = 0; n < kMessagesPerTurn; ++n) {
        Multipart message;
        if (!recv_multipart(socket_, message, kMaxFrames)) return;
        const std::size_t frames = message.frames.size();
        if (frames < 2 || message.dropped_frames > 0) {
            ++counts_.protocol_errors;
            continue;
        }
        // Views of the message's frames (a data chunk is copied once, into
        // what waits for the gateway).
        const auto frame = [&](std::size_t i) {
            return i < frames ? std::optional(message.view(i)) : std::nullopt;
        };
        handle(message.view(0), message.view(1), frame(2), frame(3));
    }
}

void EgressTunnel::handle(std::string_view verb, std::string_view id,
                          std::optional<std::string_view> third,
                          std::optional<std::string_view> fourth) {
    if (verb == protocol::kTunnelHello) {
        if (!counts_.greeted) {
            spdlog::info("session {}: egress tunnel to its task is up", settings_.session_id);
        }
        counts_.greeted = true;
        return;
    }
    if (verb == protocol::kTunnelOpen && !third) {
        open(id);
        return;
    }
    const auto it = connections_.find(id);
    if (verb == protocol::kTunnelClose && !third) {
        if (it != connections_.end()) drop(id);
        return;
    }
    const bool known_verb = verb == protocol::kTunnelData || verb == protocol::kTunnelAck ||
                            verb == protocol::kTunnelEof;
    if (!known_verb) {
        ++counts_.protocol_errors;
        if (counts_.protocol_errors == 1) {
            spdlog::warn(
                "session {}: egress tunnel: a message the protocol does not have "
                "(verb of {} bytes); ignored, and later ones counted",
                settings_.session_id, verb.size());
        }
        return;
    }
    if (it == connections_.end()) {
        // Not (or no longer) open here: the task forgets it too.
        send({protocol::kTunnelClose, id});
        return;
    }
    Connection& c = *it->second;
    if (verb == protocol::kTunnelData && third && fourth) {
        on_data(c, *third, *fourth);
    } else if (verb == protocol::kTunnelAck && third && !fourth) {
        on_ack(c, *third);
    } else if (verb == protocol::kTunnelEof && !third && !c.task_ended) {
        c.task_ended = true;
        write_gateway(c);
    } else {
        fail(c, "a message of the wrong shape", true);
    }
}

void EgressTunnel::open(std::string_view id) {
    if (const auto it = connections_.find(id); it != connections_.end()) {
        return fail(*it->second, "a connection opened twice", true);
    }
    if (id.empty() ||
        connections_.size() >= static_cast<std::size_t>(protocol::kTunnelMaxConnections)) {
        ++counts_.refused;
        send({protocol::kTunnelClose, id});
        return;
    }
    auto c = std::make_unique<Connection>();
    c->id = std::string(id);
    const auto addr = unix_address(settings_.gateway_socket.native());
    c->gateway.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    // A unix connect completes at once or fails (EAGAIN: the gateway's
    // backlog is full): never wait for it on the loop.
    if (!addr || !c->gateway ||
        ::connect(c->gateway.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0) {
        const int error = errno;
        ++counts_.refused;
        spdlog::warn("session {}: egress tunnel: the gateway's socket {} refused a connection: {}",
                     settings_.session_id, settings_.gateway_socket.string(), std::strerror(error));
        send({protocol::kTunnelClose, id});
        return;
    }
    ++counts_.opened;
    Connection& ref = *c;
    connections_.emplace(id, std::move(c));
    counts_.open_now = connections_.size();
    rewatch(ref);
}

void EgressTunnel::on_data(Connection& c, std::string_view offset, std::string_view bytes) {
    const auto at = decimal(offset);
    if (!at || *at != c.received || bytes.size() > kChunk || c.task_ended ||
        c.received + bytes.size() - c.delivered > kWindow) {
        fail(c, "data out of order or past its window", true);
        return;
    }
    c.received += bytes.size();
    c.to_gateway += bytes;
    write_gateway(c);
}

void EgressTunnel::on_ack(Connection& c, std::string_view total) {
    const auto acked = decimal(total);
    if (!acked || *acked < c.acked || *acked > c.sent) {
        fail(c, "an acknowledgement of bytes never sent", true);
        return;
    }
    c.acked = *acked;
    if (done(c)) return end(c);
    rewatch(c);
}

void EgressTunnel::on_gateway(Connection& c) {
    // Copies of the id: either step may drop the connection.
    const std::string id = c.id;
    if (!c.to_gateway.empty()) write_gateway(c);
    const auto it = connections_.find(id);
    if (it == connections_.end()) return;
    read_gateway(*it->second);
}

void EgressTunnel::read_gateway(Connection& c) {
    if (c.gateway_ended || c.sent - c.acked >= kWindow) return rewatch(c);
    static thread_local std::vector<char> buffer(kChunk);
    const std::size_t room = std::min<std::uint64_t>(kChunk, kWindow - (c.sent - c.acked));
    const ssize_t n = ::recv(c.gateway.get(), buffer.data(), room, 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return rewatch(c);
    if (n < 0) return fail(c, "the gateway's side failed", false);
    if (n == 0) {
        c.gateway_ended = true;
        send({protocol::kTunnelEof, c.id});
        if (done(c)) return end(c);
    } else {
        const std::string offset = std::to_string(c.sent);
        send({protocol::kTunnelData, c.id, offset,
              std::string_view(buffer.data(), static_cast<std::size_t>(n))});
        c.sent += static_cast<std::uint64_t>(n);
        counts_.bytes_in += static_cast<std::uint64_t>(n);
    }
    rewatch(c);
}

void EgressTunnel::write_gateway(Connection& c) {
    if (!c.to_gateway.empty()) {
        const ssize_t n =
            ::send(c.gateway.get(), c.to_gateway.data(), c.to_gateway.size(), MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EINTR)
            return fail(c, "the gateway's side failed", false);
        if (n > 0) {
            c.to_gateway.erase(0, static_cast<std::size_t>(n));
            c.delivered += static_cast<std::uint64_t>(n);
            counts_.bytes_out += static_cast<std::uint64_t>(n);
            send({protocol::kTunnelAck, c.id, std::to_string(c.delivered)});
        }
    }
    if (c.task_ended && c.to_gateway.empty() && !c.shut) {
        ::shutdown(c.gateway.get(), SHUT_WR);
        c.shut = true;
    }
    if (done(c)) return end(c);
    rewatch(c);
}

bool EgressTunnel::done(const Connection& c) {
    // Both ways ended, and everything sent to the task acknowledged (a close
    // makes the task drop what it has not written to its client yet).
    return c.shut && c.gateway_ended && c.acked == c.sent;
}

void EgressTunnel::end(Connection& c) {
    // Both ways are done: the connection is over for both sides.
    send({protocol::kTunnelClose, c.id});
    drop(c.id);
}

void EgressTunnel::rewatch(Connection& c) {
    const bool can_read = !c.gateway_ended && c.sent - c.acked < kWindow;
    const bool can_write = !c.to_gateway.empty();
    if (!can_read && !can_write) {
        // Nothing to do until the task acknowledges or sends: not watched,
        // so that a gateway socket that hung up cannot wake the loop in vain.
        if (c.watch) loop_.unwatch(std::exchange(c.watch, 0));
        return;
    }
    if (!c.watch) {
        c.watch = loop_.watch_fd(c.gateway.get(), [this, id = c.id] {
            const auto it = connections_.find(id);
            if (it != connections_.end()) on_gateway(*it->second);
        });
    }
    loop_.want(c.watch, can_read, can_write);
}

void EgressTunnel::fail(Connection& c, const char* why, bool task_broke_protocol) {
    std::uint64_t& count = task_broke_protocol ? counts_.protocol_errors : counts_.gateway_failures;
    if (++count == 1) {
        spdlog::warn("session {}: egress tunnel: connection {} closed: {} (later ones counted)",
                     settings_.session_id, c.id, why);
    }
    send({protocol::kTunnelClose, c.id});
    drop(c.id);
}

void EgressTunnel::drop(std::string_view id) {
    const auto it = connections_.find(id);
    if (it == connections_.end()) return;
    if (it->second->watch) loop_.unwatch(it->second->watch);
    connections_.erase(it);
    counts_.open_now = connections_.size();
}

}  // namespace cellblock
