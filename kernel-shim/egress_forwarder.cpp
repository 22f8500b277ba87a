// The shim's egress forwarder (docs/network.md): HTTP_PROXY in the kernel's
// environment names a port on the sandbox's own loopback; each connection
// goes on to the gateway's socket in the session's ipc dir, or is answered
// with why there is none.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/unique_fd.hpp"
#include "shim.hpp"

namespace cellblock::shim {
namespace {

constexpr const char kNoNetwork[] =
    "cellblock: this session has no network access (its limits say network.mode none; "
    "a server started with --egress-allow can give it some)\n";
// What the forwarder sends the gateway with each connection's socket attached.
constexpr char kHandOverByte = 'F';
constexpr int kListenBacklog = 64;
// How long a refused client's leftovers are read before its socket is closed
// (so that the 403 is not lost to a reset), and the poll step that counts it.
constexpr int kRefusedDrainMs = 1000;
constexpr int kDrainStepMs = 100;

// One connection through the forwarder: the client's socket, the gateway's
// (or none: the session has no gateway, and the client gets kNoNetwork), and
// what waits to be written each way. Everything is non-blocking; each
// direction holds at most kPipeBuffer bytes, so a slow side stalls the other
// instead of growing memory.
constexpr size_t kPipeBuffer = 64 * 1024;
constexpr size_t kMaxPipes = 128;

struct Pipe {
    UniqueFd fd[2];                 // client, gateway (none: refusing)
    std::string out[2];             // to write to fd[i]
    bool eof[2] = {false, false};   // fd[i] sent EOF (or failed)
    bool shut[2] = {false, false};  // SHUT_WR done on fd[i]
    int drain_ms = 0;               // refusing: how long to read the client's leftovers
};

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Hands the client's connection to the gateway: one byte with the socket
// attached (SCM_RIGHTS). From then on the gateway talks to the client
// directly; the forwarder copies nothing. Under runsc the code's sockets live
// in gVisor's netstack and cannot be passed to a host process: there the
// forwarder copies (copy_mode).
bool pass_to_gateway(int gateway, int client) {
    char byte = kHandOverByte;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &client, sizeof(int));
    ssize_t n;
    do {
        n = sendmsg(gateway, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n == 1;
}

// A new connection: handed to the gateway (true: nothing left to do here),
// or a pipe that copies it to the gateway (copy_mode) or answers that there is
// no gateway.
bool open_pipe(int client, bool copy_mode, Pipe& p) {
    p.fd[0].reset(client);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path =
        std::string(sandbox_protocol::kIpcDir) + "/" + sandbox_protocol::kEgressSocketName;
    strcpy(addr.sun_path, path.c_str());
    UniqueFd gateway(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    // Blocking connect: the gateway accepts at once (its backlog is 64).
    if (gateway && connect(gateway.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
        // Handed over: both ends close here (the client's with the unused pipe).
        if (!copy_mode && pass_to_gateway(gateway.get(), client)) return true;
        set_nonblocking(client);
        set_nonblocking(gateway.get());
        p.fd[1] = std::move(gateway);
        return false;
    }
    set_nonblocking(client);
    char head[256];
    const int n = snprintf(head, sizeof head,
                           "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n"
                           "Connection: close\r\nContent-Length: %zu\r\n\r\n",
                           sizeof kNoNetwork - 1);
    p.out[0] = std::string(head, static_cast<size_t>(n)) + kNoNetwork;
    p.eof[1] = true;  // nothing will come from a gateway
    p.drain_ms = kRefusedDrainMs;
    return false;
}

// Moves what it can; returns false once the pipe is done.
bool pump(Pipe& p, const pollfd* polled) {
    static char buf[kPipeBuffer];
    for (int i = 0; i < 2; ++i) {
        const int from = p.fd[i].get(), other = 1 - i;
        if (from < 0) continue;
        const short ev = polled[i].revents;
        // Read from fd[i] into out[other] while there is room.
        if (!p.eof[i] && (ev & (POLLIN | POLLHUP | POLLERR)) && p.out[other].size() < kPipeBuffer) {
            const ssize_t n = recv(from, buf, kPipeBuffer - p.out[other].size(), 0);
            if (n > 0) {
                if (p.fd[other]) p.out[other].append(buf, static_cast<size_t>(n));
            } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
                p.eof[i] = true;
            }
        }
        // Write out[i] to fd[i].
        if (!p.out[i].empty() && (ev & POLLOUT)) {
            const ssize_t n = send(from, p.out[i].data(), p.out[i].size(), MSG_NOSIGNAL);
            if (n > 0) {
                p.out[i].erase(0, static_cast<size_t>(n));
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                p.out[i].clear();
                p.eof[other] = true;  // nothing more can reach it
                p.eof[i] = true;
            }
        }
    }
    // A side that ended and whose bytes are delivered: end the other's writing.
    for (int i = 0; i < 2; ++i) {
        const int other = 1 - i;
        if (p.eof[i] && p.out[other].empty() && p.fd[other] && !p.shut[other]) {
            shutdown(p.fd[other].get(), SHUT_WR);
            p.shut[other] = true;
        }
    }
    if (!p.fd[1]) {  // refusing: the answer is out, the client's rest read briefly
        return !(p.out[0].empty() && (p.eof[0] || p.drain_ms <= 0));
    }
    // The gateway is done and its bytes are delivered: the connection is over.
    return !(p.eof[1] && p.out[0].empty());
}

}  // namespace

void start_egress_forwarder(bool copy) {
    const pid_t pid = fork();
    if (pid != 0) {
        if (pid < 0) say("egress forwarder: fork failed");
        return;
    }
    // Its stdio is /dev/null: the init's stdout and stderr are the host's
    // log of the session, which only the init may hold (test_posture).
    const int devnull = open("/dev/null", O_RDWR);
    if (devnull < 0) _exit(1);
    for (int fd = 0; fd < 3; ++fd) dup2(devnull, fd);
    close_inherited(3);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    signal(SIGINT, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(sandbox_protocol::kEgressProxyPort));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(listener, kListenBacklog) != 0) {
        _exit(1);  // the port is taken: HTTP_PROXY then reaches whatever took it
    }
    // Under runsc (its init connects its lifeline by path) sockets cannot be
    // passed to the host: copy.
    const bool copy_mode = copy || getenv(sandbox_protocol::kLifelineEnv) != nullptr;
    std::vector<Pipe> pipes;
    std::vector<pollfd> fds;
    for (;;) {
        fds.assign(1, pollfd{pipes.size() < kMaxPipes ? listener : -1, POLLIN, 0});
        bool draining = false;
        for (const Pipe& p : pipes) {
            for (int i = 0; i < 2; ++i) {
                short events = 0;
                if (p.fd[i] && !p.eof[i] && p.out[1 - i].size() < kPipeBuffer) events |= POLLIN;
                if (p.fd[i] && !p.out[i].empty()) events |= POLLOUT;
                fds.push_back({events ? p.fd[i].get() : -1, events, 0});
            }
            draining = draining || (!p.fd[1] && p.out[0].empty());
        }
        const int wait_ms = draining ? kDrainStepMs : -1;
        if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) _exit(1);
        for (size_t k = 0; k < pipes.size();) {
            Pipe& p = pipes[k];
            if (!p.fd[1] && p.out[0].empty()) p.drain_ms -= kDrainStepMs;
            if (pump(p, &fds[1 + 2 * k])) {
                ++k;
                continue;
            }
            // Its descriptors close with it. Keep the poll slots lined up
            // with the pipes still open.
            fds.erase(fds.begin() + 1 + 2 * static_cast<long>(k),
                      fds.begin() + 3 + 2 * static_cast<long>(k));
            pipes.erase(pipes.begin() + static_cast<long>(k));
        }
        if (fds[0].revents & POLLIN) {
            int client;
            while (pipes.size() < kMaxPipes &&
                   (client = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC)) >= 0) {
                Pipe p;
                if (!open_pipe(client, copy_mode, p)) pipes.push_back(std::move(p));
            }
        }
    }
}

}  // namespace cellblock::shim
