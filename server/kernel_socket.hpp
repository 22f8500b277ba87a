// One of the server's five connections to a sandboxed kernel, in one of two
// transports behind one interface:
// - libzmq (KernelTransport::libzmq): a DEALER or SUB socket; every message
//   crosses libzmq's I/O thread on its way to or from the server's thread;
// - ZMTP in the server's own loop (KernelTransport::zmtp): a unix stream
//   socket to the kernel's ipc endpoint, spoken by zmtp::Connection, read and
//   written by the thread that relays, so a message costs no thread hand-off.
// The kernel's side is libzmq either way.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "cellblock/unique_fd.hpp"
#include "cellblock/zmtp.hpp"
#include "event_loop.hpp"
#include "multipart.hpp"

namespace cellblock {

enum class KernelTransport { libzmq, zmtp };
// "libzmq" or "zmtp"; nullopt for anything else.
std::optional<KernelTransport> parse_kernel_transport(std::string_view name);
const char* kernel_transport_name(KernelTransport transport);

class KernelSocket {
  public:
    virtual ~KernelSocket() = default;
    // Sends one message without blocking; false: dropped (the connection is
    // gone, or the kernel is not reading and the queue is full).
    virtual bool send(std::vector<zmq::message_t>& frames) = 0;
    // Receives one whole message if one waits; frames past `max_frames` are
    // not kept (out.dropped_frames counts them).
    virtual bool receive(Multipart& out, std::size_t max_frames) = 0;
    // What poll() should wait for while no loop watches it (the probe).
    // Receive until nothing waits before waiting on it.
    virtual pollfd poll_item() = 0;
    // Calls `on_readable` on `loop`'s thread while a message waits.
    virtual void watch(EventLoop& loop, EventLoop::Handler on_readable) = 0;
    // Stops watching and closes; safe from inside its own handler. Sends
    // and receives do nothing afterwards.
    virtual void close() = 0;
    virtual bool is_open() const = 0;
};

// A libzmq socket, already configured and connected.
std::unique_ptr<KernelSocket> make_zmq_kernel_socket(zmq::socket_t socket);

// A unix stream connection to `path`, speaking ZMTP as `socket_type`
// ("DEALER" or "SUB"; a SUB subscribes to everything). Retries a refused or
// full listener until `deadline`; throws std::runtime_error naming why.
// `label` names the connection in log lines ("session X kernel shell").
std::unique_ptr<KernelSocket> connect_zmtp_kernel_socket(const std::string& path,
                                                         const std::string& socket_type,
                                                         const std::string& identity,
                                                         zmtp::Limits limits, std::string label,
                                                         std::chrono::steady_clock::time_point deadline);

}  // namespace cellblock
