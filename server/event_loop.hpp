// The one poll loop of both modes (`serve` and `cellblock kernel`): ZMQ
// sockets and file descriptors, each watched with its own handler, and
// deadline sources asked each turn when they next need the clock. A
// participant registers what it owns and unregisters it before closing it;
// nobody finds a poll item by its index.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <zmq.hpp>

namespace cellblock {

class EventLoop {
  public:
    using Clock = std::chrono::steady_clock;
    using Handler = std::function<void()>;
    using WatchId = std::uint64_t;

    // Calls `on_readable` when the socket has a message waiting. Handlers run
    // in registration order within a turn (a session registers its kernel's
    // sockets before its lifeline, so a kernel's last replies are read before
    // its exit is seen).
    WatchId watch(zmq::socket_t& socket, Handler on_readable);
    // Calls `on_ready` when `fd` is readable or in error.
    WatchId watch_fd(int fd, Handler on_ready);
    // Safe from inside any handler: a watch removed during a turn is not
    // called later in that turn, so its socket may be closed right after.
    void unwatch(WatchId id);

    // `next` says when `on_time` must next run (nullopt: no need); it is
    // asked before every wait. `on_time` runs after each turn's handlers
    // once its time has come, with the time the turn ended.
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

    std::size_t watched() const;

  private:
    struct Watch {
        WatchId id;
        void* socket;  // nullptr: an fd
        int fd;
        Handler handler;
        bool removed = false;
    };
    struct Deadline {
        WatchId id;
        std::function<std::optional<Clock::time_point>()> next;
        std::function<void(Clock::time_point)> on_time;
        bool removed = false;
    };
    void compact();

    std::vector<Watch> watches_;
    std::vector<Deadline> deadlines_;
    std::vector<zmq::pollitem_t> items_;
    bool items_stale_ = true;
    WatchId next_id_ = 1;
    bool stopped_ = false;
    bool in_turn_ = false;
};

}  // namespace cellblock
