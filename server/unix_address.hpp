// The address of a unix socket at `path`, or nullopt when the path does not
// fit sun_path (the caller names the socket in its error).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <optional>
#include <string_view>

namespace cellblock {

inline std::optional<sockaddr_un> unix_address(std::string_view path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) return std::nullopt;
    std::memcpy(addr.sun_path, path.data(), path.size());
    return addr;
}

}  // namespace cellblock
