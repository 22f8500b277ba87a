#include "event_loop.hpp"

#include <algorithm>

namespace cellblock {

EventLoop::WatchId EventLoop::watch(zmq::socket_t& socket, Handler on_readable) {
    const WatchId id = next_id_++;
    watches_.push_back({id, socket.handle(), -1, std::move(on_readable)});
    items_stale_ = true;
    return id;
}

EventLoop::WatchId EventLoop::watch_fd(int fd, Handler on_ready) {
    const WatchId id = next_id_++;
    watches_.push_back({id, nullptr, fd, std::move(on_ready)});
    items_stale_ = true;
    return id;
}

void EventLoop::unwatch(WatchId id) {
    for (auto& w : watches_) {
        if (w.id == id) {
            w.removed = true;
            items_stale_ = true;
        }
    }
    if (!in_turn_) compact();
}

EventLoop::WatchId EventLoop::add_deadline(std::function<std::optional<Clock::time_point>()> next,
                                           std::function<void(Clock::time_point)> on_time) {
    const WatchId id = next_id_++;
    deadlines_.push_back({id, std::move(next), std::move(on_time)});
    return id;
}

void EventLoop::remove_deadline(WatchId id) {
    for (auto& d : deadlines_) {
        if (d.id == id) d.removed = true;
    }
    if (!in_turn_) compact();
}

std::size_t EventLoop::watched() const {
    return static_cast<std::size_t>(
        std::count_if(watches_.begin(), watches_.end(), [](const Watch& w) { return !w.removed; }));
}

void EventLoop::compact() {
    std::erase_if(watches_, [](const Watch& w) { return w.removed; });
    std::erase_if(deadlines_, [](const Deadline& d) { return d.removed; });
}

void EventLoop::run_once(std::optional<std::chrono::milliseconds> max_wait) {
    if (items_stale_) {
        items_.clear();
        items_.reserve(watches_.size());
        for (const auto& w : watches_) {
            items_.push_back({w.socket, w.socket ? 0 : w.fd, ZMQ_POLLIN, 0});
        }
        items_stale_ = false;
    }
    std::optional<Clock::time_point> next;
    for (const auto& d : deadlines_) {
        if (auto t = d.next(); t && (!next || *t < *next)) next = t;
    }
    long timeout_ms = max_wait ? static_cast<long>(max_wait->count()) : -1;
    if (next) {
        // +1: poll's millisecond rounds down, and waking a moment early
        // would spin a turn for nothing.
        const long until = std::max<long>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now()).count() +
                   1);
        timeout_ms = timeout_ms < 0 ? until : std::min(timeout_ms, until);
    }
    for (auto& item : items_) item.revents = 0;
    zmq::poll(items_.data(), items_.size(), std::chrono::milliseconds(timeout_ms));

    in_turn_ = true;
    // Handlers may watch (appended, seen next turn) or unwatch (skipped from
    // here on): index by the items built for this turn.
    const std::size_t count = items_.size();
    for (std::size_t i = 0; i < count; ++i) {
        const short mask = watches_[i].socket ? ZMQ_POLLIN : (ZMQ_POLLIN | ZMQ_POLLERR);
        if (!(items_[i].revents & mask) || watches_[i].removed) continue;
        // Copy: the handler may add watches, which can move watches_.
        const Handler handler = watches_[i].handler;
        handler();
    }
    const auto now = Clock::now();
    for (std::size_t i = 0; i < deadlines_.size(); ++i) {
        if (deadlines_[i].removed) continue;
        const auto t = deadlines_[i].next();
        if (t && *t <= now) {
            const auto on_time = deadlines_[i].on_time;
            on_time(now);
        }
    }
    in_turn_ = false;
    compact();
}

void EventLoop::run() {
    stopped_ = false;
    while (!stopped_) run_once();
}

}  // namespace cellblock
