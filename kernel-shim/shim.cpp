// cellblock-shim: init of a sandbox. See README.md in this folder. This file
// is the init itself (the kernel, the lifeline, signals, zombies, the kernel's
// stderr); the egress forwarder and the `--engine` start have files of their
// own (shim.hpp). What it says to the server and the zygote is
// include/cellblock/sandbox_protocol.hpp.
#include <fcntl.h>
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

#include "cellblock/sandbox_protocol.hpp"
#include "shim.hpp"

extern char** environ;

namespace cellblock::shim {

void say(const char* fmt, const char* arg) {
    fprintf(stderr, "cellblock-shim: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
}

void make_dir(const char* path) {
    if (mkdir(path, 0700) != 0 && errno != EEXIST) say("mkdir %s failed", path);
}

}  // namespace cellblock::shim

namespace {

using namespace cellblock::shim;
namespace protocol = cellblock::sandbox_protocol;

constexpr int kLifelineFd = protocol::kLifelineFd;
constexpr size_t kMaxKernelStderr = 64 * 1024;
// Everything the kernel could inherit is closed up to here before its exec.
constexpr int kMaxInheritedFd = 1024;
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

std::vector<char*> kernel_environment(std::vector<std::string>& storage) {
    for (char** e = environ; *e; ++e) {
        if (strncmp(*e, kOwnVariables, strlen(kOwnVariables)) == 0) continue;
        storage.emplace_back(*e);
    }
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
        }
        if (argc > first && strcmp(argv[first], protocol::kShimArgvEnd) == 0) ++first;
        if (first >= argc) {
            say("usage: cellblock-shim [--engine UID] -- KERNEL [ARGS...] | --adopt KERNEL_PID "
                "STDERR_FD");
            return 2;
        }
    }
    bool have_lifeline = fcntl(kLifelineFd, F_GETFD) != -1;
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
        for (int fd = 3; fd < kMaxInheritedFd; ++fd) close(fd);
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
    protocol::KernelExit exit;  // how the kernel ended, once it has
    bool checked_adopted = adopted < 0;

    using How = protocol::KernelExit::How;
    while (exit.how == How::unknown) {
        pollfd fds[3] = {{sigfd, POLLIN, 0},
                         {have_lifeline ? kLifelineFd : -1, POLLIN, 0},
                         {stderr_open ? err_pipe[0] : -1, POLLIN, 0}};
        const int ready = poll(fds, 3, adopted > 0 && !checked_adopted ? 0 : term_deadline_ms);
        if (ready < 0 && errno != EINTR) break;
        if (ready == 0 && term_deadline_ms >= 0) {
            exit = {How::terminated, 0};
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
                    term_deadline_ms = protocol::kShimTermGraceMs;
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
                // The server is gone: end the sandbox with it.
                say("server gone; ending the sandbox");
                return 1;
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
                if (lifeline_line == protocol::kInterruptLine) kill(kernel, SIGINT);
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
    say("%s", exit_line.c_str());
    report(exit_line);
    // As PID 1, returning ends every other process of the sandbox.
    return 0;
}
