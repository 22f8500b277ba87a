#include "seccomp_syscalls.hpp"

namespace cellblock {

const std::vector<std::string>& x86_64_syscall_names() {
    // Generated at configure time from <asm/unistd_64.h> (sessions/CMakeLists.txt).
    static const std::vector<std::string> names = {
#include "x86_64_syscalls.inc"
    };
    return names;
}

}  // namespace cellblock
