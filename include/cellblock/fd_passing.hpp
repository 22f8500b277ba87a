// One message on a unix socket with descriptors attached (SCM_RIGHTS): what
// the gateway's control channel, the local file socket's clients and the
// server's fork requests to a zygote send.
#pragma once

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

namespace cellblock {

// Sends `data` as one message with `fds` attached (nothing attached when
// empty); retries on EINTR, never raises SIGPIPE. Returns sendmsg's result
// (errno set when it is < 0).
inline ssize_t send_with_fds(int socket, std::string_view data, std::span<const int> fds) {
    iovec iov{const_cast<char*>(data.data()), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
        msg.msg_control = control.data();
        msg.msg_controllen = control.size();
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n;
    do {
        n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
}

// The same with one descriptor, or none when fd < 0.
inline ssize_t send_with_fd(int socket, std::string_view data, int fd) {
    return send_with_fds(socket, data,
                         fd < 0 ? std::span<const int>() : std::span<const int>(&fd, 1));
}

}  // namespace cellblock
