// cellblock-shim: init of a sandbox. See README.md in this folder. This file
// is the init itself (the kernel, the lifeline, signals, zombies, the kernel's
// stderr); the egress forwarder and the `--engine` start have files of their
// own (shim.hpp). What it says to the server and the zygote is
// include/cellblock/sandbox_protocol.hpp.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/unique_fd.hpp"
#include "channel_bridge.hpp"
#include "shim.hpp"

extern char** environ;

namespace cellblock::shim {

void say(const char* fmt, const char* arg) {
    fputs(sandbox_protocol::kShimLogPrefix, stderr);
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
}

void make_dir(const char* path) {
    if (mkdir(path, 0700) != 0 && errno != EEXIST) say("mkdir %s failed", path);
}

void close_inherited(int first) {
    // The shim holds a few descriptors, all low: none reaches this.
    constexpr int kMaxInheritedFd = 1024;
    for (int fd = first; fd < kMaxInheritedFd; ++fd) close(fd);
}

}  // namespace cellblock::shim

namespace {

using namespace cellblock::shim;
using cellblock::UniqueFd;
namespace protocol = cellblock::sandbox_protocol;

constexpr int kLifelineFd = protocol::kLifelineFd;
constexpr size_t kMaxKernelStderr = 64 * 1024;
// What the runtime gave the shim alone (the lifeline's path), not the kernel.
constexpr const char* kOwnVariables = "CELLBLOCK_";

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
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd || connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        return false;
    }
    if (fd.get() == kLifelineFd) {
        fd.release();  // it is the lifeline now, for the init's whole life
        return true;
    }
    // The copy at kLifelineFd stays; `fd` closes.
    return dup3(fd.get(), kLifelineFd, O_CLOEXEC) == kLifelineFd;
}

// Whether the listener at `fd` answers kAdoptedLine within kAdoptAckMs (byte
// by byte: what follows the line is the lifeline's).
bool answered_adopted(int fd) {
    const std::string expected = protocol::adopted_line();
    std::string got;
    while (got.size() < expected.size()) {
        pollfd p{fd, POLLIN, 0};
        char c = 0;
        if (poll(&p, 1, protocol::kAdoptAckMs) != 1 || recv(fd, &c, 1, 0) != 1) break;
        got.push_back(c);
    }
    if (got == expected) return true;
    say("%s", "a lifeline listener that did not answer as the server was refused");
    return false;
}

// After the lifeline ended (docs/restarts.md, phase 2): one try to connect
// to a restarted server's lifeline socket, as fd 3 again. Only the server's
// listener is taken: one outside the sandbox's PID namespace (SO_PEERCRED
// names it pid 0 here) or, in a zygote's container (no PID or user
// namespace), root's. No process of a sandbox is either: a session's run as
// its mapped user without capabilities, a zygote's as its first host id.
//
// Under runsc (`by_path`: the shim connected its first lifeline itself),
// SO_PEERCRED names the caller itself for every socket the gofer serves, so
// the listener is told by its socket file instead: one the sandbox's user
// does not own (every process of the sandbox runs as that user, without
// capabilities, and the ipc dir is sticky: none can replace the server's
// file). The server, which cannot see the shim's pid either, knows the shim
// by the key it gave it on the first lifeline (kAdoptKeyLine), written as
// kAdoptLine before anything else; the kernel never saw that line, and this
// process is not dumpable.
bool reconnect_lifeline(bool by_path, const std::string& adopt_key) {
    const std::string path = std::string(protocol::kIpcDir) + "/" + protocol::kLifelineSocketName;
    if (by_path) {
        struct stat st {};
        if (lstat(path.c_str(), &st) != 0) return false;
        if (!S_ISSOCK(st.st_mode) || st.st_uid == geteuid()) {
            say("%s", "a lifeline socket the sandbox made was refused");
            return false;
        }
    }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    // Never blocks: a listener that does not accept (the sandbox's own, its
    // backlog filled) would otherwise hold the shim here past its grace. A
    // unix socket connects at once or fails (EAGAIN: tried again next time).
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd || connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        fcntl(fd.get(), F_SETFL, fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK) != 0) {
        return false;
    }
    if (!by_path) {
        ucred cred{};
        socklen_t len = sizeof cred;
        if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
            (cred.pid != 0 && cred.uid != 0)) {
            say("%s", "a lifeline listener inside the sandbox was refused");
            return false;
        }
    }
    if (!adopt_key.empty()) {
        const std::string line = protocol::adopt_line(adopt_key);
        if (send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL) !=
                static_cast<ssize_t>(line.size()) ||
            !answered_adopted(fd.get())) {
            return false;
        }
    }
    // fd 3 was closed when the last lifeline ended: the socket may be it.
    if (fd.get() == kLifelineFd) {
        fd.release();
        return true;
    }
    return dup3(fd.get(), kLifelineFd, O_CLOEXEC) == kLifelineFd;
}

// How many processes the memory cgroup the shim runs in has killed (the
// container's own under `--engine`: cgroup v2's memory.events, else v1's
// memory.oom_control); 0 where neither can be read.
long oom_kills() {
    for (const char* path :
         {"/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"}) {
        FILE* f = fopen(path, "re");
        if (!f) continue;
        char key[64];
        long value = 0;
        long kills = -1;
        while (fscanf(f, "%63s %ld", key, &value) == 2) {
            if (strcmp(key, "oom_kill") == 0) kills = value;
        }
        fclose(f);
        if (kills >= 0) return kills;
    }
    return 0;
}

// The lifeline gone: fd 3 becomes /dev/null, so that no descriptor opened
// meanwhile (a bridged connection) takes its number, which report() writes
// to and the next lifeline is put at.
void drop_lifeline() {
    UniqueFd null(open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!null || dup3(null.get(), kLifelineFd, O_CLOEXEC) != kLifelineFd) close(kLifelineFd);
}

// The bridge of the kernel's channels, where kBridgeEnv names its directory
// (a fresh kernel's only: a forked one bound where its zygote's file said).
std::optional<ChannelBridge> channel_bridge(bool fresh_kernel) {
    const char* inner = getenv(protocol::kBridgeEnv);
    if (!fresh_kernel || !inner || !*inner) return std::nullopt;
    make_dir(inner);
    std::vector<ChannelBridge::Route> routes;
    for (int port = 1; port <= protocol::kKernelPorts; ++port) {
        const std::string name = "/" + protocol::kernel_socket_name(port);
        routes.push_back({protocol::kIpcDir + name, inner + name});
    }
    return ChannelBridge(std::move(routes));
}

std::vector<char*> kernel_environment(std::vector<std::string>& storage, bool bridged) {
    for (char** e = environ; *e; ++e) {
        if (strncmp(*e, kOwnVariables, strlen(kOwnVariables)) == 0) continue;
        storage.emplace_back(*e);
    }
    if (bridged) storage.push_back(std::string(protocol::kNoIopubPipeEnv) + "=1");
    std::vector<char*> env;
    for (auto& s : storage) env.push_back(s.data());
    env.push_back(nullptr);
    return env;
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
    bool engine = false;  // a container engine's task: what ended it goes to its log
    if (argc == 4 && strcmp(argv[1], protocol::kShimAdoptOption) == 0) {
        adopted = static_cast<pid_t>(atoi(argv[2]));
        adopted_stderr = atoi(argv[3]);
        if (adopted <= 0 || adopted_stderr <= kLifelineFd || fcntl(adopted_stderr, F_GETFD) == -1) {
            say("usage: cellblock-shim --adopt KERNEL_PID STDERR_FD");
            return 2;
        }
        fcntl(adopted_stderr, F_SETFD, FD_CLOEXEC);
    } else {
        if (argc > 2 && strcmp(argv[1], protocol::kShimEngineOption) == 0) {
            const long uid = atol(argv[2]);
            if (uid <= 0 || !enter_engine_sandbox(static_cast<uid_t>(uid))) return 1;
            first = 3;
            engine = true;
        }
        if (argc > first && strcmp(argv[first], protocol::kShimArgvEnd) == 0) ++first;
        if (first >= argc) {
            say("usage: cellblock-shim [--engine UID] -- KERNEL [ARGS...] | --adopt KERNEL_PID "
                "STDERR_FD");
            return 2;
        }
    }
    bool have_lifeline = fcntl(kLifelineFd, F_GETFD) != -1;
    // After the lifeline ends the shim waits this long for a restarted
    // server (see reconnect_lifeline); 0: the sandbox ends with its server.
    int adopt_grace_ms = 0;
    if (const char* grace = getenv(protocol::kAdoptGraceEnv)) {
        adopt_grace_ms = std::max(0, atoi(grace));
    }
    // What a server adopting a sandbox whose lifeline the shim connected
    // itself (runsc) must be shown (kAdoptKeyLine); empty: nothing to show.
    std::string adopt_key;
    const bool lifeline_by_path = !have_lifeline;
    if (have_lifeline) {
        fcntl(kLifelineFd, F_SETFD, FD_CLOEXEC);
    } else if (const char* path = getenv(protocol::kLifelineEnv); path && *path) {
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
    start_egress_forwarder(/*copy=*/engine);
    std::optional<ChannelBridge> bridge = channel_bridge(adopted < 0);

    sigset_t handled;
    sigemptyset(&handled);
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1}) sigaddset(&handled, sig);
    // SIGUSR1 wakes a quiesced bridge. A handler (never run: the signal is
    // read from the signalfd), so that no runtime drops it as one an init
    // does not handle.
    signal(SIGUSR1, [](int) {});
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
    std::vector<char*> env = kernel_environment(env_storage, bridge.has_value());
    // serve --swarm-share-boot-memory (kShareBootMemoryEnv): the kernel
    // starts at the addresses every kernel of its image on this node starts
    // at, so their boot pages are alike for the node's KSM.
    const bool fixed_layout = engine && getenv(protocol::kShareBootMemoryEnv) != nullptr;

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
        close_inherited(3);
        if (fixed_layout && personality(ADDR_NO_RANDOMIZE) == -1) {
            // The node's engine profile refuses it (Docker's default does):
            // the kernel runs as ever, its boot memory shared with no one.
            static constexpr char kRefused[] =
                "cannot fix the kernel's address layout (personality refused by the node's "
                "engine profile): its boot memory is not shared (docs/scale-out.md, "
                "\"Density\")\n";
            [[maybe_unused]] ssize_t n =
                write(STDERR_FILENO, protocol::kShimLogPrefix, strlen(protocol::kShimLogPrefix));
            n = write(STDERR_FILENO, kRefused, sizeof kRefused - 1);
        }
        execve(argv[first], argv + first, env.data());
        const char* why = strerror(errno);
        [[maybe_unused]] ssize_t n =
            write(STDERR_FILENO, protocol::kShimLogPrefix, strlen(protocol::kShimLogPrefix));
        n = write(STDERR_FILENO, "exec failed: ", 13);
        n = write(STDERR_FILENO, why, strlen(why));
        _exit(127);
    }
    UniqueFd(err_pipe[1]).reset();  // the kernel's end: end of file once it exits
    fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);

    std::string lifeline_line;  // what the server sent, up to a newline
    size_t stderr_copied = 0;
    bool stderr_open = true;
    using Clock = std::chrono::steady_clock;
    std::optional<Clock::time_point> term_at;  // told to stop: the kernel's last moment
    bool term_held = false;                    // --engine: the engine's SIGTERM, said once
    // No server (orphaned): the end of the grace. Not an optional: GCC at -O1
    // takes its value for uninitialized where it is read.
    bool orphaned = false;
    Clock::time_point orphaned_until{};
    protocol::KernelExit exit;  // how the kernel ended, once it has
    bool checked_adopted = adopted < 0;
    // Told to quiesce (kQuiesceLine): every host socket closed, until SIGUSR1.
    bool quiesced = false;
    Clock::time_point quiesced_until{};
    std::string bridge_said;  // the bridge's last complaint, said once

    using How = protocol::KernelExit::How;
    while (exit.how == How::unknown) {
        const auto now = Clock::now();
        int timeout_ms = -1;
        const auto until = [&](Clock::time_point t) {
            return static_cast<int>(
                std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1);
        };
        if (term_at) {
            if (now >= *term_at) {
                exit = {How::terminated, 0};
                break;
            }
            timeout_ms = until(*term_at);
        }
        if (orphaned) {
            if (reconnect_lifeline(lifeline_by_path, adopt_key)) {
                say("%s", "adopted by a restarted server");
                have_lifeline = true;
                orphaned = false;
            } else if (now >= orphaned_until) {
                say("%s", "no server adopted the sandbox within its grace; ending it");
                return 1;
            } else {
                timeout_ms = timeout_ms < 0 ? protocol::kAdoptRetryMs
                                            : std::min(timeout_ms, protocol::kAdoptRetryMs);
            }
        }
        if (quiesced) {
            if (now >= quiesced_until) {
                say("%s", "quiesced and never woken (SIGUSR1); ending the sandbox");
                return 1;
            }
            timeout_ms = timeout_ms < 0 ? until(quiesced_until)
                                        : std::min(timeout_ms, until(quiesced_until));
        } else if (bridge && !bridge->listening() && !bridge->listen()) {
            // Until the kernel has bound its sockets (or a bind that failed
            // works): looked at again every 10 ms.
            constexpr int kBridgeRetryMs = 10;
            timeout_ms = timeout_ms < 0 ? kBridgeRetryMs : std::min(timeout_ms, kBridgeRetryMs);
            if (bridge->why().rfind("cannot", 0) == 0 && bridge->why() != bridge_said) {
                bridge_said = bridge->why();
                say("bridge: %s", bridge_said.c_str());
            }
        }
        if (adopted > 0 && !checked_adopted) timeout_ms = 0;
        std::vector<pollfd> fds = {{sigfd, POLLIN, 0},
                                   {have_lifeline ? kLifelineFd : -1, POLLIN, 0},
                                   {stderr_open ? err_pipe[0] : -1, POLLIN, 0}};
        if (bridge) bridge->want(fds);
        const int ready = poll(fds.data(), fds.size(), timeout_ms);
        if (ready < 0 && errno != EINTR) break;
        if (bridge && ready > 0) bridge->handle(fds, 3);
        const bool check_children = (fds[0].revents & POLLIN) || !checked_adopted;
        checked_adopted = true;
        if (check_children) {
            signalfd_siginfo info;
            while (read(sigfd, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
                const int sig = static_cast<int>(info.ssi_signo);
                if (sig == SIGINT) {
                    kill(kernel, SIGINT);
                } else if (sig == SIGUSR1) {
                    if (quiesced) {
                        // Restored (or the checkpoint failed): the lifeline
                        // again, as for an adoption; the bridge listens once
                        // it is back.
                        say("%s", "woken: connecting the lifeline again");
                        quiesced = false;
                        orphaned = true;
                        orphaned_until =
                            Clock::now() + std::chrono::milliseconds(
                                               std::max(adopt_grace_ms, protocol::kAdoptAckMs * 5));
                    }
                } else if (sig == SIGTERM && engine && front_attached()) {
                    // The engine stops a task so when its service is removed
                    // (the front asked the kernel to exit first) and when its
                    // node is drained: then the front moves the session while
                    // the kernel runs on, until the stop grace ends in SIGKILL.
                    // With no front attached, SIGTERM ends it as below.
                    if (!term_held) {
                        say("%s",
                            "SIGTERM held while a front is attached: the kernel runs until "
                            "it exits");
                    }
                    term_held = true;
                } else if (sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT) {
                    kill(kernel, SIGTERM);
                    if (!term_at)
                        term_at =
                            Clock::now() + std::chrono::milliseconds(protocol::kShimTermGraceMs);
                }
            }
            int status = 0;
            pid_t pid;
            while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
                if (pid != kernel) continue;
                if (WIFEXITED(status)) {
                    exit = {How::exited, WEXITSTATUS(status)};
                } else if (WIFSIGNALED(status)) {
                    exit = {How::signaled, WTERMSIG(status)};
                }
            }
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            char buf[256];
            const ssize_t n = read(kLifelineFd, buf, sizeof buf);
            if (n <= 0) {
                if (adopt_grace_ms <= 0) {
                    // The server is gone: end the sandbox with it.
                    say("server gone; ending the sandbox");
                    return 1;
                }
                // The sandbox outlives its server for the grace, and no
                // longer: a server started on the same state dir adopts it.
                drop_lifeline();
                have_lifeline = false;
                lifeline_line.clear();
                orphaned = true;
                orphaned_until = Clock::now() + std::chrono::milliseconds(adopt_grace_ms);
                say("server gone; the sandbox waits %s ms for a server to adopt it",
                    std::to_string(adopt_grace_ms).c_str());
                continue;
            }
            // "interrupt\n": SIGINT to the kernel (runsc's init pid is the
            // Sentry, which the server cannot signal on the kernel's behalf).
            for (ssize_t i = 0; i < n; ++i) {
                if (buf[i] != '\n') {
                    if (lifeline_line.size() < protocol::kMaxLifelineLine) {
                        lifeline_line.push_back(buf[i]);
                    }
                    continue;
                }
                if (lifeline_line == protocol::kInterruptLine) {
                    kill(kernel, SIGINT);
                } else if (const auto key = protocol::adopt_key_of(lifeline_line)) {
                    adopt_key = *key;
                } else if (lifeline_line == protocol::kQuiesceLine) {
                    lifeline_line.clear();
                    if (!bridge) {
                        report(protocol::kNotQuietLine);
                        continue;
                    }
                    // Every host socket: the bridge's, then the lifeline once
                    // it has said so. What followed on the lifeline goes with it.
                    bridge->quiesce();
                    report(protocol::kQuietLine);
                    drop_lifeline();
                    have_lifeline = false;
                    quiesced = true;
                    quiesced_until =
                        Clock::now() + std::chrono::milliseconds(protocol::kQuiescedMs);
                    say("%s", "quiesced: no host socket held; waiting for SIGUSR1");
                    break;
                }
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
    const std::string exit_line = protocol::kernel_exit_line(exit);
    if (engine && oom_kills() > 0) say("%s", protocol::kMemoryLimitReached);
    say("%s", exit_line.c_str());
    report(exit_line);
    // As PID 1, returning ends every other process of the sandbox.
    return 0;
}
