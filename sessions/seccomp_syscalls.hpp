// The x86_64 system calls the build's kernel headers know, by name. The
// seccomp profile allows these (less the denied ones) and nothing else, so a
// system call newer than the headers, or one that exists only in the i386
// ABI, is refused by default.
#pragma once

#include <string>
#include <vector>

namespace cellblock {

const std::vector<std::string>& x86_64_syscall_names();

}  // namespace cellblock
