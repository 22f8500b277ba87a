#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <thread>

#include "gateway_internal.hpp"

namespace cellblock::gateway {

namespace {

// A lookup given up on still runs to the resolver's own end: bounded, so
// that connections to names that never answer cannot pile threads up.
std::atomic<int> lookups_running{0};

std::vector<IpAddress> system_lookup(const std::string& host, std::string& why) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc != 0) {
        why = "cannot resolve " + host + ": " + ::gai_strerror(rc);
        return {};
    }
    std::vector<IpAddress> out;
    for (addrinfo* a = found; a; a = a->ai_next) {
        char text[INET6_ADDRSTRLEN] = {};
        if (a->ai_family == AF_INET) {
            ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text,
                        sizeof text);
        } else if (a->ai_family == AF_INET6) {
            ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                        sizeof text);
        } else {
            continue;
        }
        if (auto ip = IpAddress::parse(text)) {
            const bool seen = std::any_of(out.begin(), out.end(), [&](const IpAddress& o) {
                return o.family == ip->family && o.bytes == ip->bytes;
            });
            if (!seen) out.push_back(*ip);
        }
    }
    ::freeaddrinfo(found);
    if (out.empty()) why = "cannot resolve " + host + ": no IPv4 or IPv6 address";
    return out;
}

}  // namespace

int lookups_in_progress() { return lookups_running.load(); }

std::vector<IpAddress> resolve_within(const std::string& host, double timeout_s, std::string& why,
                                      bool& timed_out, Lookup lookup) {
    timed_out = false;
    if (lookups_running.fetch_add(1) >= kMaxLookups) {
        --lookups_running;
        why = "cannot resolve " + host + ": the gateway has " + std::to_string(kMaxLookups) +
              " name lookups in progress";
        return {};
    }
    struct Answer {
        std::mutex mutex;
        std::condition_variable done_cv;
        bool done = false;
        std::vector<IpAddress> addresses;
        std::string why;
    };
    auto answer = std::make_shared<Answer>();
    // The thread keeps the answer alive: a late one lands there, unread.
    try {
        std::thread([answer, lookup = std::move(lookup)] {
            std::string failure;
            std::vector<IpAddress> found = lookup(failure);
            {
                std::lock_guard lock(answer->mutex);
                answer->addresses = std::move(found);
                answer->why = std::move(failure);
                answer->done = true;
                answer->done_cv.notify_all();
            }
            --lookups_running;
        }).detach();
    } catch (const std::system_error& e) {
        --lookups_running;
        why = "cannot resolve " + host + ": " + e.what();
        return {};
    }
    std::unique_lock lock(answer->mutex);
    const auto limit = std::chrono::duration<double>(std::max(timeout_s, 0.0));
    if (!answer->done_cv.wait_for(lock, limit, [&] { return answer->done; })) {
        timed_out = true;
        why = "resolving " + host + " took longer than " + seconds_text(timeout_s) +
              " s (network.request_timeout_s)";
        return {};
    }
    why = answer->why;
    return std::move(answer->addresses);
}

std::vector<IpAddress> resolve(const std::string& host, const Config& config, double timeout_s,
                               std::string& why, bool& timed_out) {
    timed_out = false;
    if (auto pin = config.pins.find(host); pin != config.pins.end()) return {pin->second};
    if (auto literal = IpAddress::parse(host)) return {*literal};
    if (!config.dns) {
        why = "cannot resolve " + host +
              ": this server resolves only the names it was given "
              "(--egress-resolve)";
        return {};
    }
    return resolve_within(host, timeout_s, why, timed_out,
                          [host](std::string& failure) { return system_lookup(host, failure); });
}

UniqueFd connect_to(const IpAddress& address, int port, double timeout_s, std::string& why,
                    bool& timed_out) {
    sockaddr_storage storage{};
    socklen_t length = 0;
    if (address.family == AF_INET) {
        auto* in = reinterpret_cast<sockaddr_in*>(&storage);
        in->sin_family = AF_INET;
        in->sin_port = htons(static_cast<std::uint16_t>(port));
        std::memcpy(&in->sin_addr, address.bytes.data(), 4);
        length = sizeof *in;
    } else {
        auto* in6 = reinterpret_cast<sockaddr_in6*>(&storage);
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(static_cast<std::uint16_t>(port));
        std::memcpy(&in6->sin6_addr, address.bytes.data(), 16);
        length = sizeof *in6;
    }
    UniqueFd fd(::socket(address.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) {
        why = std::string("socket: ") + std::strerror(errno);
        return {};
    }
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&storage), length) != 0) {
        if (errno != EINPROGRESS) {
            why = std::strerror(errno);
            return {};
        }
        pollfd p{fd.get(), POLLOUT, 0};
        const int ready = ::poll(&p, 1, static_cast<int>(timeout_s * 1000));
        if (ready == 0) {
            why = "no answer within " + seconds_text(timeout_s) + " s";
            timed_out = true;
            return {};
        }
        int error = 0;
        socklen_t size = sizeof error;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &size);
        if (ready < 0 || error != 0) {
            why = std::strerror(ready < 0 ? errno : error);
            return {};
        }
    }
    const int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    set_timeouts(fd.get(), timeout_s);
    return fd;
}

}  // namespace cellblock::gateway
