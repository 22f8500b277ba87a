#include "http_message.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <charconv>

#include "http_head.hpp"

namespace cellblock::mcp {

namespace {

std::string trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
        s.remove_suffix(1);
    return std::string(s);
}

std::string lower(std::string_view s) {
    std::string out(s);
    std::transform(out.begin(), out.end(), out.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return out;
}

}  // namespace

std::string HttpRequest::header(const std::string& lowercase_name) const {
    const auto it = headers.find(lowercase_name);
    return it == headers.end() ? std::string() : it->second;
}

std::optional<HttpRequest> parse_request_head(std::string_view head) {
    // The gateway's parser (every size bounded, fuzzed), on the head with its
    // blank line; the caller bounded the head's size already.
    const std::string whole = std::string(head) + "\r\n\r\n";
    gateway::HttpLimits limits;
    limits.max_head_bytes = whole.size() + 1;
    limits.max_line_bytes = whole.size();
    const gateway::HeadParse parse = gateway::parse_request_head(whole, limits);
    if (parse.status != gateway::HeadParse::Status::complete) return std::nullopt;
    HttpRequest request;
    request.method = parse.head.method;
    request.version = parse.head.version;
    request.path = parse.head.target.substr(0, parse.head.target.find('?'));
    for (const auto& [name, value] : parse.head.headers) {
        auto [it, fresh] = request.headers.emplace(lower(name), value);
        if (!fresh) it->second += ", " + value;
    }
    return request;
}

std::string response_head(int status,
                          const std::vector<std::pair<std::string, std::string>>& headers) {
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " +
                       std::string(gateway::http_reason_phrase(status)) + "\r\n";
    for (const auto& [name, value] : headers) head += name + ": " + value + "\r\n";
    return head + "\r\n";
}

bool bearer_matches(const std::string& authorization, const std::string& token) {
    if (token.empty()) return false;
    const std::string_view prefix = "bearer ";
    if (authorization.size() < prefix.size() ||
        lower(std::string_view(authorization).substr(0, prefix.size())) != prefix)
        return false;
    const std::string given = trim(std::string_view(authorization).substr(prefix.size()));
    // Every byte is compared whatever the first difference: no timing signal.
    unsigned char diff = given.size() == token.size() ? 0 : 1;
    for (std::size_t i = 0; i < given.size(); ++i)
        diff |= static_cast<unsigned char>(given[i] ^ token[i % token.size()]);
    return diff == 0;
}

bool origin_allowed(const std::string& origin, const std::vector<std::string>& allowed) {
    if (std::find(allowed.begin(), allowed.end(), origin) != allowed.end()) return true;
    for (const std::string_view scheme : {"http://", "https://"}) {
        if (!origin.starts_with(scheme)) continue;
        std::string_view host = std::string_view(origin).substr(scheme.size());
        if (host.starts_with("[::1]")) {
            host.remove_prefix(5);
        } else {
            const auto colon = host.find(':');
            const std::string_view name = host.substr(0, colon);
            if (name != "localhost" && name != "127.0.0.1") return false;
            host.remove_prefix(name.size());
        }
        if (host.empty()) return true;
        if (host.front() != ':' || host.size() == 1) return false;
        return std::all_of(host.begin() + 1, host.end(),
                           [](char c) { return c >= '0' && c <= '9'; });
    }
    return false;
}

std::optional<ListenAddress> parse_listen_address(std::string_view text) {
    ListenAddress address;
    std::string_view host, port;
    if (text.starts_with("[")) {
        const auto close = text.find("]:");
        if (close == std::string_view::npos) return std::nullopt;
        host = text.substr(1, close - 1);
        port = text.substr(close + 2);
        address.ipv6 = true;
    } else {
        const auto colon = text.rfind(':');
        if (colon == std::string_view::npos) return std::nullopt;
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
    }
    if (host == "localhost") host = "127.0.0.1";
    int value = -1;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (ec != std::errc() || end != port.data() + port.size() || value < 0 || value > 65535)
        return std::nullopt;
    address.port = value;
    address.host = std::string(host);
    unsigned char bytes[16];
    if (inet_pton(address.ipv6 ? AF_INET6 : AF_INET, address.host.c_str(), bytes) != 1)
        return std::nullopt;
    return address;
}

bool is_loopback(const ListenAddress& address) {
    unsigned char bytes[16] = {};
    if (address.ipv6) {
        if (inet_pton(AF_INET6, address.host.c_str(), bytes) != 1) return false;
        static const unsigned char loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
        return std::equal(bytes, bytes + 16, loopback);
    }
    if (inet_pton(AF_INET, address.host.c_str(), bytes) != 1) return false;
    return bytes[0] == 127;
}

}  // namespace cellblock::mcp
