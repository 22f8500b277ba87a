// JSON-RPC 2.0 as MCP uses it: one message per line (stdio) or per POST
// (HTTP). Parsing never throws: a malformed message becomes the error
// response it deserves. No transport and no MCP method here.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace cellblock::mcp {

// The error codes of JSON-RPC 2.0 and the one MCP adds for resources.
namespace rpc_error {
inline constexpr int kParseError = -32700;
inline constexpr int kInvalidRequest = -32600;
inline constexpr int kMethodNotFound = -32601;
inline constexpr int kInvalidParams = -32602;
inline constexpr int kInternalError = -32603;
inline constexpr int kResourceNotFound = -32002;
}  // namespace rpc_error

// A parsed incoming message. `kind` says which fields mean something.
struct RpcMessage {
    enum class Kind { request, notification, response, invalid };
    Kind kind = Kind::invalid;
    nlohmann::json id;  // request/response: a string or an integer; null when unknown
    std::string method;
    nlohmann::json params = nlohmann::json::object();
    nlohmann::json result_or_error;  // response: its "result" or "error"
    nlohmann::json error_response;   // invalid: the error response to send back

    // The id as a map key ("1" and "\"1\"" stay apart).
    std::string id_key() const { return id.dump(); }
};

// The limits applied before anything else is looked at.
struct RpcLimits {
    std::size_t max_bytes = 128u << 20;
    std::size_t max_depth = 64;
};

// Parses one message. A batch (a JSON array) is refused with an Invalid
// Request error: MCP removed batching in 2025-06-18 and no SDK sends one.
RpcMessage parse_message(std::string_view text, const RpcLimits& limits = {});
// The same for a value already parsed.
RpcMessage classify(nlohmann::json message);

nlohmann::json make_result(const nlohmann::json& id, nlohmann::json result);
nlohmann::json make_error(const nlohmann::json& id, int code, std::string message,
                          std::optional<nlohmann::json> data = std::nullopt);
nlohmann::json make_notification(std::string method, nlohmann::json params);

// The value's nesting depth (objects and arrays), stopping past `limit`.
std::size_t json_depth(const nlohmann::json& value, std::size_t limit);

}  // namespace cellblock::mcp
