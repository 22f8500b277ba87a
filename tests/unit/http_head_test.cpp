// The gateway's HTTP head: parsed, judged and forwarded as values over bytes.
#include "http_head.hpp"

#include <string>

#include <gtest/gtest.h>

namespace cellblock::gateway {
namespace {

using Status = HeadParse::Status;

HttpRequestHead complete(std::string_view buffer, const HttpLimits& limits = {}) {
    const HeadParse parse = parse_request_head(buffer, limits);
    EXPECT_EQ(parse.status, Status::complete) << parse.error;
    return parse.head;
}

// The status of the error `buffer` gives (fails the test if it is not one).
int error_status(std::string_view buffer, const HttpLimits& limits = {}) {
    const HeadParse parse = parse_request_head(buffer, limits);
    EXPECT_EQ(parse.status, Status::error) << buffer;
    EXPECT_FALSE(parse.error.empty());
    return parse.error_status;
}

HttpRequestHead request(std::string method, std::string target,
                        std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpRequestHead head;
    head.method = std::move(method);
    head.target = std::move(target);
    head.version = "HTTP/1.1";
    head.headers = std::move(headers);
    return head;
}

ProxyTarget target_of(std::string method, std::string target) {
    const TargetParse parse = proxy_target(request(std::move(method), std::move(target)));
    EXPECT_TRUE(parse.ok) << parse.error;
    return parse.target;
}

std::string target_error(std::string method, std::string target) {
    const TargetParse parse = proxy_target(request(std::move(method), std::move(target)));
    EXPECT_FALSE(parse.ok);
    EXPECT_EQ(parse.error_status, 400);
    return parse.error;
}

// ---- parse_request_head ----

TEST(ParseRequestHead, CompleteConnect) {
    const std::string buffer =
        "CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com\r\n"
        "User-Agent:  curl/8.0 \r\n\r\n";
    const HttpRequestHead head = complete(buffer);
    EXPECT_EQ(head.method, "CONNECT");
    EXPECT_EQ(head.target, "api.example.com:443");
    EXPECT_EQ(head.version, "HTTP/1.1");
    ASSERT_EQ(head.headers.size(), 2U);
    EXPECT_EQ(head.headers[0].first, "Host");
    EXPECT_EQ(head.headers[0].second, "api.example.com");
    EXPECT_EQ(head.headers[1].first, "User-Agent");
    EXPECT_EQ(head.headers[1].second, "curl/8.0");
    EXPECT_EQ(head.head_bytes, buffer.size());
}

TEST(ParseRequestHead, BodyAfterTheHeadIsNotPartOfIt) {
    const std::string head_text =
        "POST http://example.com/up HTTP/1.0\r\nContent-Length: 11\r\nX-Empty:\r\n\r\n";
    const HttpRequestHead head = complete(head_text + "hello\r\n\r\nGET");
    EXPECT_EQ(head.head_bytes, head_text.size());
    EXPECT_EQ(head.version, "HTTP/1.0");
    ASSERT_EQ(head.headers.size(), 2U);
    EXPECT_EQ(head.headers[1].first, "X-Empty");
    EXPECT_EQ(head.headers[1].second, "");
}

TEST(ParseRequestHead, LfOnlyLines) {
    const std::string buffer = "GET http://example.com/ HTTP/1.1\nHost: example.com\n\nbody";
    const HttpRequestHead head = complete(buffer);
    EXPECT_EQ(head.head_bytes, buffer.size() - 4);
    ASSERT_EQ(head.headers.size(), 1U);
    EXPECT_EQ(head.headers[0].second, "example.com");
    EXPECT_EQ(complete("GET / HTTP/1.1\r\nA: b\n\r\n").head_bytes, 23U);
}

TEST(ParseRequestHead, IncompleteUntilTheBlankLine) {
    const std::string full = "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n";
    for (std::size_t n = 0; n < full.size(); ++n) {
        const HeadParse parse = parse_request_head(full.substr(0, n));
        EXPECT_EQ(parse.status, Status::incomplete) << n << ": " << parse.error;
    }
    EXPECT_EQ(parse_request_head(full).status, Status::complete);
}

TEST(ParseRequestHead, MalformedRequestLines) {
    for (const char* bad :
         {"\r\n\r\n", "\n\n", "GET\r\n\r\n", "GET /\r\n\r\n", "GET  / HTTP/1.1\r\n\r\n",
          "GET / HTTP/1.1 \r\n\r\n", " GET / HTTP/1.1\r\n\r\n", "GET / x HTTP/1.1\r\n\r\n",
          "G(T / HTTP/1.1\r\n\r\n", "GET / HTTP/1.x\r\n\r\n", "GET / http/1.1\r\n\r\n",
          "GET / HTTP/11\r\n\r\n", "GET /\x01 HTTP/1.1\r\n\r\n", "GET /\xff HTTP/1.1\r\n\r\n",
          "GET /\r HTTP/1.1\r\n\r\n"}) {
        EXPECT_EQ(error_status(bad), 400) << bad;
    }
}

TEST(ParseRequestHead, OtherVersionsAre505) {
    EXPECT_EQ(error_status("GET / HTTP/2.0\r\n\r\n"), 505);
    EXPECT_EQ(error_status("GET / HTTP/0.9\r\n\r\n"), 505);
    EXPECT_EQ(error_status("GET / HTTP/1.2\r\n\r\n"), 505);
    const HeadParse parse = parse_request_head("GET / HTTP/2.0\r\n\r\n");
    EXPECT_NE(parse.error.find("HTTP/2.0"), std::string::npos) << parse.error;
}

TEST(ParseRequestHead, ErrorsNeedNoBlankLine) {
    // A bad line is refused as soon as it is complete.
    EXPECT_EQ(error_status("GET / HTTP/2.0\r\n"), 505);
    EXPECT_EQ(error_status("GET / HTTP/1.1\r\nno colon\r\n"), 400);
}

TEST(ParseRequestHead, BadHeaderLines) {
    const std::string line = "GET http://a.com/ HTTP/1.1\r\n";
    for (const char* bad :
         {"no colon\r\n\r\n", "Name : value\r\n\r\n", "Name\t: value\r\n\r\n",
          ": empty name\r\n\r\n", "Na me: value\r\n\r\n", "A: b\r\n folded\r\n\r\n",
          "A: b\r\n\tfolded\r\n\r\n", "A: b\x01 c\r\n\r\n", "A: b\x7f\r\n\r\n", "A: b\rc\r\n\r\n",
          "A: b\r\r\n\r\n"}) {
        EXPECT_EQ(error_status(line + bad), 400) << bad;
    }
    // A tab inside a value and bytes above 0x7f (obs-text) are allowed.
    const HttpRequestHead head = complete(line + "A: b\tc\r\nB: caf\xc3\xa9\r\n\r\n");
    EXPECT_EQ(head.headers[0].second, "b\tc");
    EXPECT_EQ(head.headers[1].second, "caf\xc3\xa9");
}

TEST(ParseRequestHead, NulInAHeaderIsRefused) {
    EXPECT_EQ(error_status(std::string("GET / HTTP/1.1\r\nA: b\0c\r\n\r\n", 26)), 400);
    EXPECT_EQ(error_status(std::string("GET / HTTP/1.1\r\nA\0: b\r\n\r\n", 25)), 400);
}

TEST(ParseRequestHead, LongLineIs431) {
    HttpLimits limits;
    limits.max_line_bytes = 40;
    const std::string line = "GET / HTTP/1.1\r\n";
    const std::string at_limit = "A: " + std::string(37, 'x') + "\r\n";
    EXPECT_EQ(parse_request_head(line + at_limit + "\r\n", limits).status, Status::complete);
    const std::string over = "A: " + std::string(38, 'x') + "\r\n";
    EXPECT_EQ(error_status(line + over + "\r\n", limits), 431);
    // Before the line ends, and before the head does.
    EXPECT_EQ(error_status(line + "A: " + std::string(38, 'x'), limits), 431);
    EXPECT_EQ(parse_request_head(line + "A: " + std::string(37, 'x') + "\r", limits).status,
              Status::incomplete);
    EXPECT_EQ(error_status("GET /" + std::string(40, 'x') + " HTTP/1.1\r\n\r\n", limits), 431);
}

TEST(ParseRequestHead, TooManyHeadersIs431) {
    HttpLimits limits;
    limits.max_headers = 3;
    std::string buffer = "GET / HTTP/1.1\r\n";
    for (int i = 0; i < 3; ++i) buffer += "H" + std::to_string(i) + ": v\r\n";
    EXPECT_EQ(complete(buffer + "\r\n", limits).headers.size(), 3U);
    EXPECT_EQ(error_status(buffer + "H3: v\r\n\r\n", limits), 431);
    EXPECT_EQ(error_status(buffer + "H3: v\r\n", limits), 431);
}

TEST(ParseRequestHead, TooLargeHeadIs431) {
    HttpLimits limits;
    limits.max_head_bytes = 64;
    const std::string buffer = "GET / HTTP/1.1\r\nA: " + std::string(41, 'x') + "\r\n\r\n";
    ASSERT_EQ(buffer.size(), 64U);  // exactly the limit
    EXPECT_EQ(complete(buffer + "body", limits).head_bytes, 64U);
    const std::string over = "GET / HTTP/1.1\r\nA: " + std::string(42, 'x') + "\r\n\r\n";
    EXPECT_EQ(error_status(over, limits), 431);
    // No blank line by the limit: an error, not incomplete.
    EXPECT_EQ(error_status(over.substr(0, 64), limits), 431);
    EXPECT_EQ(parse_request_head(over.substr(0, 63), limits).status, Status::incomplete);
    EXPECT_EQ(error_status(std::string(100, '\n'), limits), 400);  // empty request line first
}

TEST(ParseRequestHead, DefaultLimits) {
    EXPECT_EQ(error_status("GET / HTTP/1.1\r\nA: " + std::string(8 * 1024, 'x') + "\r\n\r\n"), 431);
    std::string many = "GET / HTTP/1.1\r\n";
    for (int i = 0; i < 101; ++i) many += "H: v\r\n";
    EXPECT_EQ(error_status(many + "\r\n"), 431);
    std::string large = "GET / HTTP/1.1\r\n";
    for (int i = 0; i < 3; ++i) large += "A: " + std::string(6000, 'x') + "\r\n";
    EXPECT_EQ(error_status(large), 431);
}

// ---- proxy_target ----

TEST(ProxyTarget, ConnectHostAndPort) {
    const ProxyTarget t = target_of("CONNECT", "API.Example.com:443");
    EXPECT_TRUE(t.tunnel);
    EXPECT_EQ(t.host, "api.example.com");
    EXPECT_EQ(t.port, 443);
    EXPECT_EQ(t.origin_form, "");
    const ProxyTarget v6 = target_of("CONNECT", "[2001:DB8::1]:8443");
    EXPECT_EQ(v6.host, "2001:db8::1");
    EXPECT_EQ(v6.port, 8443);
    EXPECT_EQ(target_of("CONNECT", "192.0.2.1:1").host, "192.0.2.1");
}

TEST(ProxyTarget, ConnectNeedsAValidPort) {
    EXPECT_EQ(target_error("CONNECT", "example.com"), "CONNECT needs host:port: no port");
    EXPECT_EQ(target_error("CONNECT", "[::1]"), "CONNECT needs host:port: no port");
    for (const char* bad :
         {"example.com:", "example.com:0", "example.com:65536", "example.com:https",
          "example.com:-1", "example.com:+443", "example.com:4430000", "[::1]443", "[::1:443",
          "::1:443", ":443", "bad_host!:443", "[example.com]:443", "http://example.com:443",
          "127.1:443"}) {
        EXPECT_TRUE(target_error("CONNECT", bad).starts_with("CONNECT needs host:port")) << bad;
    }
}

TEST(ProxyTarget, AbsoluteHttpUrl) {
    const ProxyTarget t = target_of("GET", "http://Example.com/a/b?q=1&r=2");
    EXPECT_FALSE(t.tunnel);
    EXPECT_EQ(t.host, "example.com");
    EXPECT_EQ(t.port, 80);
    EXPECT_EQ(t.origin_form, "/a/b?q=1&r=2");
    const ProxyTarget with_port = target_of("POST", "HTTP://example.com:8080/x");
    EXPECT_EQ(with_port.port, 8080);
    EXPECT_EQ(with_port.origin_form, "/x");
    EXPECT_EQ(target_of("GET", "http://example.com").origin_form, "/");
    EXPECT_EQ(target_of("GET", "http://example.com?q").origin_form, "/?q");
    EXPECT_EQ(target_of("GET", "http://example.com/p#frag").origin_form, "/p");
    const ProxyTarget v6 = target_of("GET", "http://[::1]:81/");
    EXPECT_EQ(v6.host, "::1");
    EXPECT_EQ(v6.port, 81);
    EXPECT_EQ(target_of("GET", "http://[::1]/").port, 80);
}

TEST(ProxyTarget, RefusedUrls) {
    EXPECT_EQ(target_error("GET", "http://user:pw@example.com/"),
              "userinfo (user@) in the URL is refused");
    EXPECT_EQ(target_error("GET", "http://allowed.com\\@evil.com/"),
              "userinfo (user@) in the URL is refused");
    const std::string https = target_error("GET", "https://example.com/");
    EXPECT_NE(https.find("CONNECT"), std::string::npos) << https;
    EXPECT_EQ(target_error("GET", "/index.html"),
              "not a proxy request: send an absolute http:// URL");
    EXPECT_EQ(target_error("OPTIONS", "*"), "not a proxy request: send an absolute http:// URL");
    EXPECT_NE(target_error("GET", "ftp://example.com/").find("'ftp://'"), std::string::npos);
    for (const char* bad :
         {"http://", "http:///x", "http://example.com:0/", "http://example.com:65536/",
          "http://example.com:/", "http://ex%61mple.com/", "http://a..b/", "http://::1/",
          "http://[::1/", "http://[::1]x/", "http://0x7f000001/"}) {
        EXPECT_FALSE(proxy_target(request("GET", bad)).ok) << bad;
    }
}

// ---- forward_head ----

TEST(ForwardHead, OriginFormAndHostAndConnectionClose) {
    const HttpRequestHead head =
        request("GET", "http://example.com:8080/p?q", {{"Accept", "*/*"}, {"X-Trace", "1"}});
    const std::string out = forward_head(head, proxy_target(head).target);
    EXPECT_EQ(out,
              "GET /p?q HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nX-Trace: 1\r\n"
              "Connection: close\r\n\r\n");
}

TEST(ForwardHead, AddsHostWhenMissingAndOnDefaultPortOmitsIt) {
    const HttpRequestHead head = request("GET", "http://example.com/", {});
    EXPECT_EQ(forward_head(head, proxy_target(head).target),
              "GET / HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n");
    const HttpRequestHead v6 = request("GET", "http://[2001:db8::1]:81/", {});
    EXPECT_EQ(forward_head(v6, proxy_target(v6).target),
              "GET / HTTP/1.1\r\nHost: [2001:db8::1]:81\r\nConnection: close\r\n\r\n");
}

TEST(ForwardHead, ClientHostIsReplacedByTheTarget) {
    const HttpRequestHead head =
        request("GET", "http://allowed.example/", {{"host", "forbidden.example"}, {"HOST", "x"}});
    const std::string out = forward_head(head, proxy_target(head).target);
    EXPECT_EQ(out, "GET / HTTP/1.1\r\nHost: allowed.example\r\nConnection: close\r\n\r\n");
}

TEST(ForwardHead, StripsHopByHopHeaders) {
    const HttpRequestHead head = request("POST", "http://example.com/",
                                         {{"Connection", "keep-alive, X-Secret ,x-other"},
                                          {"proxy-connection", "keep-alive"},
                                          {"Proxy-Authorization", "Basic Zm9vOmJhcg=="},
                                          {"Keep-Alive", "timeout=5"},
                                          {"TE", "trailers"},
                                          {"Trailer", "X-Sum"},
                                          {"Upgrade", "websocket"},
                                          {"x-secret", "1"},
                                          {"X-Other", "2"},
                                          {"Content-Length", "3"},
                                          {"X-Kept", "yes"}});
    const std::string out = forward_head(head, proxy_target(head).target);
    EXPECT_EQ(out,
              "POST / HTTP/1.1\r\nHost: example.com\r\nContent-Length: 3\r\nX-Kept: yes\r\n"
              "Connection: close\r\n\r\n");
}

TEST(ForwardHead, ConnectionCannotRemoveFramingOrHost) {
    const HttpRequestHead head = request("POST", "http://example.com/",
                                         {{"Connection", "Content-Length, transfer-encoding, host"},
                                          {"Content-Length", "3"},
                                          {"Transfer-Encoding", "chunked"}});
    const std::string out = forward_head(head, proxy_target(head).target);
    EXPECT_EQ(out,
              "POST / HTTP/1.1\r\nHost: example.com\r\nContent-Length: 3\r\n"
              "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
}

TEST(ForwardHead, ParsesBackAsAHead) {
    const std::string client =
        "PUT http://example.com:81/x HTTP/1.0\r\nConnection: foo\r\nFoo: 1\r\nBar: 2\r\n\r\n";
    const HttpRequestHead head = complete(client);
    const std::string out = forward_head(head, proxy_target(head).target);
    const HttpRequestHead again = complete(out);
    EXPECT_EQ(again.head_bytes, out.size());
    EXPECT_EQ(again.method, "PUT");
    EXPECT_EQ(again.target, "/x");
    EXPECT_EQ(again.version, "HTTP/1.1");
    ASSERT_EQ(again.headers.size(), 3U);
    EXPECT_EQ(again.headers[0], (std::pair<std::string, std::string>{"Host", "example.com:81"}));
    EXPECT_EQ(again.headers[1], (std::pair<std::string, std::string>{"Bar", "2"}));
    EXPECT_EQ(again.headers[2], (std::pair<std::string, std::string>{"Connection", "close"}));
}

// ---- error_response and response_status ----

TEST(ErrorResponse, IsAValidResponseWithTheRightLength) {
    const std::string r = error_response(403, "api.example.com:443 is not in network.allow");
    const std::string body = "api.example.com:443 is not in network.allow\n";
    EXPECT_EQ(r,
              "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
              "Content-Length: " +
                  std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
    EXPECT_EQ(response_status(r), 403);
}

TEST(ErrorResponse, BodyKeepsItsNewlineAndReasonsAreKnown) {
    const std::string r = error_response(502, "upstream refused\n");
    EXPECT_TRUE(r.starts_with("HTTP/1.1 502 Bad Gateway\r\n")) << r;
    EXPECT_NE(r.find("Content-Length: 17\r\n"), std::string::npos) << r;
    EXPECT_TRUE(r.ends_with("\r\n\r\nupstream refused\n"));
    EXPECT_TRUE(
        error_response(431, "").starts_with("HTTP/1.1 431 Request Header Fields Too Large"));
    EXPECT_TRUE(
        error_response(431, "").ends_with("Content-Length: 1\r\nConnection: close\r\n\r\n\n"));
    EXPECT_TRUE(error_response(505, "x").starts_with("HTTP/1.1 505 HTTP Version Not Supported"));
    EXPECT_TRUE(error_response(400, "x").starts_with("HTTP/1.1 400 Bad Request"));
    EXPECT_TRUE(error_response(504, "x").starts_with("HTTP/1.1 504 Gateway Timeout"));
}

TEST(ResponseStatus, StatusLines) {
    EXPECT_EQ(response_status("HTTP/1.1 200 OK\r\n"), 200);
    EXPECT_EQ(response_status("HTTP/1.0 407 Proxy Authentication Required\r\n\r\n"), 407);
    EXPECT_EQ(response_status("HTTP/1.1 204\r\n"), 204);
    EXPECT_EQ(response_status("HTTP/1.1 200\n"), 200);
    EXPECT_EQ(response_status("HTTP/2.0 503 x"), 503);
}

TEST(ResponseStatus, NotStatusLines) {
    for (const char* bad :
         {"", "HTTP/1.1", "HTTP/1.1 200", "HTTP/1.1 20 OK", "HTTP/1.1 2000 OK", "HTTP/1.1 abc OK",
          "http/1.1 200 OK", "HTTP/1.1  200 OK", "HTTP/11 200 OK", "HTTP/1.1 099 x",
          "SSH-2.0-OpenSSH\r\n", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x00\x00"}) {
        EXPECT_EQ(response_status(bad), 0) << bad;
    }
}

// ---- body framing (no smuggling past the one request) ----

TEST(BodyFraming, NoneLengthOrChunked) {
    EXPECT_EQ(body_framing(request("GET", "/")).kind, BodyFraming::Kind::none);
    const BodyFraming length = body_framing(request("POST", "/", {{"Content-Length", "12"}}));
    ASSERT_TRUE(length.ok);
    EXPECT_EQ(length.kind, BodyFraming::Kind::length);
    EXPECT_EQ(length.length, 12U);
    // The same length twice is one length.
    EXPECT_TRUE(
        body_framing(request("POST", "/", {{"Content-Length", "5"}, {"content-length", "5"}})).ok);
    EXPECT_EQ(body_framing(request("POST", "/", {{"Transfer-Encoding", "Chunked"}})).kind,
              BodyFraming::Kind::chunked);
}

TEST(BodyFraming, AmbiguousFramingIsRefused) {
    for (const auto& headers : std::vector<std::vector<std::pair<std::string, std::string>>>{
             {{"Content-Length", "5"}, {"Transfer-Encoding", "chunked"}},
             {{"Content-Length", "5"}, {"Content-Length", "6"}},
             {{"Content-Length", "-1"}},
             {{"Content-Length", "5 5"}},
             {{"Content-Length", "99999999999999999999"}},
             {{"Transfer-Encoding", "gzip, chunked"}},
             {{"Transfer-Encoding", "chunked"}, {"Transfer-Encoding", "chunked"}},
         }) {
        const BodyFraming framing = body_framing(request("POST", "/", headers));
        EXPECT_FALSE(framing.ok) << headers[0].first << ": " << headers[0].second;
        EXPECT_FALSE(framing.error.empty());
    }
}

TEST(ChunkedScanner, FindsTheEndAndNothingPastIt) {
    const std::string body = "4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-Trailer: 1\r\n\r\n";
    const std::string smuggled = "GET /admin HTTP/1.1\r\nHost: other\r\n\r\n";
    ChunkedScanner whole;
    EXPECT_EQ(whole.feed(body + smuggled), body.size());
    EXPECT_TRUE(whole.done());
    // Byte by byte, the same end.
    ChunkedScanner bytes;
    std::size_t taken = 0;
    for (char c : body + smuggled) taken += bytes.feed(std::string_view(&c, 1));
    EXPECT_EQ(taken, body.size());
    EXPECT_TRUE(bytes.done());
}

TEST(ChunkedScanner, MalformedOrUnboundedFails) {
    for (const std::string& bad :
         {std::string("zz\r\n"), std::string("4\r\nWikiXX"), std::string("4 4\r\n"),
          std::string(2000, '1'), std::string("1\rx\n"), std::string("fffffffffffffffff\r\n")}) {
        ChunkedScanner scanner;
        scanner.feed(bad);
        EXPECT_TRUE(scanner.failed()) << bad.substr(0, 20);
        EXPECT_EQ(scanner.feed("0\r\n\r\n"), 0U);
    }
    ChunkedScanner trailers;
    std::string many = "0\r\n";
    for (int i = 0; i < 200; ++i) many += "T: x\r\n";
    trailers.feed(many);
    EXPECT_TRUE(trailers.failed());
}

TEST(HttpReasonPhrase, OneTableForEveryAnswer) {
    // What the gateway, the metrics endpoint and cellblock mcp answer with.
    EXPECT_EQ(http_reason_phrase(200), "OK");
    EXPECT_EQ(http_reason_phrase(202), "Accepted");
    EXPECT_EQ(http_reason_phrase(401), "Unauthorized");
    EXPECT_EQ(http_reason_phrase(407), "Proxy Authentication Required");
    EXPECT_EQ(http_reason_phrase(413), "Content Too Large");
    EXPECT_EQ(http_reason_phrase(505), "HTTP Version Not Supported");
    EXPECT_EQ(http_reason_phrase(299), "Error");
    EXPECT_TRUE(
        error_response(431, "x").starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
}

}  // namespace
}  // namespace cellblock::gateway
