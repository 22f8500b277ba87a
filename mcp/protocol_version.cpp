#include "protocol_version.hpp"

#include <algorithm>

namespace cellblock::mcp {

bool supported_protocol_version(std::string_view version) {
    return std::find(kProtocolVersions.begin(), kProtocolVersions.end(), version) !=
           kProtocolVersions.end();
}

std::string negotiate_protocol_version(std::string_view requested) {
    return std::string(supported_protocol_version(requested) ? requested : kLatestProtocolVersion);
}

}  // namespace cellblock::mcp
