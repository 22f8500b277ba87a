#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <system_error>

#include "gateway.hpp"

namespace cellblock::gateway {
using nlohmann::json;

void send_control(int control_fd, const json& message, int fd) {
    const std::string text = message.dump();
    if (text.size() > kMaxControlMessage) {
        throw std::runtime_error("control message of " + std::to_string(text.size()) +
                                 " bytes is above " + std::to_string(kMaxControlMessage));
    }
    iovec iov{const_cast<char*>(text.data()), text.size()};
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
        n = ::sendmsg(control_fd, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw std::system_error(errno, std::generic_category(), "gateway control");
}

bool receive_control(int control_fd, json& message, int& fd) {
    fd = -1;
    std::string buffer(kMaxControlMessage, '\0');
    iovec iov{buffer.data(), buffer.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
        n = ::recvmsg(control_fd, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw std::system_error(errno, std::generic_category(), "gateway control");
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (fd < 0) {
                fd = received;
            } else {
                ::close(received);  // one fd per message; more is not ours to keep
            }
        }
    }
    if (n == 0) return false;
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        if (fd >= 0) ::close(fd);
        fd = -1;
        throw std::runtime_error("control message truncated");
    }
    buffer.resize(static_cast<std::size_t>(n));
    message = json::parse(buffer, nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
        if (fd >= 0) ::close(fd);
        fd = -1;
        throw std::runtime_error("control message is not a JSON object");
    }
    return true;
}

}  // namespace cellblock::gateway
