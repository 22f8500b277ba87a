#include "relay_priority.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "cellblock/sched_slice.hpp"

namespace cellblock {

void give_relay_priority(int nice) {
    if (nice == 0) return;
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), nice) != 0) {
        spdlog::warn("relay priority: cannot set nice {} for the server's threads: {}", nice,
                     std::strerror(errno));
        return;
    }
    spdlog::debug("relay priority: the server's loop and I/O threads run at nice {}", nice);
}

void give_interactive_slice(std::uint32_t us) {
    if (us == 0) return;
    if (!set_sched_slice(::gettid(), us)) {
        spdlog::warn("interactive slice: cannot set {} us for the server's threads: {}", us,
                     std::strerror(errno));
        return;
    }
    const std::int64_t now = sched_slice_us(::gettid());
    if (now < 0)
        spdlog::debug("interactive slice: this kernel reports no slice (before EEVDF)");
    else
        spdlog::debug("interactive slice: the server's threads run with a {} us slice", now);
}

}  // namespace cellblock
