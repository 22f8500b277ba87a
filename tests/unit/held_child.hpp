// A child process that lives until the test lets it go, however slow the
// machine: it waits for the end of a pipe whose write end the test holds.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "cellblock/unique_fd.hpp"

namespace cellblock::testing {

struct HeldChild {
    pid_t pid = -1;
    UniqueFd hold;  // reset() lets the child end
};

inline HeldChild fork_held_child() {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) throw std::runtime_error("pipe");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork");
    if (pid == 0) {
        ::close(pipe_fds[1]);
        char byte;
        while (::read(pipe_fds[0], &byte, 1) < 0 && errno == EINTR) {
        }
        ::_exit(0);
    }
    ::close(pipe_fds[0]);
    return {pid, UniqueFd(pipe_fds[1])};
}

}  // namespace cellblock::testing
