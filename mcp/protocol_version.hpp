// The MCP revisions this server speaks and how one is chosen (the spec's
// lifecycle: answer the client's version if supported, else our latest).
#pragma once

#include <array>
#include <string>
#include <string_view>

namespace cellblock::mcp {

// Newest first. The official SDKs (TypeScript 1.32) accept these four.
inline constexpr std::array<std::string_view, 4> kProtocolVersions = {"2025-11-25", "2025-06-18",
                                                                      "2025-03-26", "2024-11-05"};
inline constexpr std::string_view kLatestProtocolVersion = kProtocolVersions[0];
// What an HTTP request without MCP-Protocol-Version is taken to speak (transports spec).
inline constexpr std::string_view kHttpDefaultProtocolVersion = "2025-03-26";

bool supported_protocol_version(std::string_view version);

// The version to answer an initialize that asked for `requested`.
std::string negotiate_protocol_version(std::string_view requested);

}  // namespace cellblock::mcp
