// "SIGTERM" for 15: how a stopping server names the signal in its log and in
// the ServerShuttingDown answers it owes.
#pragma once

#include <string.h>

#include <string>

namespace cellblock {

inline std::string signal_name(int signo) {
    const char* abbrev = ::sigabbrev_np(signo);
    return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signo);
}

}  // namespace cellblock
