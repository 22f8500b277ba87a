// The HTTP pieces of the Streamable HTTP transport, as values.
#include <gtest/gtest.h>

#include "http_message.hpp"

namespace cellblock::mcp {
namespace {

TEST(McpHttp, ParsesARequestHead) {
    const auto r = parse_request_head(
        "POST /mcp?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type:  application/json \r\n"
        "Accept: application/json\r\naccept: text/event-stream");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->method, "POST");
    EXPECT_EQ(r->path, "/mcp");
    EXPECT_EQ(r->header("content-type"), "application/json");
    EXPECT_EQ(r->header("accept"), "application/json, text/event-stream");
    EXPECT_EQ(r->header("missing"), "");
}

TEST(McpHttp, RefusesMalformedHeads) {
    EXPECT_FALSE(parse_request_head("POST /mcp"));
    EXPECT_FALSE(parse_request_head("POST /mcp HTTP/2.0"));
    EXPECT_FALSE(parse_request_head("PO ST /mcp HTTP/1.1"));
    EXPECT_FALSE(parse_request_head("POST /mcp HTTP/1.1\r\nNoColon"));
    EXPECT_FALSE(parse_request_head("POST /mcp HTTP/1.1\r\nBad Name: x"));
    EXPECT_FALSE(parse_request_head(""));
    // As the gateway's parser (which this one is): no whitespace before a
    // colon (RFC 9112 5.1), no folded line.
    EXPECT_FALSE(parse_request_head("POST /mcp HTTP/1.1\r\nHost : x"));
    EXPECT_FALSE(parse_request_head("POST /mcp HTTP/1.1\r\nA: b\r\n c"));
}

TEST(McpHttp, WritesAResponseHead) {
    EXPECT_EQ(response_head(401, {{"WWW-Authenticate", "Bearer"}}),
              "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\n\r\n");
}

TEST(McpHttp, BearerTokens) {
    const std::string token = "0123456789abcdef0123";
    EXPECT_TRUE(bearer_matches("Bearer " + token, token));
    EXPECT_TRUE(bearer_matches("bearer " + token, token));
    EXPECT_FALSE(bearer_matches("Bearer " + token + "x", token));
    EXPECT_FALSE(bearer_matches("Bearer " + token.substr(1), token));
    EXPECT_FALSE(bearer_matches("Basic " + token, token));
    EXPECT_FALSE(bearer_matches("", token));
    EXPECT_FALSE(bearer_matches("Bearer ", ""));
}

TEST(McpHttp, OriginsFromThisMachineOnly) {
    EXPECT_TRUE(origin_allowed("http://localhost:6274", {}));
    EXPECT_TRUE(origin_allowed("http://127.0.0.1", {}));
    EXPECT_TRUE(origin_allowed("https://[::1]:8443", {}));
    EXPECT_FALSE(origin_allowed("http://localhost.evil.example", {}));
    EXPECT_FALSE(origin_allowed("http://127.0.0.1.evil.example:80", {}));
    EXPECT_FALSE(origin_allowed("http://evil.example", {}));
    EXPECT_FALSE(origin_allowed("null", {}));
    EXPECT_TRUE(origin_allowed("https://agent.example", {"https://agent.example"}));
}

TEST(McpHttp, ListenAddresses) {
    auto a = parse_listen_address("127.0.0.1:8765");
    ASSERT_TRUE(a);
    EXPECT_EQ(a->port, 8765);
    EXPECT_TRUE(is_loopback(*a));
    a = parse_listen_address("[::1]:0");
    ASSERT_TRUE(a);
    EXPECT_TRUE(a->ipv6);
    EXPECT_TRUE(is_loopback(*a));
    a = parse_listen_address("localhost:1");
    ASSERT_TRUE(a);
    EXPECT_EQ(a->host, "127.0.0.1");
    EXPECT_FALSE(is_loopback(*parse_listen_address("0.0.0.0:80")));
    EXPECT_FALSE(is_loopback(*parse_listen_address("[::]:80")));
    EXPECT_FALSE(is_loopback(*parse_listen_address("10.0.0.1:80")));
    EXPECT_FALSE(parse_listen_address("example.com:80"));
    EXPECT_FALSE(parse_listen_address("127.0.0.1"));
    EXPECT_FALSE(parse_listen_address("127.0.0.1:99999"));
    EXPECT_FALSE(parse_listen_address("[::1]80"));
}

}  // namespace
}  // namespace cellblock::mcp
