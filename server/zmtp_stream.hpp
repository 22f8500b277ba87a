// One ZMTP connection on a stream socket, read and written by the thread
// that holds it, without blocking: the I/O half of the relay's ZMTP
// transport (the protocol is zmtp::Connection's). The kernel's connections
// (kernel_socket.cpp) and each client's (client_socket.cpp) are one each.
#pragma once

#include <poll.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/frame.hpp"
#include "cellblock/unique_fd.hpp"
#include "cellblock/zmtp.hpp"
#include "event_loop.hpp"

namespace cellblock {

class ZmtpStream {
  public:
    // Writes the greeting at once. Reading pauses while 1000 decoded
    // messages or `max_inbox_bytes` wait for the relay; the peer's own queue
    // (its high-water mark, in its memory) takes the rest.
    ZmtpStream(UniqueFd fd, zmtp::Connection connection, std::string label,
               std::size_t max_inbox_bytes = 32 << 20);
    ~ZmtpStream() { close(); }
    ZmtpStream(const ZmtpStream&) = delete;
    ZmtpStream& operator=(const ZmtpStream&) = delete;

    // Queues one message and writes what the socket takes; false: dropped
    // (the connection is gone, or more than `max_backlog` bytes wait).
    bool send(const std::vector<std::string_view>& frames, std::size_t max_backlog);
    bool send(const std::vector<Frame>& frames, std::size_t max_backlog);
    // Moves one decoded message into `out` (reading first if none is
    // decoded), with `prefix` (a ROUTER's sender identity) as its first frame
    // if given.
    bool receive(Multipart& out, std::size_t max_frames, const std::string* prefix = nullptr);
    // Writes what is queued and reads what has arrived, without blocking.
    void pump();

    pollfd poll_item() const;
    // Calls `on_ready` on `loop` after each pump the fd caused, and while
    // decoded messages wait; flushes on writability by itself.
    void watch(EventLoop& loop, EventLoop::Handler on_ready);
    void stop_watching();
    void close();
    // Tells the peer that nothing more comes (a FIN) and writes nothing
    // more: what it sent before it saw that is still read, and its own
    // close then ends the connection (broken()).
    void shutdown_write();
    // Called with the codec's reason when a message over its caps was read
    // past and dropped (default: one warning line naming the connection).
    void on_skipped(std::function<void(const char* why)> handler) {
        on_skipped_ = std::move(handler);
    }

    bool is_open() const { return static_cast<bool>(fd_); }
    // Output queued for a peer still connected.
    bool unsent() const { return fd_ && !broken_ && !write_shut_ && !zmtp_.output().empty(); }
    // The peer left or broke the protocol: nothing more is read or written.
    bool broken() const { return broken_; }
    zmtp::Connection& zmtp() { return zmtp_; }
    const std::string& label() const { return label_; }

  private:
    void flush();
    void set_writable(bool writable);
    void broke(const std::string& why);

    UniqueFd fd_;
    zmtp::Connection zmtp_;
    std::string label_;
    std::size_t max_inbox_bytes_;
    bool broken_ = false;
    bool write_shut_ = false;
    EventLoop* loop_ = nullptr;
    std::optional<EventLoop::WatchId> watch_;
    bool writable_ = false;
    std::function<void(const char*)> on_skipped_;
};

}  // namespace cellblock
