// The metrics endpoint's HTTP: answers as values over bytes, and the real
// server on a loopback port (bad requests, oversized, wrong method, a slow
// client that sends nothing, the connection cap).
#include "metrics_http.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace cellblock {
namespace {

MetricsEndpoints fake_endpoints(bool ready = true) {
    MetricsEndpoints e;
    e.metrics = [](MetricsFormat format) {
        return format == MetricsFormat::openmetrics ? std::string("om\n# EOF\n")
                                                    : std::string("text\n");
    };
    e.healthz = [] { return HealthCheck{true, "ok: alive"}; };
    e.readyz = [ready] { return HealthCheck{ready, ready ? "ready" : "not ready: full"}; };
    return e;
}

HttpResponse answer(std::string_view bytes, const MetricsEndpoints& e = fake_endpoints()) {
    auto r = answer_http(bytes, e);
    EXPECT_TRUE(r.has_value()) << bytes;
    return r ? *r : HttpResponse{};
}

TEST(AnswerHttp, MetricsInTheFormatAsked) {
    const HttpResponse text = answer("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(text.status, 200);
    EXPECT_EQ(text.body, "text\n");
    EXPECT_EQ(text.content_type, "text/plain; version=0.0.4; charset=utf-8");
    const HttpResponse om = answer(
        "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,"
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n\r\n");
    EXPECT_EQ(om.body, "om\n# EOF\n");
    EXPECT_EQ(om.content_type, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    // A query string is not part of the path.
    EXPECT_EQ(answer("GET /metrics?x=1 HTTP/1.0\r\n\r\n").status, 200);
}

TEST(AnswerHttp, WireHasLengthAndClose) {
    const HttpResponse r = answer("GET /healthz HTTP/1.1\r\n\r\n");
    EXPECT_EQ(r.wire(),
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
              "Content-Length: 10\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
              "ok: alive\n");
    const HttpResponse head = answer("HEAD /metrics HTTP/1.1\r\n\r\n");
    EXPECT_TRUE(head.head_only);
    EXPECT_TRUE(
        head.wire().ends_with("Content-Length: 5\r\nConnection: close\r\n"
                              "Cache-Control: no-store\r\n\r\n"));
}

TEST(AnswerHttp, HealthAndReadinessCodes) {
    EXPECT_EQ(answer("GET /healthz HTTP/1.1\r\n\r\n").status, 200);
    EXPECT_EQ(answer("GET /readyz HTTP/1.1\r\n\r\n").status, 200);
    const HttpResponse not_ready = answer("GET /readyz HTTP/1.1\r\n\r\n", fake_endpoints(false));
    EXPECT_EQ(not_ready.status, 503);
    EXPECT_EQ(not_ready.body, "not ready: full\n");
    MetricsEndpoints throwing = fake_endpoints();
    throwing.healthz = []() -> HealthCheck { throw std::runtime_error("boom"); };
    EXPECT_EQ(answer("GET /healthz HTTP/1.1\r\n\r\n", throwing).status, 503);
}

TEST(AnswerHttp, IncompleteUntilTheBlankLine) {
    EXPECT_FALSE(answer_http("GET /metrics HTTP/1.1\r\n", fake_endpoints()).has_value());
    EXPECT_FALSE(answer_http("", fake_endpoints()).has_value());
    EXPECT_FALSE(answer_http("GE", fake_endpoints()).has_value());
}

TEST(AnswerHttp, Refusals) {
    const HttpResponse post = answer("POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    EXPECT_EQ(post.status, 405);
    ASSERT_EQ(post.headers.size(), 1U);
    EXPECT_EQ(post.headers[0], (std::pair<std::string, std::string>("Allow", "GET, HEAD")));
    EXPECT_EQ(answer("DELETE /healthz HTTP/1.1\r\n\r\n").status, 405);
    const HttpResponse missing = answer("GET /admin HTTP/1.1\r\n\r\n");
    EXPECT_EQ(missing.status, 404);
    EXPECT_NE(missing.body.find("/metrics"), std::string::npos);
    EXPECT_EQ(answer("GET /metrics HTTP/2.0\r\n\r\n").status, 505);
    EXPECT_EQ(answer("garbage\r\n\r\n").status, 400);
    EXPECT_EQ(answer("GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n").status, 400);
    EXPECT_EQ(answer("GET /metrics HTTP/1.1\r\nBad\x01: x\r\n\r\n").status, 400);
}

TEST(AnswerHttp, OversizedHead) {
    MetricsHttpLimits limits;
    limits.max_request_bytes = 256;
    std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(300, 'a');
    const auto r = answer_http(big, fake_endpoints(), limits);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status, 431);
    // Many small headers, no blank line: refused once the bound is reached.
    std::string many = "GET /metrics HTTP/1.1\r\n";
    while (many.size() < 300) many += "X: y\r\n";
    const auto r2 = answer_http(many, fake_endpoints(), limits);
    ASSERT_TRUE(r2.has_value());
    EXPECT_EQ(r2->status, 431);
}

TEST(NegotiateFormat, ByQuality) {
    EXPECT_EQ(negotiate_format(""), MetricsFormat::prometheus_text);
    EXPECT_EQ(negotiate_format("*/*"), MetricsFormat::prometheus_text);
    EXPECT_EQ(negotiate_format("application/openmetrics-text"), MetricsFormat::openmetrics);
    EXPECT_EQ(negotiate_format("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"),
              MetricsFormat::prometheus_text);
    EXPECT_EQ(negotiate_format("application/openmetrics-text;q=0"), MetricsFormat::prometheus_text);
    EXPECT_EQ(negotiate_format("Application/OpenMetrics-Text; version=0.0.1"),
              MetricsFormat::openmetrics);
}

TEST(ParseListenAddress, Forms) {
    auto a = parse_listen_address("9464");
    EXPECT_EQ(a.host, "127.0.0.1");
    EXPECT_EQ(a.port, 9464);
    a = parse_listen_address(":9100");
    EXPECT_EQ(a.host, "127.0.0.1");
    EXPECT_EQ(a.port, 9100);
    a = parse_listen_address("0.0.0.0:80");
    EXPECT_EQ(a.host, "0.0.0.0");
    a = parse_listen_address("[::1]:0");
    EXPECT_EQ(a.host, "::1");
    EXPECT_EQ(a.port, 0);
    EXPECT_THROW(parse_listen_address("::1:80"), std::invalid_argument);
    EXPECT_THROW(parse_listen_address("host:99999"), std::invalid_argument);
    EXPECT_THROW(parse_listen_address("host:"), std::invalid_argument);
    EXPECT_THROW(parse_listen_address("host:abc"), std::invalid_argument);
}

// --- the server on a loopback port ---

int connect_to(const std::string& address) {
    const auto colon = address.rfind(':');
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}

// Sends `request` and reads until the server closes (at most `wait`).
std::string http_round_trip(const std::string& address, const std::string& request,
                            std::chrono::milliseconds wait = std::chrono::milliseconds(3000)) {
    UniqueFd fd(connect_to(address));
    if (!fd) return "connect failed";
    if (!request.empty()) ::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL);
    std::string out;
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
        pollfd p{fd.get(), POLLIN, 0};
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                              until - std::chrono::steady_clock::now())
                              .count();
        if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
        char buffer[4096];
        const ssize_t n = ::recv(fd.get(), buffer, sizeof buffer, 0);
        if (n <= 0) break;
        out.append(buffer, static_cast<std::size_t>(n));
    }
    return out;
}

TEST(MetricsHttpServer, ServesOnLoopback) {
    MetricsHttpServer server({"127.0.0.1", 0}, fake_endpoints());
    ASSERT_TRUE(server.address().starts_with("127.0.0.1:"));
    const std::string r =
        http_round_trip(server.address(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK\r\n")) << r;
    EXPECT_TRUE(r.ends_with("\r\n\r\ntext\n")) << r;
    EXPECT_TRUE(http_round_trip(server.address(), "PUT /metrics HTTP/1.1\r\n\r\n")
                    .starts_with("HTTP/1.1 405 "));
    EXPECT_TRUE(http_round_trip(server.address(), "GET /nope HTTP/1.1\r\n\r\n")
                    .starts_with("HTTP/1.1 404 "));
    const std::string huge = "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n";
    EXPECT_TRUE(http_round_trip(server.address(), huge).starts_with("HTTP/1.1 431 "));
}

TEST(MetricsHttpServer, ASilentClientTimesOutWithoutHoldingOthers) {
    MetricsHttpLimits limits;
    limits.request_timeout = std::chrono::milliseconds(300);
    limits.max_connections = 2;
    MetricsHttpServer server({"127.0.0.1", 0}, fake_endpoints(), limits);
    UniqueFd silent(connect_to(server.address()));
    ASSERT_TRUE(silent);
    // Served while the silent one hangs.
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(http_round_trip(server.address(), "GET /healthz HTTP/1.1\r\n\r\n")
                    .starts_with("HTTP/1.1 200 "));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
    // The silent one is told 408 and closed at its deadline.
    std::string told;
    char buffer[512];
    pollfd p{silent.get(), POLLIN, 0};
    if (::poll(&p, 1, 2000) > 0) {
        const ssize_t n = ::recv(silent.get(), buffer, sizeof buffer, 0);
        if (n > 0) told.assign(buffer, static_cast<std::size_t>(n));
    }
    EXPECT_TRUE(told.starts_with("HTTP/1.1 408 ")) << told;
}

TEST(MetricsHttpServer, ConnectionsPastTheCapAreRefused) {
    MetricsHttpLimits limits;
    limits.max_connections = 2;
    MetricsHttpServer server({"127.0.0.1", 0}, fake_endpoints(), limits);
    UniqueFd a(connect_to(server.address())), b(connect_to(server.address()));
    ASSERT_TRUE(a && b);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both accepted
    EXPECT_TRUE(http_round_trip(server.address(), "GET /healthz HTTP/1.1\r\n\r\n")
                    .starts_with("HTTP/1.1 503 "));
    a.reset();
    b.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_TRUE(http_round_trip(server.address(), "GET /healthz HTTP/1.1\r\n\r\n")
                    .starts_with("HTTP/1.1 200 "));
}

TEST(MetricsHttpServer, BindErrorNamesTheAddress) {
    MetricsHttpServer first({"127.0.0.1", 0}, fake_endpoints());
    const int port = std::stoi(first.address().substr(first.address().rfind(':') + 1));
    try {
        MetricsHttpServer second({"127.0.0.1", port}, fake_endpoints());
        FAIL() << "bound twice";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)),
                  std::string::npos)
            << e.what();
    }
}

}  // namespace
}  // namespace cellblock
