// What a restart carries of a session's requests, as rows of the registry
// (session_handover.cpp, session_adoption.cpp): frames as CBOR binaries, and
// channels by name.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/connection_info.hpp"

namespace cellblock {

nlohmann::json frames_json(const std::vector<std::string>& frames);
std::vector<std::string> frames_of(const nlohmann::json& frames);
// Throws std::runtime_error for a name that is no channel.
Channel channel_named(const std::string& name);

}  // namespace cellblock
