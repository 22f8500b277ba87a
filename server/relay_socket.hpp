// A socket of the relay, on either side of a session: towards the kernel
// (DEALER, SUB: kernel_socket.hpp) or towards clients (ROUTER, PUB:
// client_socket.hpp), in one of two transports behind one interface:
// - libzmq (RelayTransport::libzmq): every message crosses libzmq's I/O
//   thread on its way to or from the server's thread;
// - ZMTP in the server's own loop (RelayTransport::zmtp): stream sockets
//   spoken by zmtp::Connection, read and written by the thread that relays,
//   so a message costs no thread hand-off.
// The peers (kernels, jupyter_client) are libzmq either way.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

#include "cellblock/frame.hpp"
#include "event_loop.hpp"

namespace cellblock {

enum class RelayTransport { libzmq, zmtp };
const char* relay_transport_name(RelayTransport transport);

class RelaySocket {
  public:
    virtual ~RelaySocket() = default;
    // Sends one message without blocking; false: dropped (no such peer, the
    // connection is gone, or the peer is not reading and its queue is full;
    // libzmq's ROUTER drops a message to an unknown peer and still says true).
    // A ROUTER's first frame names the peer; a PUB's first frame is the
    // topic its subscribers' prefixes are matched against.
    virtual bool send(std::vector<Frame>& frames) = 0;
    // Receives one whole message if one waits (a ROUTER's begins with the
    // sender's identity); frames past `max_frames` are not kept
    // (out.dropped_frames counts them).
    virtual bool receive(Multipart& out, std::size_t max_frames) = 0;
    // Reads what has arrived from every peer into decoded messages now,
    // without waiting for the loop (a handover takes every request already
    // on the host before the socket closes, docs/restarts.md). libzmq's I/O
    // thread does this by itself.
    virtual void read_waiting() {}
    // What poll() should wait for while no loop watches it (the probe).
    // Receive until nothing waits before waiting on it.
    virtual pollfd poll_item() = 0;
    // Calls `on_readable` on `loop`'s thread while a message waits.
    virtual void watch(EventLoop& loop, EventLoop::Handler on_readable) = 0;
    // Stops watching and closes; safe from inside its own handler. Sends
    // and receives do nothing afterwards.
    virtual void close() = 0;
    virtual bool is_open() const = 0;
    // Bytes queued in user space for a peer still connected (the ZMTP
    // transport; libzmq's queues drain on its own thread and linger at close):
    // a server that stops turns its loop until none are left, or a bound.
    virtual bool unsent() const = 0;
    // A planned restart that leaves the session running (docs/restarts.md):
    // no new connections, and each client's connection half-closed, so
    // that it sees the server go and what it sent before is still read.
    // Then peers_sending() is false once every client has closed its end.
    // libzmq's transport cannot: a no-op, and false.
    virtual void half_close() {}
    virtual bool peers_sending() const { return false; }
    // A PUB with no subscriber yet keeps what it is asked to send, up to a
    // bound, for its first subscriber, for at most `for_at_most`: an adopted
    // session's clients subscribe again some time after the port is bound,
    // and what the kernel published meanwhile reaches them (docs/restarts.md).
    // What is past the bound, or waited longer, is dropped and logged.
    // libzmq's PUB cannot: a no-op (it drops what no one subscribed to).
    virtual void hold_until_subscribed(std::chrono::milliseconds /*for_at_most*/) {}
    // A PUB's clients with a subscription; unknown (libzmq keeps it to itself).
    virtual std::optional<std::size_t> subscribers() const { return std::nullopt; }
    // A ROUTER's: whether a client with this identity is connected; unknown
    // with libzmq.
    virtual std::optional<bool> has_peer(const std::string& /*identity*/) const {
        return std::nullopt;
    }
};

// A libzmq socket, already configured and connected or bound.
std::unique_ptr<RelaySocket> make_zmq_relay_socket(zmq::socket_t socket);

}  // namespace cellblock
