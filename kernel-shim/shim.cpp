// cellblock-shim: init of a sandbox. See README.md in this folder.
#include <fcntl.h>
#include <grp.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

constexpr int kLifelineFd = 3;
constexpr size_t kMaxKernelStderr = 64 * 1024;
constexpr int kTermGraceMs = 2000;
// The egress forwarder (docs/network.md): HTTP_PROXY in the kernel's
// environment names this port on the sandbox's own loopback; each connection
// goes on to the gateway's socket in the session's ipc dir, or is answered
// with why there is none.
constexpr uint16_t kEgressPort = 3128;
constexpr const char* kEgressSocket = "/run/cellblock/egress.sock";
constexpr const char kNoNetwork[] =
    "cellblock: this session has no network access (its limits say network.mode none; "
    "a server started with --egress-allow can give it some)\n";

void say(const char* fmt, const char* arg = "") {
    fprintf(stderr, "cellblock-shim: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
}

void report(const std::string& line) {
    std::string text = line + "\n";
    // Best effort: the server may be gone already.
    [[maybe_unused]] ssize_t n = write(kLifelineFd, text.data(), text.size());
}

// Under a runtime that cannot pass fds (runsc), the server listens on a unix
// socket whose path is in CELLBLOCK_LIFELINE and accepts exactly one
// connection: this one, made before the kernel exists. It becomes fd 3.
bool connect_lifeline(const char* path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) return false;
    strcpy(addr.sun_path, path);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        close(fd);
        return false;
    }
    if (fd != kLifelineFd) {
        if (dup3(fd, kLifelineFd, O_CLOEXEC) != kLifelineFd) {
            close(fd);
            return false;
        }
        close(fd);
    }
    return true;
}

void make_dir(const char* path) {
    if (mkdir(path, 0700) != 0 && errno != EEXIST) say("mkdir %s failed", path);
}

std::vector<char*> kernel_environment(std::vector<std::string>& storage) {
    for (char** e = environ; *e; ++e) {
        if (strncmp(*e, "CELLBLOCK_", 10) == 0) continue;
        storage.emplace_back(*e);
    }
    std::vector<char*> env;
    for (auto& s : storage) env.push_back(s.data());
    env.push_back(nullptr);
    return env;
}

// One connection through the forwarder: the client's socket, the gateway's
// (or none: the session has no gateway, and the client gets kNoNetwork), and
// what waits to be written each way. Everything is non-blocking; each
// direction holds at most kPipeBuffer bytes, so a slow side stalls the other
// instead of growing memory.
constexpr size_t kPipeBuffer = 64 * 1024;
constexpr size_t kMaxPipes = 128;

struct Pipe {
    int fd[2] = {-1, -1};           // client, gateway (-1: refusing)
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
    char byte = 'F';
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

// A new connection: to the gateway, or the answer that there is none.
// A new connection: handed to the gateway (true: nothing left to do here),
// or a pipe that copies it to the gateway (copy_mode) or answers that there is
// no gateway.
bool open_pipe(int client, bool copy_mode, Pipe& p) {
    p.fd[0] = client;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strcpy(addr.sun_path, kEgressSocket);
    const int gateway = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    // Blocking connect: the gateway accepts at once (its backlog is 64).
    if (gateway >= 0 && connect(gateway, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
        if (!copy_mode && pass_to_gateway(gateway, client)) {
            close(gateway);
            close(client);
            return true;
        }
        set_nonblocking(client);
        set_nonblocking(gateway);
        p.fd[1] = gateway;
        return false;
    }
    if (gateway >= 0) close(gateway);
    set_nonblocking(client);
    char head[256];
    const int n = snprintf(head, sizeof head,
                           "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n"
                           "Connection: close\r\nContent-Length: %zu\r\n\r\n",
                           sizeof kNoNetwork - 1);
    p.out[0] = std::string(head, static_cast<size_t>(n)) + kNoNetwork;
    p.eof[1] = true;  // nothing will come from a gateway
    p.drain_ms = 1000;
    return false;
}

// Moves what it can; returns false once the pipe is done.
bool pump(Pipe& p, const pollfd* polled) {
    static char buf[kPipeBuffer];
    for (int i = 0; i < 2; ++i) {
        const int from = p.fd[i], other = 1 - i;
        if (from < 0) continue;
        const short ev = polled[i].revents;
        // Read from fd[i] into out[other] while there is room.
        if (!p.eof[i] && (ev & (POLLIN | POLLHUP | POLLERR)) && p.out[other].size() < kPipeBuffer) {
            const ssize_t n = recv(from, buf, kPipeBuffer - p.out[other].size(), 0);
            if (n > 0) {
                if (p.fd[other] >= 0) p.out[other].append(buf, static_cast<size_t>(n));
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
        if (p.eof[i] && p.out[other].empty() && p.fd[other] >= 0 && !p.shut[other]) {
            shutdown(p.fd[other], SHUT_WR);
            p.shut[other] = true;
        }
    }
    if (p.fd[1] < 0) {  // refusing: the answer is out, the client's rest read briefly
        return !(p.out[0].empty() && (p.eof[0] || p.drain_ms <= 0));
    }
    // The gateway is done and its bytes are delivered: the connection is over.
    return !(p.eof[1] && p.out[0].empty());
}

// Starts the forwarder: one process listening on 127.0.0.1:kEgressPort that
// hands each connection to the gateway (or, under runsc, copies it), or
// answers that there is none, in one poll loop. It holds none of the shim's
// descriptors.
void start_egress_forwarder() {
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
    for (int fd = 3; fd < 1024; ++fd) close(fd);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    signal(SIGINT, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(kEgressPort);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(listener, 64) != 0) {
        _exit(1);  // the port is taken: HTTP_PROXY then reaches whatever took it
    }
    // Under runsc (its init connects its lifeline by path) sockets cannot be
    // passed to the host: copy.
    const bool copy_mode = getenv("CELLBLOCK_LIFELINE") != nullptr;
    std::vector<Pipe> pipes;
    std::vector<pollfd> fds;
    for (;;) {
        fds.assign(1, pollfd{pipes.size() < kMaxPipes ? listener : -1, POLLIN, 0});
        bool draining = false;
        for (const Pipe& p : pipes) {
            for (int i = 0; i < 2; ++i) {
                short events = 0;
                if (p.fd[i] >= 0 && !p.eof[i] && p.out[1 - i].size() < kPipeBuffer)
                    events |= POLLIN;
                if (p.fd[i] >= 0 && !p.out[i].empty()) events |= POLLOUT;
                fds.push_back({events ? p.fd[i] : -1, events, 0});
            }
            draining = draining || (p.fd[1] < 0 && p.out[0].empty());
        }
        const int wait_ms = draining ? 100 : -1;
        if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) _exit(1);
        for (size_t k = 0; k < pipes.size();) {
            Pipe& p = pipes[k];
            if (p.fd[1] < 0 && p.out[0].empty()) p.drain_ms -= 100;
            if (pump(p, &fds[1 + 2 * k])) {
                ++k;
                continue;
            }
            for (int fd : p.fd)
                if (fd >= 0) close(fd);
            // Keep the poll slots lined up with the pipes still open.
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

// `--engine UID`: started as root by a container engine (a Docker Swarm
// task, docs/scale-out.md), with no runtime to set up what runc does. The
// session's network must carry only the server's inbound connections to the
// published kernel ports, which arrive from the node on the local subnet: the
// default routes go, so nothing leaves even where the node forwards.
bool delete_default_route(int family) {
    const int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0) return false;
    struct {
        nlmsghdr header;
        rtmsg route;
    } request{};
    request.header.nlmsg_len = sizeof request;
    request.header.nlmsg_type = RTM_DELROUTE;
    request.header.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;
    request.header.nlmsg_seq = 1;
    request.route.rtm_family = static_cast<unsigned char>(family);
    request.route.rtm_dst_len = 0;
    request.route.rtm_table = RT_TABLE_MAIN;
    request.route.rtm_scope = RT_SCOPE_NOWHERE;
    bool ok = false;
    // Several default routes (one per gateway) each take a request.
    for (int attempt = 0; attempt < 8; ++attempt) {
        if (send(fd, &request, sizeof request, 0) != static_cast<ssize_t>(sizeof request)) break;
        char reply[512];
        const ssize_t n = recv(fd, reply, sizeof reply, 0);
        if (n < static_cast<ssize_t>(sizeof(nlmsghdr) + sizeof(nlmsgerr))) break;
        const auto* err = reinterpret_cast<const nlmsgerr*>(NLMSG_DATA(reply));
        if (err->error == 0) continue;  // one deleted; look for another
        // No (more) default route of this family, or no such family here.
        ok = err->error == -ESRCH || err->error == -ENOENT || err->error == -EAFNOSUPPORT;
        break;
    }
    close(fd);
    return ok;
}

bool enter_engine_sandbox(uid_t uid) {
    if (getuid() != 0) {
        say("--engine: the engine must start the shim as root (it drops to the sandbox's uid)");
        return false;
    }
    for (int family : {AF_INET, AF_INET6}) {
        if (!delete_default_route(family)) {
            say("--engine: cannot delete the default route of family %s",
                family == AF_INET ? "inet" : "inet6");
            return false;
        }
    }
    // The engine mounts its tmpfs as root's 0755 (Swarm drops the mode it
    // is given): the kernel's own dirs become its uid's, the shared ones
    // sticky and world-writable, as under runc (oci_bundle.cpp).
    const char* home = getenv("HOME");
    if (home) make_dir(home);
    struct Dir {
        const char* path;
        mode_t mode;
        bool own;
    };
    for (const Dir& dir : {Dir{home, 0700, true}, Dir{"/data/output", 0755, true},
                           Dir{"/tmp", 01777, false}, Dir{"/dev/shm", 01777, false}}) {
        if (!dir.path || access(dir.path, F_OK) != 0) continue;
        // chmod while root still owns it: no CAP_FOWNER here.
        if (chmod(dir.path, dir.mode) != 0 || (dir.own && chown(dir.path, uid, uid) != 0)) {
            say("--engine: cannot prepare %s", dir.path);
            return false;
        }
    }
    // From root to `uid` with no capability left (no PR_SET_KEEPCAPS), and
    // no way back through a setuid binary or file capabilities.
    if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0 || getuid() != uid ||
        geteuid() != uid) {
        say("--engine: cannot drop to the sandbox's uid");
        return false;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        say("--engine: PR_SET_NO_NEW_PRIVS failed");
        return false;
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);  // setuid made it dumpable again
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    // The kernel runs as this same uid: without this, it could write this
    // process's memory through /proc/1/mem (no ptrace needed) and take over
    // the init, its lifeline and its log. Non-dumpable makes /proc/1/* root's.
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    // `--adopt PID FD`: a session forked from a zygote. Its init (this
    // process, exec'd by the forked interpreter) already has the kernel as its
    // child PID, whose stderr is the pipe read at FD; the rest is as below.
    pid_t adopted = -1;
    int adopted_stderr = -1;
    int first = 1;
    if (argc == 4 && strcmp(argv[1], "--adopt") == 0) {
        adopted = static_cast<pid_t>(atoi(argv[2]));
        adopted_stderr = atoi(argv[3]);
        if (adopted <= 0 || adopted_stderr <= kLifelineFd || fcntl(adopted_stderr, F_GETFD) == -1) {
            say("usage: cellblock-shim --adopt KERNEL_PID STDERR_FD");
            return 2;
        }
        fcntl(adopted_stderr, F_SETFD, FD_CLOEXEC);
    } else {
        if (argc > 2 && strcmp(argv[1], "--engine") == 0) {
            const long uid = atol(argv[2]);
            if (uid <= 0 || !enter_engine_sandbox(static_cast<uid_t>(uid))) return 1;
            first = 3;
        }
        if (argc > first && strcmp(argv[first], "--") == 0) ++first;
        if (first >= argc) {
            say("usage: cellblock-shim [--engine UID] -- KERNEL [ARGS...] | --adopt KERNEL_PID "
                "STDERR_FD");
            return 2;
        }
    }
    bool have_lifeline = fcntl(kLifelineFd, F_GETFD) != -1;
    if (have_lifeline) {
        fcntl(kLifelineFd, F_SETFD, FD_CLOEXEC);
    } else if (const char* path = getenv("CELLBLOCK_LIFELINE"); path && *path) {
        // Without its lifeline the sandbox would outlive a dead server: refuse to start.
        if (!connect_lifeline(path)) {
            say("cannot connect to the lifeline %s", path);
            return 1;
        }
        have_lifeline = true;
    }

    if (adopted < 0) {
        if (const char* home = getenv("HOME")) make_dir(home);
        if (const char* ipython = getenv("IPYTHONDIR")) make_dir(ipython);
    }
    start_egress_forwarder();

    sigset_t handled;
    sigemptyset(&handled);
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&handled, sig);
    sigprocmask(SIG_BLOCK, &handled, nullptr);
    const int sigfd = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd < 0) {
        say("signalfd failed");
        return 1;
    }

    int err_pipe[2] = {adopted_stderr, -1};
    if (adopted < 0 && pipe2(err_pipe, O_CLOEXEC) != 0) {
        say("pipe failed");
        return 1;
    }

    std::vector<std::string> env_storage;
    std::vector<char*> env = kernel_environment(env_storage);

    // A signal that came before the mask above is lost to the signalfd: an
    // adopted kernel that ended meanwhile is found by the first waitpid.
    const pid_t kernel = adopted > 0 ? adopted : fork();
    if (kernel < 0) {
        say("fork failed");
        return 1;
    }
    if (kernel == 0) {
        sigprocmask(SIG_UNBLOCK, &handled, nullptr);
        setpgid(0, 0);
        dup2(err_pipe[1], STDERR_FILENO);
        const int devnull = open("/dev/null", O_RDWR);
        if (devnull >= 0) {
            dup2(devnull, STDIN_FILENO);
            dup2(devnull, STDOUT_FILENO);
        }
        // The kernel inherits nothing but stdio: not the lifeline, not the pipe ends.
        for (int fd = 3; fd < 1024; ++fd) close(fd);
        execve(argv[first], argv + first, env.data());
        const char* why = strerror(errno);
        [[maybe_unused]] ssize_t n = write(STDERR_FILENO, "cellblock-shim: exec failed: ", 29);
        n = write(STDERR_FILENO, why, strlen(why));
        _exit(127);
    }
    if (err_pipe[1] >= 0) close(err_pipe[1]);
    fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);

    std::string lifeline_line;  // what the server sent, up to a newline
    size_t stderr_copied = 0;
    bool stderr_open = true;
    int term_deadline_ms = -1;
    std::string exit_line;
    bool checked_adopted = adopted < 0;

    while (exit_line.empty()) {
        pollfd fds[3] = {{sigfd, POLLIN, 0},
                         {have_lifeline ? kLifelineFd : -1, POLLIN, 0},
                         {stderr_open ? err_pipe[0] : -1, POLLIN, 0}};
        const int ready = poll(fds, 3, adopted > 0 && !checked_adopted ? 0 : term_deadline_ms);
        if (ready < 0 && errno != EINTR) break;
        if (ready == 0 && term_deadline_ms >= 0) {
            exit_line = "kernel-exit terminated";
            break;
        }
        const bool check_children = (fds[0].revents & POLLIN) || !checked_adopted;
        checked_adopted = true;
        if (check_children) {
            signalfd_siginfo info;
            while (read(sigfd, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
                const int sig = static_cast<int>(info.ssi_signo);
                if (sig == SIGINT) {
                    kill(kernel, SIGINT);
                } else if (sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT) {
                    kill(kernel, SIGTERM);
                    term_deadline_ms = kTermGraceMs;
                }
            }
            int status = 0;
            pid_t pid;
            while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
                if (pid != kernel) continue;
                if (WIFEXITED(status)) {
                    exit_line = "kernel-exit status=" + std::to_string(WEXITSTATUS(status));
                } else if (WIFSIGNALED(status)) {
                    exit_line = "kernel-exit signal=" + std::to_string(WTERMSIG(status));
                }
            }
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            char buf[256];
            const ssize_t n = read(kLifelineFd, buf, sizeof buf);
            if (n <= 0) {
                // The server is gone: end the sandbox with it.
                say("server gone; ending the sandbox");
                return 1;
            }
            // "interrupt\n": SIGINT to the kernel (runsc's init pid is the
            // Sentry, which the server cannot signal on the kernel's behalf).
            for (ssize_t i = 0; i < n; ++i) {
                if (buf[i] != '\n') {
                    if (lifeline_line.size() < 64) lifeline_line.push_back(buf[i]);
                    continue;
                }
                if (lifeline_line == "interrupt") kill(kernel, SIGINT);
                lifeline_line.clear();
            }
        }
        if (fds[2].revents & (POLLIN | POLLHUP | POLLERR)) {
            char buf[4096];
            ssize_t n;
            while ((n = read(err_pipe[0], buf, sizeof buf)) > 0) {
                if (stderr_copied < kMaxKernelStderr) {
                    const size_t take =
                        std::min(static_cast<size_t>(n), kMaxKernelStderr - stderr_copied);
                    [[maybe_unused]] ssize_t w = write(STDERR_FILENO, buf, take);
                    stderr_copied += take;
                    if (stderr_copied == kMaxKernelStderr)
                        say("kernel stderr past 64 KiB is discarded");
                }
            }
            if (n == 0) stderr_open = false;
        }
    }
    // What the kernel wrote just before it ended explains why: copy it too.
    if (stderr_open) {
        char buf[4096];
        ssize_t n;
        while (stderr_copied < kMaxKernelStderr && (n = read(err_pipe[0], buf, sizeof buf)) > 0) {
            const size_t take = std::min(static_cast<size_t>(n), kMaxKernelStderr - stderr_copied);
            [[maybe_unused]] ssize_t w = write(STDERR_FILENO, buf, take);
            stderr_copied += take;
        }
    }
    say("%s", exit_line.c_str());
    report(exit_line);
    // As PID 1, returning ends every other process of the sandbox.
    return 0;
}
