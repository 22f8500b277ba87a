// The text of an errno value, for the messages that report a failed call.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

namespace cellblock {

// errno as it is at the call, unless given.
inline std::string errno_text(int err = errno) { return std::strerror(err); }

}  // namespace cellblock
