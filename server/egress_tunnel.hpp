// The front's end of a Swarm task's egress tunnel (docs/scale-out.md,
// "Egress"). A Swarm session's code reaches the egress gateway as a runc
// session's does (HTTP_PROXY, the shim's forwarder), but the gateway runs
// here, beside the server, and the task is on another machine: the kernel
// carries each of the forwarder's connections over one CurveZMQ channel
// (kernel-shim/cellblock_egress_tunnel.py), and this class connects it to
// the gateway's socket for the session, one unix connection per tunnel
// connection. The allowlist, the refusal of private ranges, the secrets and
// the audit stay the gateway's, on this machine; nothing of them reaches a
// node.
//
// The protocol's words and bounds are in sandbox_protocol.hpp (shared with
// the kernel's side). Everything the task sends is untrusted: a message that
// breaks the protocol closes that connection (the task is told), counts, and
// is logged once per tunnel; at most kTunnelMaxConnections are open and at
// most kTunnelWindowBytes wait unacknowledged per connection each way, so
// what the front holds for a session is bounded whatever the task does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <zmq.hpp>

#include "cellblock/unique_fd.hpp"
#include "event_loop.hpp"

namespace cellblock {

struct EgressTunnelSettings {
    std::string session_id;                // for log lines
    std::string endpoint;                  // tcp://HOST:PORT, the task's published tunnel port
    std::string server_key;                // the kernel's CurveZMQ public key (Z85)
    std::filesystem::path gateway_socket;  // the gateway's listener for this session
    std::string trust_store;               // what the task's code trusts (sent with hello)
    // The kernel's message key (its connection's "key"): hello is signed
    // with it, so that only the server becomes the task's front (CURVE with
    // no check of client keys admits anyone who has the kernel's public key).
    std::string signing_key;
};

class EgressTunnel {
  public:
    // Connects (ZMQ connects in the background) and says hello. Throws
    // std::runtime_error when libzmq has no CurveZMQ.
    EgressTunnel(EventLoop& loop, zmq::context_t& context, EgressTunnelSettings settings);
    ~EgressTunnel();
    EgressTunnel(const EgressTunnel&) = delete;
    EgressTunnel& operator=(const EgressTunnel&) = delete;

    // What the tunnel has done, for session_info and the tests.
    struct Counts {
        bool greeted = false;  // the task answered hello
        std::uint64_t opened = 0, refused = 0, open_now = 0;
        std::uint64_t bytes_out = 0, bytes_in = 0;  // to the gateway, to the task
        std::uint64_t protocol_errors = 0;          // connections closed for the task's fault
        std::uint64_t gateway_failures = 0;         // for the gateway side's
        std::uint64_t send_failures = 0;
        std::uint64_t reconnects = 0;  // the channel broke and was made again
    };
    const Counts& counts() const { return counts_; }

  private:
    struct Connection;
    void say_hello();
    // The channel's connection events (a libzmq socket monitor): a
    // connection made again after a break is a new peer to the task, which
    // has dropped every connection of the old; so does the front, and says
    // hello again.
    void on_monitor();
    void on_tunnel();
    void handle(std::string_view verb, std::string_view id, std::optional<std::string_view> third,
                std::optional<std::string_view> fourth);
    void open(std::string_view id);
    void on_data(Connection& c, std::string_view offset, std::string_view bytes);
    void on_ack(Connection& c, std::string_view total);
    void on_gateway(Connection& c);
    void read_gateway(Connection& c);
    void write_gateway(Connection& c);
    // Watches what the connection can do now: reading while its window has
    // room and the gateway has not ended, writing while bytes wait.
    void rewatch(Connection& c);
    // A connection the task broke the protocol on, or whose gateway side
    // failed: the task is told (close), the gateway's socket closed.
    void fail(Connection& c, const char* why, bool task_broke_protocol);
    // Both ways done (done()): the task is told (close) and the connection
    // forgotten.
    static bool done(const Connection& c);
    void end(Connection& c);
    void drop(std::string_view id);
    void send(std::initializer_list<std::string_view> frames);

    EventLoop& loop_;
    EgressTunnelSettings settings_;
    zmq::socket_t socket_;
    zmq::socket_t monitor_;
    EventLoop::WatchId watch_ = 0, monitor_watch_ = 0;
    int handshakes_ = 0;
    std::map<std::string, std::unique_ptr<Connection>, std::less<>> connections_;
    Counts counts_;
};

}  // namespace cellblock
