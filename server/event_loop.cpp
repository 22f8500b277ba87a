#include "event_loop.hpp"

#include <sys/epoll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cellblock {

namespace {

thread_local EventLoop* thread_loop = nullptr;

void epoll_add(int epoll, int fd, EventLoop::WatchId id) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
        throw std::runtime_error(std::string("event loop: epoll_ctl ADD: ") + std::strerror(errno));
    }
}

}  // namespace

EventLoop::EventLoop() : epoll_(::epoll_create1(EPOLL_CLOEXEC)) {
    if (!epoll_) {
        throw std::runtime_error(std::string("event loop: epoll_create1: ") + std::strerror(errno));
    }
    if (!thread_loop) thread_loop = this;
}

EventLoop::~EventLoop() {
    if (thread_loop == this) thread_loop = nullptr;
}

void EventLoop::note_touched(void* socket_handle) {
    if (thread_loop) thread_loop->touched_.push_back(socket_handle);
}

EventLoop::WatchId EventLoop::watch(zmq::socket_t& socket, Handler on_readable) {
    const WatchId id = next_id_++;
    const int fd = socket.get(zmq::sockopt::fd);
    epoll_add(epoll_.get(), fd, id);
    watches_.emplace(id, Watch{socket.handle(), fd, std::move(on_readable), {}});
    by_socket_[socket.handle()] = id;
    // Messages may be waiting already (a probe's sockets, handed over).
    ready_.push_back(id);
    return id;
}

EventLoop::WatchId EventLoop::watch_fd(int fd, Handler on_ready, std::function<bool()> pending) {
    const WatchId id = next_id_++;
    epoll_add(epoll_.get(), fd, id);
    // Messages may be buffered already (a probe's connections, handed over).
    if (pending && pending()) ready_.push_back(id);
    watches_.emplace(id, Watch{nullptr, fd, std::move(on_ready), std::move(pending)});
    return id;
}

void EventLoop::want_writable(WatchId id, bool writable) { want(id, true, writable); }

void EventLoop::want(WatchId id, bool readable, bool writable) {
    auto it = watches_.find(id);
    if (it == watches_.end()) return;
    epoll_event ev{};
    ev.events = (readable ? EPOLLIN : 0u) | (writable ? EPOLLOUT : 0u);
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, it->second.fd, &ev) != 0) {
        throw std::runtime_error(std::string("event loop: epoll_ctl MOD: ") + std::strerror(errno));
    }
}

void EventLoop::unwatch(WatchId id) {
    auto it = watches_.find(id);
    if (it == watches_.end()) return;
    // The descriptor is still open: callers unwatch before they close.
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.fd, nullptr);
    if (it->second.socket) by_socket_.erase(it->second.socket);
    watches_.erase(it);
}

EventLoop::WatchId EventLoop::add_deadline(std::function<std::optional<Clock::time_point>()> next,
                                           std::function<void(Clock::time_point)> on_time) {
    const WatchId id = next_id_++;
    deadlines_.emplace(id, Deadline{std::move(next), std::move(on_time)});
    return id;
}

void EventLoop::remove_deadline(WatchId id) { deadlines_.erase(id); }

bool EventLoop::socket_readable(void* socket) const {
    int events = 0;
    std::size_t size = sizeof events;
    if (zmq_getsockopt(socket, ZMQ_EVENTS, &events, &size) != 0) return false;
    return (events & ZMQ_POLLIN) != 0;
}

void EventLoop::recheck_touched() {
    std::vector<void*> touched;
    touched.swap(touched_);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (void* socket : touched) {
        auto it = by_socket_.find(socket);
        if (it != by_socket_.end() && socket_readable(socket)) ready_.push_back(it->second);
    }
}

void EventLoop::run_deadlines() {
    // A deadline may add or remove deadlines: walk ids, not iterators.
    std::vector<WatchId> ids;
    ids.reserve(deadlines_.size());
    for (const auto& [id, d] : deadlines_) ids.push_back(id);
    for (WatchId id : ids) {
        auto it = deadlines_.find(id);
        if (it == deadlines_.end()) continue;
        const auto t = it->second.next();
        // The clock is read after next(): a source may answer "now" from its
        // own reading, which must count as due.
        const auto now = Clock::now();
        if (!t || *t > now) continue;
        const auto on_time = it->second.on_time;  // it may remove itself
        on_time(now);
    }
}

void EventLoop::run_once(std::optional<std::chrono::milliseconds> max_wait) {
    recheck_touched();
    long timeout_ms = max_wait ? static_cast<long>(max_wait->count()) : -1;
    if (!ready_.empty()) {
        timeout_ms = 0;
    } else {
        std::optional<Clock::time_point> next;
        for (const auto& [id, d] : deadlines_) {
            if (auto t = d.next(); t && (!next || *t < *next)) next = t;
        }
        if (next) {
            // +1: the wait's millisecond rounds down, and waking a moment
            // early would spin a turn for nothing.
            const long until = std::max<long>(
                0, std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now())
                           .count() +
                       1);
            timeout_ms = timeout_ms < 0 ? until : std::min(timeout_ms, until);
        }
    }
    constexpr int kMaxEvents = 256;
    epoll_event events[kMaxEvents];
    int n = ::epoll_wait(epoll_.get(), events, kMaxEvents, static_cast<int>(timeout_ms));
    if (n < 0) n = 0;  // EINTR: a turn with nothing ready
    std::vector<WatchId> candidates;
    candidates.swap(ready_);
    for (int i = 0; i < n; ++i) candidates.push_back(events[i].data.u64);
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());

    for (WatchId id : candidates) {
        auto it = watches_.find(id);
        if (it == watches_.end()) continue;  // unwatched earlier in this turn
        if (it->second.socket && !socket_readable(it->second.socket)) continue;
        // Copy: the handler may unwatch itself or add watches.
        const Handler handler = it->second.handler;
        handler();
        // Receiving consumed the socket's signal: read its readiness again.
        if (auto again = watches_.find(id); again != watches_.end()) {
            if (again->second.socket) touched_.push_back(again->second.socket);
            if (again->second.pending && again->second.pending()) ready_.push_back(id);
        }
    }
    run_deadlines();
}

void EventLoop::run() {
    stopped_ = false;
    while (!stopped_) run_once();
}

}  // namespace cellblock
