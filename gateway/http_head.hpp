// What the egress gateway reads from a sandbox before it connects anywhere: an
// HTTP/1.x request head, parsed with every size bounded, and what it sends on
// (docs/network.md). Pure functions over bytes: unit-tested and fuzzed.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cellblock::gateway {

struct HttpLimits {
    std::size_t max_head_bytes = 16 * 1024;  // request line, headers and the blank line
    std::size_t max_line_bytes = 8 * 1024;   // any one line
    std::size_t max_headers = 100;
};

struct HttpRequestHead {
    std::string method;   // as sent ("CONNECT", "GET", ...)
    std::string target;   // as sent: "host:443", "http://host/path?q"
    std::string version;  // "HTTP/1.1" or "HTTP/1.0"
    std::vector<std::pair<std::string, std::string>> headers;  // names as sent, values trimmed
    std::size_t head_bytes = 0;  // bytes of the head, the final blank line included
};

struct HeadParse {
    enum class Status { incomplete, complete, error } status = Status::incomplete;
    HttpRequestHead head;  // when complete
    int error_status = 0;  // when error: 400, 431 (too large), 505 (not HTTP/1.x)
    std::string error;     // when error: why, for the error body and the audit
};

// Parses the head at the start of `buffer` (which may hold more: a body).
// Lines end in CRLF or LF. incomplete: no blank line yet and no limit passed
// (a caller that reaches max_head_bytes without one gets an error, not
// incomplete). Errors: an empty or malformed request line, a method that is
// not a token, a version other than HTTP/1.0 or HTTP/1.1, a header without a
// colon, whitespace before the colon, an obsolete folded line, control
// characters, and any limit passed (431).
HeadParse parse_request_head(std::string_view buffer, const HttpLimits& limits = {});

// Where a proxy request goes.
struct ProxyTarget {
    bool tunnel = false;  // CONNECT: bytes both ways after a 200
    std::string host;     // normalised (normalise_host)
    int port = 0;
    std::string origin_form;  // plain HTTP: "/path?query" ("/" when empty)
};

struct TargetParse {
    bool ok = false;
    ProxyTarget target;    // when ok
    int error_status = 0;  // when !ok: 400
    std::string error;     // when !ok: "CONNECT needs host:port", "https:// URLs go through
                           // CONNECT", "not a proxy request: send an absolute http:// URL", ...
};

// CONNECT host:port (IPv6 in brackets), or an absolute "http://host[:port]/..."
// URL (port 80 by default) for any other method. Userinfo in the URL, an
// invalid host, a port outside 1-65535 or a scheme other than http are errors.
TargetParse proxy_target(const HttpRequestHead& head);

// The head sent upstream for a plain HTTP request: the request line with the
// origin-form target and HTTP/1.1, a Host header from `target` (the client's
// own Host is dropped, RFC 9112 3.2.2: the allowlist judged the target, and
// another Host would reach another site behind a shared front end), the
// client's headers minus hop-by-hop ones (Connection and the headers it names
// except Content-Length and Transfer-Encoding, Proxy-Connection,
// Proxy-Authorization, Keep-Alive, TE, Trailer, Upgrade), and
// "Connection: close" (one request per connection).
std::string forward_head(const HttpRequestHead& head, const ProxyTarget& target);

// The reason phrase of an HTTP status (RFC 9110 section 15) for every status
// the gateway, the metrics endpoint and `cellblock mcp` answer with; "Error"
// for others.
std::string_view http_reason_phrase(int status);

// A complete response the gateway itself answers with: "HTTP/1.1 <status>
// <reason>", Content-Type text/plain, Content-Length, Connection: close, and
// `body` (a line ending in "\n" is added when missing).
std::string error_response(int status, std::string_view body);

// How a request's body is delimited (RFC 9112 section 6): nothing, a
// Content-Length, or chunked coding. The gateway forwards exactly that body and
// drops what follows, so a second request smuggled behind the first never
// reaches the upstream.
struct BodyFraming {
    enum class Kind { none, length, chunked } kind = Kind::none;
    unsigned long long length = 0;  // Kind::length
    bool ok = true;
    std::string error;  // when !ok (a 400): Transfer-Encoding with Content-Length, a coding other
                        // than "chunked", Content-Lengths that differ or are not a number
};
BodyFraming body_framing(const HttpRequestHead& head);

// Finds the end of a chunked body in the bytes that follow the head, fed in
// pieces. Chunk-size lines and trailer lines are bounded (1 KiB each, 100
// trailer lines); past a bound, or on a malformed line, failed() turns true.
class ChunkedScanner {
  public:
    // How many of `data`'s first bytes belong to the body: all of them until
    // the end is found (then done()), none once failed().
    std::size_t feed(std::string_view data);
    bool done() const { return state_ == State::done; }
    bool failed() const { return state_ == State::failed; }

  private:
    enum class State { size, data, data_end, trailer, done, failed } state_ = State::size;
    unsigned long long remaining_ = 0;  // of the current chunk's data
    std::string line_;
    std::size_t trailers_ = 0;
    bool saw_cr_ = false;
};

// The status code of a response whose first bytes are `start` ("HTTP/1.1 200
// OK\r\n..."), or 0 when they are not a status line.
int response_status(std::string_view start);

}  // namespace cellblock::gateway
