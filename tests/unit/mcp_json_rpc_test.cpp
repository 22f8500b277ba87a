// JSON-RPC parsing and MCP version negotiation: values in, values out.
#include <gtest/gtest.h>

#include "json_rpc.hpp"
#include "protocol_version.hpp"

namespace cellblock::mcp {
namespace {
using nlohmann::json;
using Kind = RpcMessage::Kind;

TEST(McpJsonRpc, ParsesARequestWithAnIntegerOrStringId) {
    auto m = parse_message(R"({"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"a":1}})");
    ASSERT_EQ(m.kind, Kind::request);
    EXPECT_EQ(m.id, 7);
    EXPECT_EQ(m.method, "tools/list");
    EXPECT_EQ(m.params["a"], 1);
    auto s = parse_message(R"({"jsonrpc":"2.0","id":"7","method":"ping"})");
    ASSERT_EQ(s.kind, Kind::request);
    EXPECT_TRUE(s.params.is_object());
    // The same number and string are different requests.
    EXPECT_NE(m.id_key(), s.id_key());
}

TEST(McpJsonRpc, ANotificationHasNoId) {
    auto m = parse_message(
        R"({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3}})");
    EXPECT_EQ(m.kind, Kind::notification);
    EXPECT_EQ(m.params["requestId"], 3);
}

TEST(McpJsonRpc, AResponseIsRecognised) {
    EXPECT_EQ(parse_message(R"({"jsonrpc":"2.0","id":1,"result":{}})").kind, Kind::response);
    EXPECT_EQ(parse_message(R"({"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"x"}})").kind,
              Kind::response);
}

int error_code(const RpcMessage& m) {
    EXPECT_EQ(m.kind, Kind::invalid);
    return m.error_response["error"]["code"].get<int>();
}

TEST(McpJsonRpc, MalformedMessagesGetTheirErrorCodes) {
    EXPECT_EQ(error_code(parse_message("{not json")), rpc_error::kParseError);
    EXPECT_EQ(error_code(parse_message("")), rpc_error::kParseError);
    EXPECT_EQ(error_code(parse_message("42")), rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message("[]")), rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"id":1,"method":"ping"})")), rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":1,"method":5})")),
              rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":1,"method":"x","params":[1]})")),
              rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":1.5,"method":"x"})")),
              rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":{},"method":"x"})")),
              rpc_error::kInvalidRequest);
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":1})")), rpc_error::kInvalidRequest);
}

TEST(McpJsonRpc, TheErrorEchoesAUsableIdOnly) {
    auto m = parse_message(R"({"jsonrpc":"1.0","id":"abc","method":"ping"})");
    EXPECT_EQ(m.error_response["id"], "abc");
    auto bad = parse_message(R"({"jsonrpc":"2.0","id":[1],"method":"ping"})");
    EXPECT_TRUE(bad.error_response["id"].is_null());
    EXPECT_EQ(bad.error_response["jsonrpc"], "2.0");
}

TEST(McpJsonRpc, DepthAndSizeAreCappedBeforeParsing) {
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    EXPECT_EQ(error_code(parse_message(deep)), rpc_error::kInvalidRequest);
    RpcLimits small;
    small.max_bytes = 10;
    EXPECT_EQ(error_code(parse_message(R"({"jsonrpc":"2.0","id":1,"method":"ping"})", small)),
              rpc_error::kInvalidRequest);
    EXPECT_EQ(json_depth(json::parse(R"({"a":[{"b":1}]})"), 64), 3u);
}

TEST(McpJsonRpc, BuildsResultsErrorsAndNotifications) {
    EXPECT_EQ(make_result(3, {{"x", 1}}),
              json::parse(R"({"jsonrpc":"2.0","id":3,"result":{"x":1}})"));
    EXPECT_EQ(
        make_error("a", -32601, "Method not found"),
        json::parse(
            R"({"jsonrpc":"2.0","id":"a","error":{"code":-32601,"message":"Method not found"}})"));
    EXPECT_EQ(make_error(nullptr, -1, "m", json{{"k", 1}})["error"]["data"]["k"], 1);
    EXPECT_EQ(make_notification("notifications/progress", {{"progress", 1}})["method"],
              "notifications/progress");
}

TEST(McpProtocolVersion, AnswersTheClientsVersionWhenSupported) {
    for (const auto v : kProtocolVersions) EXPECT_EQ(negotiate_protocol_version(v), v);
    EXPECT_EQ(negotiate_protocol_version("2025-11-25"), "2025-11-25");
    EXPECT_EQ(negotiate_protocol_version("2024-11-05"), "2024-11-05");
}

TEST(McpProtocolVersion, AnswersItsLatestOtherwise) {
    EXPECT_EQ(negotiate_protocol_version("2099-01-01"), "2025-11-25");
    EXPECT_EQ(negotiate_protocol_version("1.0.0"), "2025-11-25");
    EXPECT_EQ(negotiate_protocol_version(""), "2025-11-25");
    EXPECT_FALSE(supported_protocol_version("2025-01-01"));
    EXPECT_TRUE(supported_protocol_version(kHttpDefaultProtocolVersion));
}

}  // namespace
}  // namespace cellblock::mcp
