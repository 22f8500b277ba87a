#include "json_rpc.hpp"

namespace cellblock::mcp {
using nlohmann::json;

namespace {

bool valid_id(const json& id) { return id.is_string() || id.is_number_integer(); }

RpcMessage invalid(const json& id, int code, std::string message) {
    RpcMessage m;
    m.kind = RpcMessage::Kind::invalid;
    m.id = id;
    m.error_response = make_error(id, code, std::move(message));
    return m;
}

}  // namespace

std::size_t json_depth(const json& value, std::size_t limit) {
    if (!value.is_structured() || limit == 0) return 0;
    std::size_t deepest = 0;
    for (const auto& child : value) {
        deepest = std::max(deepest, json_depth(child, limit - 1));
        if (deepest + 1 > limit) break;
    }
    return deepest + 1;
}

RpcMessage parse_message(std::string_view text, const RpcLimits& limits) {
    if (text.size() > limits.max_bytes) {
        return invalid(nullptr, rpc_error::kInvalidRequest,
                       "message of " + std::to_string(text.size()) + " bytes is over the " +
                           std::to_string(limits.max_bytes) + "-byte limit");
    }
    // The depth is checked while parsing, so a deeply nested message never builds.
    std::size_t depth = 0;
    bool too_deep = false;
    const json::parser_callback_t guard = [&](int, json::parse_event_t event, json&) {
        if (event == json::parse_event_t::object_start ||
            event == json::parse_event_t::array_start) {
            if (++depth > limits.max_depth) too_deep = true;
        } else if (event == json::parse_event_t::object_end ||
                   event == json::parse_event_t::array_end) {
            --depth;
        }
        return !too_deep;
    };
    json value = json::parse(text, guard, false);
    if (too_deep) {
        return invalid(nullptr, rpc_error::kInvalidRequest,
                       "message nested deeper than " + std::to_string(limits.max_depth));
    }
    if (value.is_discarded()) return invalid(nullptr, rpc_error::kParseError, "Parse error");
    return classify(std::move(value));
}

RpcMessage classify(json message) {
    if (message.is_array()) {
        return invalid(nullptr, rpc_error::kInvalidRequest,
                       "JSON-RPC batches are not supported (MCP removed them in 2025-06-18)");
    }
    if (!message.is_object()) {
        return invalid(nullptr, rpc_error::kInvalidRequest, "a message must be a JSON object");
    }
    const json id = message.contains("id") ? message["id"] : json(nullptr);
    const json echo_id = valid_id(id) ? id : json(nullptr);
    if (message.value("jsonrpc", json()) != "2.0") {
        return invalid(echo_id, rpc_error::kInvalidRequest, "jsonrpc must be \"2.0\"");
    }
    if (message.contains("method")) {
        if (!message["method"].is_string()) {
            return invalid(echo_id, rpc_error::kInvalidRequest, "method must be a string");
        }
        RpcMessage m;
        m.method = message["method"].get<std::string>();
        if (message.contains("params")) {
            if (!message["params"].is_object()) {
                return invalid(echo_id, rpc_error::kInvalidRequest,
                               "params must be an object (MCP passes parameters by name)");
            }
            m.params = std::move(message["params"]);
        }
        if (!message.contains("id")) {
            m.kind = RpcMessage::Kind::notification;
            return m;
        }
        if (!valid_id(id)) {
            return invalid(nullptr, rpc_error::kInvalidRequest,
                           "id must be a string or an integer");
        }
        m.kind = RpcMessage::Kind::request;
        m.id = id;
        return m;
    }
    if (message.contains("result") || message.contains("error")) {
        RpcMessage m;
        m.kind = RpcMessage::Kind::response;
        m.id = id;
        m.result_or_error = message.contains("result") ? message["result"] : message["error"];
        return m;
    }
    return invalid(echo_id, rpc_error::kInvalidRequest,
                   "neither a request (method) nor a response (result or error)");
}

json make_result(const json& id, json result) {
    return {{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}};
}

json make_error(const json& id, int code, std::string message, std::optional<json> data) {
    json error = {{"code", code}, {"message", std::move(message)}};
    if (data) error["data"] = std::move(*data);
    return {{"jsonrpc", "2.0"}, {"id", id}, {"error", std::move(error)}};
}

json make_notification(std::string method, json params) {
    return {{"jsonrpc", "2.0"}, {"method", std::move(method)}, {"params", std::move(params)}};
}

}  // namespace cellblock::mcp
