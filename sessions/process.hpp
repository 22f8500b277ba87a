// Running a helper program (the OCI runtime) with a clean environment.
#pragma once

#include <string>
#include <vector>

namespace cellblock {

struct ProcessResult {
    int exit_code = -1;  // 128+signal when killed by a signal
    std::string output;  // stdout and stderr, capped at 64 KiB
};

// Runs argv with stdin from /dev/null and PATH as its only environment
// variable; the server's environment never reaches a sandbox. `pass_fd`, if
// not -1, becomes the child's fd 3 and `stdio_fd`, if not -1, its stdout and
// stderr (otherwise they are captured into `output`). Blocks until it ends.
ProcessResult run_process(const std::vector<std::string>& argv, int pass_fd = -1,
                          int stdio_fd = -1);

}  // namespace cellblock
