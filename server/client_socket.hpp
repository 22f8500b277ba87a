// The sockets a session's clients connect to: ROUTER (shell, control, stdin,
// heartbeat) and PUB (iopub), bound on the session's outer connection, in
// either transport (relay_socket.hpp). With ZMTP, the relay's own thread
// accepts each client's connection and speaks to it; a ROUTER routes by the
// Identity a client announces (or one it makes up, five bytes starting with
// 0, as libzmq does), and a client that reconnects with an identity in use
// takes it over (libzmq's ZMQ_ROUTER_HANDOVER); a PUB sends each message to
// the clients whose subscriptions are a prefix of its first frame.
#pragma once

#include <memory>
#include <string>

#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "relay_socket.hpp"

namespace cellblock {

struct ClientSocketOptions {
    RelayTransport transport = RelayTransport::zmtp;
    int max_frame_bytes = 16 << 20;
    std::size_t max_frames = 4096;
    int linger_ms = 1000;  // libzmq only
    std::string label;     // names it in log lines
};

struct BoundSocket {
    std::unique_ptr<RelaySocket> socket;
    int port = 0;  // the port bound (a free one if `info` asked for 0)
};

// Binds `channel` of `info` as a ROUTER (`pub` false) or a PUB. A port of 0
// binds a free port (tcp only). ZMTP needs a numeric address or ipc; any
// other address (a host name) is bound through libzmq. Throws
// std::runtime_error (zmq::error_t for libzmq) naming why.
BoundSocket bind_client_socket(zmq::context_t& context, bool pub, const ConnectionInfo& info,
                               Channel channel, const ClientSocketOptions& options);

}  // namespace cellblock
