// One message on a unix socket with a descriptor attached (SCM_RIGHTS): what
// the gateway's control channel and the local file socket's clients send.
#pragma once

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string_view>

namespace cellblock {

// Sends `data` as one message with `fd` attached, or with nothing attached
// when fd < 0; retries on EINTR, never raises SIGPIPE. Returns sendmsg's
// result (errno set when it is < 0).
inline ssize_t send_with_fd(int socket, std::string_view data, int fd) {
    iovec iov{const_cast<char*>(data.data()), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n;
    do {
        n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
}

}  // namespace cellblock
