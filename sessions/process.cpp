#include "process.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "cellblock/unique_fd.hpp"

namespace cellblock {

ProcessResult run_process(const std::vector<std::string>& argv, int pass_fd, int stdio_fd) {
    if (argv.empty()) throw std::invalid_argument("run_process: empty argv");
    UniqueFd out_read, out_write;  // the child's stdout and stderr, read here
    if (stdio_fd < 0) {
        int out_pipe[2];
        if (pipe2(out_pipe, O_CLOEXEC) != 0) {
            throw std::runtime_error(std::string("run_process: pipe: ") + strerror(errno));
        }
        out_read.reset(out_pipe[0]);
        out_write.reset(out_pipe[1]);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    char path_env[] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    char* env[] = {path_env, nullptr};

    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("run_process: fork: ") + strerror(errno));
    if (pid == 0) {
        // Only async-signal-safe calls from here on.
        // The relay's priority (a negative nice, server/relay_priority.hpp)
        // is not the sandbox's: a child starts at nice 0 or above.
        errno = 0;
        if (getpriority(PRIO_PROCESS, 0) < 0 && errno == 0) setpriority(PRIO_PROCESS, 0, 0);
        const int devnull = open("/dev/null", O_RDONLY);
        dup2(devnull, STDIN_FILENO);
        const int out = stdio_fd >= 0 ? stdio_fd : out_write.get();
        dup2(out, STDOUT_FILENO);
        dup2(out, STDERR_FILENO);
        if (pass_fd >= 0) {
            if (pass_fd == 3) {
                fcntl(3, F_SETFD, 0);
            } else {
                dup2(pass_fd, 3);
            }
        }
        syscall(SYS_close_range, pass_fd >= 0 ? 4u : 3u, ~0u, 0u);
        execvpe(args[0], args.data(), env);
        _exit(127);
    }
    ProcessResult result;
    if (out_read) {
        out_write.reset();
        char buf[4096];
        ssize_t n;
        while ((n = read(out_read.get(), buf, sizeof buf)) != 0) {
            if (n < 0) {
                if (errno == EINTR) continue;
                break;
            }
            if (result.output.size() < 65536) result.output.append(buf, static_cast<size_t>(n));
        }
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return result;
}

}  // namespace cellblock
