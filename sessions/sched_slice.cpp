#include "cellblock/sched_slice.hpp"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace cellblock {

namespace {

// The first version of the kernel's struct sched_attr (SCHED_ATTR_SIZE_VER0):
// glibc 2.36 declares no wrapper and the uapi header is not in every
// toolchain.
struct SchedAttr {
    std::uint32_t size;
    std::uint32_t policy;
    std::uint64_t flags;
    std::int32_t nice;
    std::uint32_t priority;
    std::uint64_t runtime;
    std::uint64_t deadline;
    std::uint64_t period;
};
static_assert(sizeof(SchedAttr) == 48);

}  // namespace

bool set_sched_slice(pid_t tid, std::uint32_t us) {
    SchedAttr attr{};
    if (::syscall(SYS_sched_getattr, tid, &attr, sizeof attr, 0) != 0) return false;
    // Only a fair task has a slice; a real-time or deadline one is left as it is.
    if (attr.policy != SCHED_OTHER && attr.policy != SCHED_BATCH && attr.policy != SCHED_IDLE)
        return true;
    attr.size = sizeof attr;
    attr.runtime = std::uint64_t{us} * 1000;
    return ::syscall(SYS_sched_setattr, tid, &attr, 0) == 0;
}

std::int64_t sched_slice_us(pid_t tid) {
    std::ifstream sched("/proc/" + std::to_string(tid) + "/sched");
    for (std::string line; std::getline(sched, line);) {
        // "se.slice                                     :              1400000"
        if (line.rfind("se.slice", 0) != 0 || line.size() <= 8 || line[8] != ' ') continue;
        const auto colon = line.find(':');
        if (colon == std::string::npos) return -1;
        try {
            return std::stoll(line.substr(colon + 1)) / 1000;
        } catch (const std::exception&) {
            return -1;
        }
    }
    return -1;
}

}  // namespace cellblock
