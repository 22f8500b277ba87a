// The little of HTTP/1.1 that Streamable HTTP needs, as values: a request
// head parsed, a response head written, and the checks made on a request
// (bearer token, Origin, listen address). No sockets here.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::mcp {

struct HttpRequest {
    std::string method;
    std::string path;  // the target without its query
    std::string version;
    std::map<std::string, std::string> headers;  // names lowercased, values trimmed
    std::string body;

    // The header's value, or "" (a repeated header keeps its values joined by ", ").
    std::string header(const std::string& lowercase_name) const;
};

// Parses the head (request line and headers, without the blank line).
// nullopt for anything malformed.
std::optional<HttpRequest> parse_request_head(std::string_view head);

// "HTTP/1.1 <status> <text>\r\n" + headers + "\r\n" (the body follows).
std::string response_head(int status,
                          const std::vector<std::pair<std::string, std::string>>& headers);

// `Authorization: Bearer <token>` compared in constant time.
bool bearer_matches(const std::string& authorization, const std::string& token);

// An Origin from a page on this machine (localhost, 127.0.0.1, [::1], any
// port) or one of `allowed`; the DNS-rebinding guard of the transports spec.
bool origin_allowed(const std::string& origin, const std::vector<std::string>& allowed);

struct ListenAddress {
    std::string host;  // numeric, without brackets
    int port = 0;
    bool ipv6 = false;
};
// "127.0.0.1:8765", "[::1]:8765", "localhost:8765", "0.0.0.0:8765";
// nullopt if malformed.
std::optional<ListenAddress> parse_listen_address(std::string_view text);
bool is_loopback(const ListenAddress& address);

}  // namespace cellblock::mcp
