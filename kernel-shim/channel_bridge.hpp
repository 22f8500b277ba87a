// The kernel's channels held by the shim (docs/hibernation.md, "The exact
// level on runsc"). The kernel binds its sockets inside the sandbox (a
// directory of its own tmpfs); the shim listens at the paths the server
// connects to and pairs each connection it accepts with one it makes to the
// kernel's socket, copying bytes both ways. Every host socket of the
// sandbox is then the shim's, so it can let go of them all (quiesce) before
// `runsc checkpoint`, which refuses a sandbox holding host sockets, and
// listen again after `runsc restore`: the kernel never sees its sockets go.
// libc only, like the rest of the shim.
#pragma once

#include <poll.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cellblock/unique_fd.hpp"

namespace cellblock::shim {

class ChannelBridge {
  public:
    // One channel: where the server connects (outer), where the kernel
    // listens (inner).
    struct Route {
        std::string outer;
        std::string inner;
    };
    // The most bytes held for one direction of one connection; past it the
    // bridge stops reading that side until the other has taken some.
    static constexpr std::size_t kMaxHeld = 1 << 20;

    explicit ChannelBridge(std::vector<Route> routes);

    // Listens at every outer path once every inner socket exists (the
    // kernel has bound them all), so that the server finds the outer ones
    // only when the kernel can be reached. True once listening; false while
    // an inner socket is missing or an outer one could not be bound (said;
    // tried again at the next call).
    bool listen();
    bool listening() const { return !listeners_.empty(); }
    // Why the last listen() returned false.
    const std::string& why() const { return why_; }
    // Closes every listener and connection, outer and inner (the kernel's
    // ZMQ sees its peers go, as at a client's disconnect), and unlinks the
    // outer paths. listen() starts again.
    void quiesce();

    // Appends the descriptors to poll; handle() is given the same vector
    // back, with `first` the index of the first one appended.
    void want(std::vector<pollfd>& fds) const;
    void handle(const std::vector<pollfd>& fds, std::size_t first);

    // Connections paired now (for tests and the log).
    std::size_t connections() const { return links_.size(); }

  private:
    // Bytes read from one side, not yet written to the other.
    struct Held {
        std::string bytes;
        std::size_t sent = 0;
        bool ended = false;  // its reader saw the end (or an error)
        std::size_t pending() const { return bytes.size() - sent; }
    };
    // An accepted connection and the one made to the kernel for it.
    struct Link {
        UniqueFd outer;
        UniqueFd inner;
        Held to_inner;
        Held to_outer;
        bool broken = false;
    };

    void accept_on(std::size_t route);
    static void read_into(int fd, Held& held);
    static bool flush(int fd, Held& held);  // false: the writer failed

    std::vector<Route> routes_;
    std::vector<UniqueFd> listeners_;  // one per route while listening
    std::vector<Link> links_;
    std::string why_;
};

}  // namespace cellblock::shim
