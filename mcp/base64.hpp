// Base64 (RFC 4648, with padding) for MCP's image, blob and upload fields.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace cellblock::mcp {

std::string base64_encode(std::string_view bytes);
// nullopt when `text` is not base64 (whitespace is skipped).
std::optional<std::string> base64_decode(std::string_view text);
std::string strip_whitespace(std::string_view text);

}  // namespace cellblock::mcp
