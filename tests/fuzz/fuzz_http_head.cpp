// Fuzzes the egress gateway's request head (gateway/http_head.cpp), the bytes
// a sandbox sends before the gateway connects anywhere:
// - parse_request_head, with the default limits and with small ones (so every
//   limit is reachable with short inputs): a complete head ends in its blank
//   line inside the buffer and the limits, every shorter prefix of it is
//   incomplete, an error has a 400, 431 or 505 and a reason, an incomplete
//   buffer is shorter than max_head_bytes;
// - proxy_target on a complete head: a target has a normalised host (that
//   normalise_host leaves alone) and a port of 1-65535, a tunnel exactly for
//   CONNECT, an origin-form starting with '/' otherwise;
// - forward_head on a plain HTTP target: it parses back as one complete head
//   with the origin-form, HTTP/1.1, one Host, no hop-by-hop header and
//   "Connection: close" last;
// - error_response with the parse's or the target's error: response_status
//   reads its status back and Content-Length is the body's length;
// - normalise_host and HostPattern::parse on the raw input: idempotent, and
//   only PolicyError escapes; a pattern's to_string parses back and covers itself.
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>
#include <typeinfo>

#include "cellblock/egress_rules.hpp"
#include "cellblock/session_policy.hpp"
#include "fuzz_support.hpp"
#include "http_head.hpp"

namespace cellblock::fuzz {
namespace {

using gateway::HeadParse;
using gateway::HttpLimits;
using gateway::HttpRequestHead;

bool iequals(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(a[i])) !=
            std::tolower(static_cast<unsigned char>(b[i]))) {
            return false;
        }
    }
    return true;
}

void check_response(int status, const std::string& body) {
    const std::string response = gateway::error_response(status, body);
    FUZZ_CHECK(gateway::response_status(response) == status, "error_response(%d) reads back as %d",
               status, gateway::response_status(response));
    const std::size_t end = response.find("\r\n\r\n");
    FUZZ_CHECK(end != std::string::npos, "error_response has no blank line");
    const std::size_t body_bytes = response.size() - end - 4;
    const std::string length = "Content-Length: " + std::to_string(body_bytes) + "\r\n";
    FUZZ_CHECK(response.find(length) != std::string::npos && response.back() == '\n',
               "Content-Length is not the body's %zu bytes", body_bytes);
}

void check_forward(const HttpRequestHead& head, const gateway::ProxyTarget& target) {
    const std::string out = gateway::forward_head(head, target);
    HttpLimits roomy;
    roomy.max_head_bytes = out.size() + 1;
    roomy.max_line_bytes = out.size();
    roomy.max_headers = head.headers.size() + 2;
    const HeadParse again = gateway::parse_request_head(out, roomy);
    FUZZ_CHECK(again.status == HeadParse::Status::complete, "forward_head does not parse: %s",
               again.error.c_str());
    FUZZ_CHECK(again.head.head_bytes == out.size(), "forward_head has bytes after its head");
    FUZZ_CHECK(again.head.method == head.method && again.head.target == target.origin_form &&
                   again.head.version == "HTTP/1.1",
               "forward_head's request line is not '%s %s HTTP/1.1'", head.method.c_str(),
               target.origin_form.c_str());
    int hosts = 0;
    for (const auto& [name, value] : again.head.headers) {
        if (iequals(name, "host")) ++hosts;
        for (const char* hop : {"proxy-connection", "proxy-authorization", "keep-alive", "te",
                                "trailer", "upgrade"}) {
            FUZZ_CHECK(!iequals(name, hop), "forward_head kept hop-by-hop %s", name.c_str());
        }
    }
    FUZZ_CHECK(hosts == 1, "forward_head sent %d Host headers", hosts);
    const auto& last = again.head.headers.back();
    FUZZ_CHECK(last.first == "Connection" && last.second == "close" &&
                   out.ends_with("Connection: close\r\n\r\n"),
               "forward_head does not end with Connection: close");
}

void check_target(const HttpRequestHead& head) {
    const gateway::TargetParse parse = gateway::proxy_target(head);
    if (!parse.ok) {
        FUZZ_CHECK(parse.error_status == 400 && !parse.error.empty(),
                   "a refused target without a 400 and a reason");
        check_response(parse.error_status, parse.error);
        return;
    }
    const auto& t = parse.target;
    FUZZ_CHECK(!t.host.empty() && normalise_host(t.host) == t.host, "target host '%s' not normal",
               t.host.c_str());
    FUZZ_CHECK(t.port >= 1 && t.port <= 65535, "target port %d", t.port);
    FUZZ_CHECK(t.tunnel == (head.method == "CONNECT"), "tunnel for %s", head.method.c_str());
    if (t.tunnel) return;
    FUZZ_CHECK(t.origin_form.starts_with('/'), "origin-form '%s'", t.origin_form.c_str());
    check_forward(head, t);
}

void fuzz_head(std::string_view buffer, const HttpLimits& limits) {
    const HeadParse parse = gateway::parse_request_head(buffer, limits);
    switch (parse.status) {
        case HeadParse::Status::incomplete:
            FUZZ_CHECK(buffer.size() < limits.max_head_bytes, "incomplete at %zu bytes",
                       buffer.size());
            return;
        case HeadParse::Status::error:
            FUZZ_CHECK(
                parse.error_status == 400 || parse.error_status == 431 || parse.error_status == 505,
                "error status %d", parse.error_status);
            FUZZ_CHECK(!parse.error.empty(), "an error without a reason");
            check_response(parse.error_status, parse.error);
            return;
        case HeadParse::Status::complete:
            break;
    }
    const HttpRequestHead& head = parse.head;
    const std::size_t n = head.head_bytes;
    FUZZ_CHECK(n >= 3 && n <= buffer.size() && n <= limits.max_head_bytes, "head_bytes %zu", n);
    FUZZ_CHECK(buffer[n - 1] == '\n', "the head does not end with a line feed");
    FUZZ_CHECK(head.headers.size() <= limits.max_headers, "%zu headers", head.headers.size());
    FUZZ_CHECK(head.version == "HTTP/1.1" || head.version == "HTTP/1.0", "version %s",
               head.version.c_str());
    FUZZ_CHECK(!head.method.empty() && !head.target.empty(), "empty method or target");
    const HeadParse exact = gateway::parse_request_head(buffer.substr(0, n), limits);
    FUZZ_CHECK(exact.status == HeadParse::Status::complete && exact.head.head_bytes == n &&
                   exact.head.headers == head.headers,
               "the head alone parses differently");
    const HeadParse shorter = gateway::parse_request_head(buffer.substr(0, n - 1), limits);
    FUZZ_CHECK(shorter.status == HeadParse::Status::incomplete,
               "a prefix of a complete head is not incomplete (%s)", shorter.error.c_str());
    check_target(head);
}

void fuzz_rules(std::string_view text) {
    const std::string host = normalise_host(text);
    if (!host.empty()) {
        FUZZ_CHECK(normalise_host(host) == host, "normalise_host is not idempotent on '%s'",
                   host.c_str());
    }
    try {
        const HostPattern p = HostPattern::parse(text);
        const HostPattern again = HostPattern::parse(p.to_string());
        FUZZ_CHECK(again.host == p.host && again.port == p.port, "'%s' does not parse back",
                   p.to_string().c_str());
        FUZZ_CHECK(p.covers(p), "'%s' does not cover itself", p.to_string().c_str());
        FUZZ_CHECK(p.port >= 0 && p.port <= 65535, "port %d", p.port);
    } catch (const PolicyError& e) {
        FUZZ_CHECK(e.ename() == "InvalidLimits", "ename %s", e.ename().c_str());
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "HostPattern::parse threw %s: %s", typeid(e).name(), e.what());
    }
}

// The body after a head: its framing, and a chunked scanner fed the rest in
// two pieces, which never takes more than it was fed nor anything once failed.
void fuzz_body(std::string_view text) {
    const HeadParse parsed = gateway::parse_request_head(text);
    if (parsed.status != HeadParse::Status::complete) return;
    const gateway::BodyFraming framing = gateway::body_framing(parsed.head);
    FUZZ_CHECK(framing.ok || !framing.error.empty(), "a refused framing without a reason");
    const std::string_view rest = text.substr(parsed.head.head_bytes);
    gateway::ChunkedScanner scanner;
    const std::size_t cut = rest.size() / 2;
    const std::size_t first = scanner.feed(rest.substr(0, cut));
    FUZZ_CHECK(first <= cut, "the scanner took %zu of %zu bytes", first, cut);
    const bool failed_early = scanner.failed(), done_early = scanner.done();
    const std::size_t second = scanner.feed(rest.substr(cut));
    FUZZ_CHECK(second <= rest.size() - cut, "the scanner took more than it was fed");
    FUZZ_CHECK(!failed_early || second == 0, "the scanner went on after failing");
    FUZZ_CHECK(!done_early || second == 0, "the scanner took bytes after the end");
    FUZZ_CHECK(!(scanner.done() && scanner.failed()), "done and failed at once");
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    using namespace cellblock::fuzz;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    fuzz_head(text, HttpLimits{});
    HttpLimits small;
    small.max_head_bytes = 200;
    small.max_line_bytes = 64;
    small.max_headers = 4;
    fuzz_head(text, small);
    if (size <= 300) fuzz_rules(text);
    fuzz_body(text);
    return 0;
}
