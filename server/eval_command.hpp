// `cellblock eval`: runs the Python evaluator of clients/python.
#pragma once

namespace cellblock {

// Replaces this process with `python3 -m cellblock.eval ARGS...` (argv[2] on),
// the client package on PYTHONPATH and CELLBLOCK_BIN naming this binary.
// Returns only on failure, with the exit code to use.
int exec_eval(int argc, char** argv);

}  // namespace cellblock
