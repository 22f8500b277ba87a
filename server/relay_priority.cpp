#include "relay_priority.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

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

}  // namespace cellblock
