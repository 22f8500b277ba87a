#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <system_error>

#include "cellblock/fd_passing.hpp"
#include "gateway.hpp"

namespace cellblock::gateway {
using nlohmann::json;

void send_control(int control_fd, const json& message, int fd) {
    const std::string text = message.dump();
    if (text.size() > kMaxControlMessage) {
        throw std::runtime_error("control message of " + std::to_string(text.size()) +
                                 " bytes is above " + std::to_string(kMaxControlMessage));
    }
    if (send_with_fd(control_fd, text, fd) < 0)
        throw std::system_error(errno, std::generic_category(), "gateway control");
}

ssize_t receive_with_fd(int socket, char* data, std::size_t size, UniqueFd& fd, int& flags) {
    iovec iov{data, size};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
        n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    const int saved = errno;
    fd.reset();
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (fd) {
                const UniqueFd extra(received);  // one fd per message; more is not ours
            } else {
                fd.reset(received);
            }
        }
    }
    flags = msg.msg_flags;
    errno = saved;
    return n;
}

bool receive_control(int control_fd, json& message, int& fd) {
    fd = -1;
    std::string buffer(kMaxControlMessage, '\0');
    UniqueFd attached;
    int flags = 0;
    const ssize_t n = receive_with_fd(control_fd, buffer.data(), buffer.size(), attached, flags);
    if (n < 0) throw std::system_error(errno, std::generic_category(), "gateway control");
    if (n == 0) return false;
    if (flags & (MSG_TRUNC | MSG_CTRUNC)) throw std::runtime_error("control message truncated");
    buffer.resize(static_cast<std::size_t>(n));
    message = json::parse(buffer, nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
        throw std::runtime_error("control message is not a JSON object");
    }
    fd = attached.release();
    return true;
}

}  // namespace cellblock::gateway
