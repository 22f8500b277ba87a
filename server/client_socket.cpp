#include "client_socket.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "cellblock/unique_fd.hpp"
#include "multipart.hpp"
#include "unix_address.hpp"
#include "zmtp_stream.hpp"

namespace cellblock {

namespace {

// A client that does not read (its iopub, say) is not queued for without
// end: past this, messages to it are dropped, as libzmq's high-water mark
// drops them for the other transport.
constexpr std::size_t kMaxBacklogBytes = 64 << 20;
// Connections one channel keeps at once; more are accepted and closed.
// Each may hold a partial message up to its caps, so this bounds what
// processes on this host without the key can make the server hold.
constexpr std::size_t kMaxPeers = 256;
// A connection that has not finished its greeting and READY by then is
// closed (libzmq's ZMQ_HANDSHAKE_IVL default), so idle connections cannot
// hold the slots above.
constexpr std::chrono::seconds kHandshakeTimeout{30};
// What a PUB keeps at most for its first subscriber (hold_until_subscribed).
constexpr std::size_t kMaxHeldBytes = 8 << 20;

class ZmtpListener final : public RelaySocket {
  public:
    ZmtpListener(UniqueFd listen_fd, bool pub, bool tcp, std::string unix_path, zmtp::Limits limits,
                 std::string label)
        : listen_(std::move(listen_fd)),
          pub_(pub),
          tcp_(tcp),
          unix_path_(std::move(unix_path)),
          limits_(limits),
          label_(std::move(label)),
          next_identity_(std::random_device{}()) {}
    ~ZmtpListener() override { close(); }

    bool send(std::vector<Frame>& frames) override {
        if (closed_ || frames.empty()) return false;
        std::vector<std::string_view> views;
        views.reserve(frames.size());
        for (const auto& f : frames) views.push_back(f.view());
        if (!pub_) {
            auto it = by_identity_.find(std::string(views[0]));
            if (it == by_identity_.end()) return false;  // no such client (any more)
            views.erase(views.begin());
            return it->second->stream.send(views, kMaxBacklogBytes);
        }
        if (hold_ && !hold_ended_by_time()) {
            keep_for_first_subscriber(views);  // no one subscribed yet
            return true;
        }
        const std::string_view topic = views[0];
        for (auto& [id, peer] : peers_) {
            if (!peer->registered || !peer->subscribed(topic)) continue;
            const bool sent = peer->stream.send(views, kMaxBacklogBytes);
            if (!sent && !peer->dropping) {
                spdlog::warn("{}: client {} is not reading; dropping its messages", label_, id);
            }
            peer->dropping = !sent;
        }
        return true;
    }

    bool receive(Multipart& out, std::size_t max_frames) override {
        if (closed_ || pub_ || peers_.empty()) return false;
        // Round robin from the peer after the last one served.
        auto it = peers_.lower_bound(next_turn_);
        for (std::size_t n = 0; n < peers_.size(); ++n, ++it) {
            if (it == peers_.end()) it = peers_.begin();
            Peer& peer = *it->second;
            if (!peer.registered || !peer.stream.zmtp().has_message()) continue;
            next_turn_ = it->first + 1;
            return peer.stream.receive(out, max_frames, &peer.identity);
        }
        return false;
    }

    void read_waiting() override {
        if (closed_ || pub_) return;
        for (auto& [id, peer] : peers_) {
            peer->stream.pump();
            if (!peer->registered && peer->stream.zmtp().ready()) register_peer(*peer);
        }
    }

    pollfd poll_item() override { return {listen_.get(), POLLIN, 0}; }

    void watch(EventLoop& loop, EventLoop::Handler on_readable) override {
        loop_ = &loop;
        on_readable_ = std::move(on_readable);
        listen_watch_ = loop.watch_fd(listen_.get(), [this] { accept_all(); });
        // Asked every turn: costs nothing while every client is past its
        // handshake (the usual case).
        handshake_deadline_ = loop.add_deadline(
            [this]() -> std::optional<EventLoop::Clock::time_point> {
                if (handshaking_ == 0) return std::nullopt;
                std::optional<EventLoop::Clock::time_point> first;
                for (const auto& [id, peer] : peers_) {
                    if (!peer->registered &&
                        (!first || peer->accepted + kHandshakeTimeout < *first))
                        first = peer->accepted + kHandshakeTimeout;
                }
                return first;
            },
            [this](EventLoop::Clock::time_point now) { drop_slow_handshakes(now); });
    }

    void close() override {
        if (closed_) return;
        closed_ = true;
        if (hold_) end_hold("the socket closed");
        stop_listening();
        if (loop_ && handshake_deadline_) loop_->remove_deadline(*handshake_deadline_);
        handshake_deadline_.reset();
        handshaking_ = 0;
        // Possibly inside one of the peers' handlers: closed now, freed with
        // the listener.
        for (auto& [id, peer] : peers_) {
            peer->stream.close();
            graveyard_.push_back(std::move(peer));
        }
        peers_.clear();
        by_identity_.clear();
    }

    void half_close() override {
        if (closed_) return;
        stop_listening();
        for (auto& [id, peer] : peers_) peer->stream.shutdown_write();
    }
    bool peers_sending() const override { return !closed_ && !peers_.empty(); }

    bool is_open() const override { return !closed_; }
    bool unsent() const override {
        return std::any_of(peers_.begin(), peers_.end(),
                           [](const auto& peer) { return peer.second->stream.unsent(); });
    }
    void hold_until_subscribed(std::chrono::milliseconds for_at_most) override {
        if (!pub_ || closed_ || subscribers().value_or(0) > 0) return;
        hold_.emplace();
        hold_->until = EventLoop::Clock::now() + for_at_most;
        hold_->for_at_most = for_at_most;
    }
    std::optional<bool> has_peer(const std::string& identity) const override {
        return by_identity_.count(identity) > 0;
    }
    std::optional<std::size_t> subscribers() const override {
        return static_cast<std::size_t>(
            std::count_if(peers_.begin(), peers_.end(), [](const auto& peer) {
                return peer.second->registered && !peer.second->subscriptions.empty();
            }));
    }

  private:
    // No new connections: the listening socket (and its path) goes.
    void stop_listening() {
        if (loop_ && listen_watch_) loop_->unwatch(*listen_watch_);
        listen_watch_.reset();
        listen_.reset();
        if (!unix_path_.empty()) ::unlink(unix_path_.c_str());
    }
    struct Peer {
        Peer(std::uint64_t id, UniqueFd fd, zmtp::Connection c, std::string label)
            : id(id), stream(std::move(fd), std::move(c), std::move(label)) {}
        bool subscribed(std::string_view topic) const {
            for (const auto& prefix : subscriptions) {
                if (topic.substr(0, prefix.size()) == prefix) return true;
            }
            return false;
        }
        std::uint64_t id;
        ZmtpStream stream;
        EventLoop::Clock::time_point accepted = EventLoop::Clock::now();
        bool registered = false;
        bool dropping = false;
        bool cut_off = false;
        std::string identity;
        std::vector<std::string> subscriptions;  // PUB: one entry per SUBSCRIBE
    };

    // What a PUB sent while no client had subscribed (hold_until_subscribed).
    struct Hold {
        EventLoop::Clock::time_point until;
        std::chrono::milliseconds for_at_most{0};
        std::vector<std::vector<std::string>> messages;
        std::size_t bytes = 0;
        std::size_t dropped = 0;
    };

    void keep_for_first_subscriber(const std::vector<std::string_view>& views) {
        std::size_t size = 0;
        for (const auto& v : views) size += v.size();
        if (hold_->bytes + size > kMaxHeldBytes) {
            ++hold_->dropped;
            return;
        }
        hold_->bytes += size;
        hold_->messages.emplace_back(views.begin(), views.end());
    }

    bool hold_ended_by_time() {
        if (EventLoop::Clock::now() < hold_->until) return false;
        end_hold("no client subscribed within " + std::to_string(hold_->for_at_most.count()) +
                 " ms");
        return true;
    }

    void end_hold(const std::string& why) {
        const std::size_t lost = hold_->messages.size() + hold_->dropped;
        if (lost > 0) {
            spdlog::warn("{}: {} messages published before any client subscribed were dropped: {}",
                         label_, lost, why);
        }
        hold_.reset();
    }

    // The first subscriber gets, in order, what was kept for it.
    void release_hold(Peer& peer) {
        if (hold_ended_by_time()) return;
        std::size_t delivered = 0;
        std::vector<std::string_view> views;
        for (const auto& message : hold_->messages) {
            if (message.empty() || !peer.subscribed(message[0])) continue;
            views.assign(message.begin(), message.end());
            if (peer.stream.send(views, kMaxBacklogBytes)) ++delivered;
        }
        if (delivered > 0 || hold_->dropped > 0) {
            spdlog::info(
                "{}: client {} subscribed: delivered the {} messages published before "
                "it ({} dropped past {} bytes)",
                label_, peer.id, delivered, hold_->dropped, kMaxHeldBytes);
        }
        hold_.reset();
    }

    void accept_all() {
        while (!closed_) {
            UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
            if (!fd) {
                if (errno == EINTR || errno == ECONNABORTED) continue;
                if (errno != EAGAIN && errno != EWOULDBLOCK) {
                    spdlog::warn("{}: accept: {}", label_, std::strerror(errno));
                }
                return;
            }
            if (peers_.size() >= kMaxPeers) {
                spdlog::warn("{}: {} clients connected already; refusing another", label_,
                             peers_.size());
                continue;
            }
            if (tcp_) {
                const int one = 1;
                ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            }
            const std::uint64_t id = next_peer_++;
            auto peer = std::make_unique<Peer>(
                id, std::move(fd), zmtp::Connection(pub_ ? "PUB" : "ROUTER", "", limits_),
                label_ + " client " + std::to_string(id));
            Peer* raw = peer.get();
            peers_.emplace(id, std::move(peer));
            ++handshaking_;
            raw->stream.on_skipped([this, raw](const char* why) {
                if (std::string_view(why) == "frame too large") {
                    // As libzmq does past ZMQ_MAXMSGSIZE: the client is cut off.
                    spdlog::warn("{}: client {} sent a frame over {} bytes; closing its connection",
                                 label_, identity_text(raw->identity), limits_.max_frame_bytes);
                    raw->cut_off = true;
                } else {
                    // Read past and dropped whole: the server held none of it.
                    spdlog::warn("{}: rejected message from {}: {}", label_,
                                 identity_text(raw->identity), why);
                }
            });
            raw->stream.watch(*loop_, [this, raw] { on_peer(raw); });
        }
    }

    void on_peer(Peer* peer) {
        if (peer->cut_off) {
            drop(peer);  // nothing it sent is relayed any more
            return;
        }
        if (!peer->registered && peer->stream.zmtp().ready()) register_peer(*peer);
        if (pub_) {
            // What a subscriber sends is its subscriptions (ZMTP 3.0 form).
            while (peer->stream.zmtp().has_message()) {
                const zmtp::Message m = peer->stream.zmtp().pop();
                if (m.frames.size() != 1 || m.dropped_frames > 0 || m.frames[0].empty()) continue;
                const std::string& f = m.frames[0];
                if (f[0] == 1) {
                    if (peer->subscriptions.size() < 1024)
                        peer->subscriptions.push_back(f.substr(1));
                } else if (f[0] == 0) {
                    auto& subs = peer->subscriptions;
                    for (auto it = subs.begin(); it != subs.end(); ++it) {
                        if (*it == std::string_view(f).substr(1)) {
                            subs.erase(it);
                            break;
                        }
                    }
                }
            }
            if (hold_ && peer->registered && !peer->subscriptions.empty()) release_hold(*peer);
        } else if (peer->stream.zmtp().has_message() && on_readable_) {
            on_readable_();
            if (closed_) return;  // the handler closed this socket: peer is in the graveyard
        }
        if (peer->cut_off || (peer->stream.broken() && !peer->stream.zmtp().has_message())) {
            drop(peer);
        }
    }

    void register_peer(Peer& peer) {
        peer.registered = true;
        --handshaking_;
        if (pub_) return;
        std::string identity = peer.stream.zmtp().peer_identity();
        if (identity.empty() || identity[0] == '\0') {
            // libzmq's form for a peer without one: a zero byte, then four.
            identity.assign(1, '\0');
            const std::uint32_t n = next_identity_++;
            for (int shift = 24; shift >= 0; shift -= 8) identity += static_cast<char>(n >> shift);
        }
        peer.identity = identity;
        auto [it, inserted] = by_identity_.emplace(identity, &peer);
        if (!inserted) {
            // Handover: the newest connection with an identity takes it.
            Peer* old = it->second;
            it->second = &peer;
            old->identity.clear();
            drop(old);
        }
    }

    void drop_slow_handshakes(EventLoop::Clock::time_point now) {
        std::vector<Peer*> slow;
        for (const auto& [id, peer] : peers_) {
            if (!peer->registered && now - peer->accepted >= kHandshakeTimeout)
                slow.push_back(peer.get());
        }
        for (Peer* peer : slow) {
            spdlog::warn("{}: client {} did not finish its ZMTP handshake in {} s; closing it",
                         label_, peer->id, kHandshakeTimeout.count());
            drop(peer);
        }
    }

    // A peer that left, was displaced or was too slow: closed and freed now.
    // Safe from its own handler (the loop called a copy of it, and nothing
    // touches the peer after this) and from another's (its watch is gone, so
    // the loop will not call it later in this turn).
    void drop(Peer* peer) {
        if (auto it = by_identity_.find(peer->identity);
            it != by_identity_.end() && it->second == peer) {
            by_identity_.erase(it);
        }
        if (!peer->registered) --handshaking_;
        peer->stream.close();
        peers_.erase(peer->id);
    }

    UniqueFd listen_;
    bool pub_, tcp_;
    std::string unix_path_;
    zmtp::Limits limits_;
    std::string label_;
    EventLoop* loop_ = nullptr;
    std::optional<EventLoop::WatchId> listen_watch_, handshake_deadline_;
    std::size_t handshaking_ = 0;  // accepted peers not yet registered
    EventLoop::Handler on_readable_;
    std::map<std::uint64_t, std::unique_ptr<Peer>> peers_;
    std::unordered_map<std::string, Peer*> by_identity_;
    std::vector<std::unique_ptr<Peer>> graveyard_;  // closed by close(), freed with the listener
    std::optional<Hold> hold_;                      // a PUB's, until its first subscriber
    std::uint64_t next_peer_ = 1, next_turn_ = 0;
    std::uint32_t next_identity_;
    bool closed_ = false;
};

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

// A listening socket on tcp ip:port (numeric ip, or * for every address);
// nullopt if `ip` is not numeric.
std::optional<std::pair<UniqueFd, int>> listen_tcp(const std::string& ip, int port) {
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (ip == "*" || ip == "0.0.0.0") {
        auto* in = reinterpret_cast<sockaddr_in*>(&addr);
        in->sin_family = AF_INET;
        in->sin_addr.s_addr = htonl(INADDR_ANY);
        in->sin_port = htons(static_cast<std::uint16_t>(port));
        len = sizeof *in;
    } else if (auto* in = reinterpret_cast<sockaddr_in*>(&addr);
               ::inet_pton(AF_INET, ip.c_str(), &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons(static_cast<std::uint16_t>(port));
        len = sizeof *in;
    } else if (auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
               ::inet_pton(AF_INET6, ip.c_str(), &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(static_cast<std::uint16_t>(port));
        len = sizeof *in6;
    } else {
        return std::nullopt;
    }
    UniqueFd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) throw std::runtime_error(errno_text("socket"));
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        throw std::runtime_error(errno_text("bind tcp://" + ip + ":" + std::to_string(port)));
    }
    if (::listen(fd.get(), 128) != 0) throw std::runtime_error(errno_text("listen"));
    len = sizeof addr;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    const int bound = addr.ss_family == AF_INET
                          ? ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port)
                          : ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    return std::make_pair(std::move(fd), bound);
}

UniqueFd listen_unix(const std::string& path) {
    const auto addr = unix_address(path);
    if (!addr) throw std::runtime_error("ipc path too long: " + path);
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) throw std::runtime_error(errno_text("socket"));
    ::unlink(path.c_str());  // a stale socket of an earlier run, as libzmq does
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0) {
        throw std::runtime_error(errno_text("bind ipc://" + path));
    }
    if (::listen(fd.get(), 128) != 0) throw std::runtime_error(errno_text("listen"));
    return fd;
}

BoundSocket bind_libzmq(zmq::context_t& context, bool pub, const ConnectionInfo& info,
                        Channel channel, const ClientSocketOptions& options) {
    zmq::socket_t s(context, pub ? zmq::socket_type::pub : zmq::socket_type::router);
    s.set(zmq::sockopt::linger, options.linger_ms);
    s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options.max_frame_bytes));
    if (!pub) s.set(zmq::sockopt::router_handover, 1);
    int port = info.port(channel);
    if (info.transport == "tcp" && port == 0) {
        s.bind("tcp://" + info.ip + ":*");
        const std::string endpoint = s.get(zmq::sockopt::last_endpoint);
        port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
    } else {
        s.bind(info.endpoint(channel));
    }
    return {make_zmq_relay_socket(std::move(s)), port};
}

}  // namespace

BoundSocket bind_client_socket(zmq::context_t& context, bool pub, const ConnectionInfo& info,
                               Channel channel, const ClientSocketOptions& options) {
    if (options.transport == RelayTransport::libzmq) {
        return bind_libzmq(context, pub, info, channel, options);
    }
    // A PUB's clients send only subscriptions: short single frames.
    const zmtp::Limits limits =
        pub ? zmtp::Limits{4096, 1, 4096}
            : zmtp::Limits{static_cast<std::size_t>(options.max_frame_bytes), options.max_frames,
                           4 * static_cast<std::size_t>(options.max_frame_bytes)};
    if (info.transport == "ipc") {
        const std::string path = info.ip + "-" + std::to_string(info.port(channel));
        return {std::make_unique<ZmtpListener>(listen_unix(path), pub, false, path, limits,
                                               options.label),
                info.port(channel)};
    }
    auto listening = listen_tcp(info.ip, info.port(channel));
    if (!listening) return bind_libzmq(context, pub, info, channel, options);
    return {std::make_unique<ZmtpListener>(std::move(listening->first), pub, true, "", limits,
                                           options.label),
            listening->second};
}

}  // namespace cellblock
