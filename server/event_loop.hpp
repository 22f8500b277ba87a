// The one poll loop of both modes (`serve` and `cellblock kernel`): ZMQ
// sockets and file descriptors, each watched with its own handler, and
// deadline sources asked each turn when they next need the clock. A
// participant registers what it owns and unregisters it before closing it;
// nobody finds a poll item by its index.
//
// Built on epoll, so a turn costs what is ready, not what is watched:
// zmq_poll() looks at every socket on every call (about 1.2 µs each here;
// 100 sessions are 1000 sockets, 1.2 ms a turn, which capped throughput at
// about 200 executions a second). A ZMQ socket is watched through its
// ZMQ_FD, which only says "look at ZMQ_EVENTS": any call on the socket, a
// send too, may consume that signal while a message waits. So every socket
// the thread received on or sent to during a turn (multipart.cpp reports
// them, note_touched()) has its ZMQ_EVENTS read again before the next wait,
// and one still readable is handled again without waiting.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include <zmq.hpp>

#include "cellblock/unique_fd.hpp"

namespace cellblock {

class EventLoop {
  public:
    using Clock = std::chrono::steady_clock;
    using Handler = std::function<void()>;
    using WatchId = std::uint64_t;

    // The thread's loop while it exists (one per thread).
    EventLoop();
    ~EventLoop();
    EventLoop(const EventLoop&) = delete;
    EventLoop& operator=(const EventLoop&) = delete;

    // Calls `on_readable` when the socket has a message waiting; the handler
    // need not drain it (it is called again while one waits). Handlers run in
    // registration order within a turn (a session registers its kernel's
    // sockets before its lifeline, so a kernel's last replies are read before
    // its exit is seen).
    WatchId watch(zmq::socket_t& socket, Handler on_readable);
    // Calls `on_ready` while `fd` is readable or in error, and (given
    // `pending`, for a source that buffers in user space, such as a ZMTP
    // connection) while pending() says whole messages wait already.
    WatchId watch_fd(int fd, Handler on_ready, std::function<bool()> pending = {});
    // Also calls the fd's handler while it is writable (a transport with
    // bytes left to write), or no longer.
    void want_writable(WatchId id, bool writable);
    // Both at once: a stream that must stop reading while its peer has no
    // room (an error or hang-up still calls the handler).
    void want(WatchId id, bool readable, bool writable);
    // Call before closing what is watched. Safe from inside any handler: a
    // watch removed during a turn is not called later in that turn.
    void unwatch(WatchId id);

    // `next` says when `on_time` must next run (nullopt: no need); it is
    // asked before every wait and after every turn's handlers. `on_time`
    // runs once its time has come, with the time the turn's handlers ended.
    WatchId add_deadline(std::function<std::optional<Clock::time_point>()> next,
                         std::function<void(Clock::time_point)> on_time);
    void remove_deadline(WatchId id);

    // Waits for one turn (at most `max_wait`, or until the earliest deadline)
    // and runs what is ready.
    void run_once(std::optional<std::chrono::milliseconds> max_wait = std::nullopt);
    // Turns until stop() is called (from a handler).
    void run();
    void stop() { stopped_ = true; }
    bool stopped() const { return stopped_; }

    std::size_t watched() const { return watches_.size(); }

    // A ZMQ call on `socket_handle` from this thread: its readiness must be
    // read again (multipart.cpp calls this on every send and receive). A
    // no-op on a thread without a loop.
    static void note_touched(void* socket_handle);

  private:
    struct Watch {
        void* socket;  // nullptr: an fd
        int fd;
        Handler handler;
        std::function<bool()> pending;
    };
    struct Deadline {
        std::function<std::optional<Clock::time_point>()> next;
        std::function<void(Clock::time_point)> on_time;
    };
    bool socket_readable(void* socket) const;
    void recheck_touched();
    void run_deadlines();

    UniqueFd epoll_;
    // Ordered by id, which is registration order.
    std::map<WatchId, Watch> watches_;
    std::unordered_map<void*, WatchId> by_socket_;
    std::map<WatchId, Deadline> deadlines_;
    std::vector<WatchId> ready_;  // handle next turn without waiting
    std::vector<void*> touched_;  // sockets used since their last check
    WatchId next_id_ = 1;
    bool stopped_ = false;
};

}  // namespace cellblock
