// The kernel's channels held by the shim: see channel_bridge.hpp.
#include "channel_bridge.hpp"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace cellblock::shim {

namespace {

constexpr std::size_t kReadChunk = 64 * 1024;
constexpr int kBacklog = 64;

bool unix_address(const std::string& path, sockaddr_un& addr) {
    addr = {};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) return false;
    memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    return true;
}

bool is_socket(const std::string& path) {
    struct stat st {};
    return lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

constexpr short kGone = POLLHUP | POLLERR | POLLNVAL;

}  // namespace

ChannelBridge::ChannelBridge(std::vector<Route> routes) : routes_(std::move(routes)) {}

bool ChannelBridge::listen() {
    if (listening()) return true;
    for (const auto& route : routes_) {
        if (!is_socket(route.inner)) {
            why_ = "the kernel has not bound " + route.inner + " yet";
            return false;
        }
    }
    std::vector<UniqueFd> bound;
    for (const auto& route : routes_) {
        sockaddr_un addr;
        if (!unix_address(route.outer, addr)) {
            why_ = route.outer + ": path too long";
            return false;
        }
        unlink(route.outer.c_str());  // one of ours left before a restore, or none
        UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd || bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
            ::listen(fd.get(), kBacklog) != 0) {
            why_ = "cannot listen at " + route.outer + ": " + strerror(errno);
            for (std::size_t i = 0; i < bound.size(); ++i) unlink(routes_[i].outer.c_str());
            return false;
        }
        bound.push_back(std::move(fd));
    }
    listeners_ = std::move(bound);
    why_.clear();
    return true;
}

void ChannelBridge::quiesce() {
    links_.clear();  // closes both ends of each
    if (!listening()) return;
    listeners_.clear();
    for (const auto& route : routes_) unlink(route.outer.c_str());
}

void ChannelBridge::want(std::vector<pollfd>& fds) const {
    for (const auto& listener : listeners_) fds.push_back({listener.get(), POLLIN, 0});
    for (const auto& link : links_) {
        const auto events = [](const Held& in, const Held& out) {
            short e = 0;
            if (!in.ended && in.pending() < kMaxHeld) e |= POLLIN;
            if (out.pending() > 0) e |= POLLOUT;
            return e;
        };
        fds.push_back({link.outer.get(), events(link.to_inner, link.to_outer), 0});
        fds.push_back({link.inner.get(), events(link.to_outer, link.to_inner), 0});
    }
}

void ChannelBridge::handle(const std::vector<pollfd>& fds, std::size_t first) {
    // The same order as want(): listeners, then each link's two ends. Links
    // first (accepting adds to them), then the listeners.
    const std::size_t listeners = listeners_.size();
    const std::size_t links = links_.size();
    if (fds.size() < first + listeners + 2 * links) return;  // not ours: want() was not called
    for (std::size_t i = 0; i < links; ++i) {
        Link& link = links_[i];
        const short outer = fds[first + listeners + 2 * i].revents;
        const short inner = fds[first + listeners + 2 * i + 1].revents;
        if (outer & (POLLIN | kGone)) read_into(link.outer.get(), link.to_inner);
        if (inner & (POLLIN | kGone)) read_into(link.inner.get(), link.to_outer);
        // Written whether or not poll said so: a write that would block says so itself.
        if (!flush(link.inner.get(), link.to_inner) || !flush(link.outer.get(), link.to_outer)) {
            link.broken = true;
        }
        // One side ended and what it sent is through: the pair ends (ZMTP
        // has no half-closed connections).
        if ((link.to_inner.ended && link.to_inner.pending() == 0) ||
            (link.to_outer.ended && link.to_outer.pending() == 0)) {
            link.broken = true;
        }
    }
    links_.erase(
        std::remove_if(links_.begin(), links_.end(), [](const Link& link) { return link.broken; }),
        links_.end());
    for (std::size_t r = 0; r < listeners && r < listeners_.size(); ++r) {
        if (fds[first + r].revents & POLLIN) accept_on(r);
    }
}

void ChannelBridge::accept_on(std::size_t route) {
    for (;;) {
        UniqueFd outer(
            accept4(listeners_[route].get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!outer) return;  // none left (EAGAIN), or a failed one: the next poll says
        sockaddr_un addr;
        UniqueFd inner(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        // A unix connect completes at once or fails; a kernel that cannot
        // take it (gone, or its backlog full) closes the accepted one too,
        // and the server's ZMQ connects again.
        if (!inner || !unix_address(routes_[route].inner, addr) ||
            connect(inner.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
            continue;
        }
        Link link;
        link.outer = std::move(outer);
        link.inner = std::move(inner);
        links_.push_back(std::move(link));
    }
}

void ChannelBridge::read_into(int fd, Held& held) {
    if (held.ended) return;
    // What was sent is dropped from the front once it is all, or a good part.
    if (held.sent > 0 && (held.sent == held.bytes.size() || held.sent >= 4 * kReadChunk)) {
        held.bytes.erase(0, held.sent);
        held.sent = 0;
    }
    while (held.pending() < kMaxHeld) {
        const std::size_t want = std::min(kReadChunk, kMaxHeld - held.pending());
        const std::size_t at = held.bytes.size();
        held.bytes.resize(at + want);
        const ssize_t n = recv(fd, held.bytes.data() + at, want, 0);
        held.bytes.resize(at + static_cast<std::size_t>(std::max<ssize_t>(n, 0)));
        if (n > 0) continue;
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        held.ended = true;  // the end, or an error: either way nothing more comes
        return;
    }
}

bool ChannelBridge::flush(int fd, Held& held) {
    while (held.pending() > 0) {
        const ssize_t n =
            send(fd, held.bytes.data() + held.sent, held.pending(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            held.sent += static_cast<std::size_t>(n);
            continue;
        }
        return n < 0 && (errno == EAGAIN || errno == EINTR);
    }
    held.bytes.clear();
    held.sent = 0;
    return true;
}

}  // namespace cellblock::shim
