// `serve --metrics ADDR:PORT`: a small HTTP/1.1 server for operators on a
// thread of its own, so that a slow or stuck scraper never holds the relay's
// loop. /metrics (Prometheus text 0.0.4, or OpenMetrics 1.0 when the Accept
// header asks for it), /healthz and /readyz. One request per connection
// (Connection: close); requests bounded in size and time; GET and HEAD only.
// answer_http() is the whole protocol as a pure function (unit-tested in
// tests/unit/metrics_http_test.cpp); MetricsHttpServer only moves bytes.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "cellblock/unique_fd.hpp"
#include "metrics_registry.hpp"

namespace cellblock {

// A health or readiness verdict, with the text that says why.
struct HealthCheck {
    bool ok = false;
    std::string text;  // a line per check
};

// What the endpoints answer; called on the endpoint's thread.
struct MetricsEndpoints {
    std::function<std::string(MetricsFormat)> metrics;
    std::function<HealthCheck()> healthz;
    std::function<HealthCheck()> readyz;
};

struct MetricsHttpLimits {
    std::size_t max_request_bytes = 8 * 1024;         // the request head; a larger one gets 431
    std::chrono::milliseconds request_timeout{5000};  // from accept to the whole head: else 408
    std::chrono::milliseconds write_timeout{10000};   // to send the answer: else closed
    std::size_t max_connections = 16;                 // more are answered 503 and closed
};

struct HttpResponse {
    int status = 200;
    std::string content_type = "text/plain; charset=utf-8";
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;  // beside the usual ones
    bool head_only = false;  // a HEAD request: the head, with the body's length
    // The bytes on the wire: status line, Content-Type, Content-Length,
    // Connection: close, the extra headers, and the body (unless head_only).
    std::string wire() const;
};

// A response for `status` with a text body (a line ending "\n" added if missing).
HttpResponse text_response(int status, std::string_view body);

// Which format a scrape's Accept header prefers: OpenMetrics when it lists
// application/openmetrics-text with a q above that of text/plain (or any
// other type), the 0.0.4 text otherwise.
MetricsFormat negotiate_format(std::string_view accept);

// The answer to the bytes received on a connection so far; nullopt while
// the request head is incomplete and within the limits. 400 on a malformed
// request, 431 when the head passes max_request_bytes, 505 for a version
// other than HTTP/1.x, 405 (Allow: GET, HEAD) for other methods, 404 for
// other paths.
std::optional<HttpResponse> answer_http(std::string_view received,
                                        const MetricsEndpoints& endpoints,
                                        const MetricsHttpLimits& limits = {});

// "9464" or ":9464" (127.0.0.1), "ADDR:PORT", "[V6ADDR]:PORT". Throws
// std::invalid_argument saying what is wrong.
struct ListenAddress {
    std::string host;
    int port = 0;
};
ListenAddress parse_listen_address(const std::string& text);

class MetricsHttpServer {
  public:
    // Binds (port 0: a free port) and starts serving. Throws
    // std::runtime_error naming the address when it cannot bind.
    MetricsHttpServer(const ListenAddress& address, MetricsEndpoints endpoints,
                      MetricsHttpLimits limits = {});
    // Stops the thread; open connections are closed.
    ~MetricsHttpServer();
    MetricsHttpServer(const MetricsHttpServer&) = delete;
    MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

    // "127.0.0.1:9464", with the port bound.
    const std::string& address() const { return address_; }

  private:
    void serve();
    MetricsEndpoints endpoints_;
    MetricsHttpLimits limits_;
    UniqueFd listener_;
    UniqueFd stop_;  // an eventfd: written to end serve()
    std::string address_;
    std::thread thread_;
};

}  // namespace cellblock
