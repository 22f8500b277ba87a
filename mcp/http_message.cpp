#include "http_message.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <charconv>

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

bool is_token_char(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

}  // namespace

std::string HttpRequest::header(const std::string& lowercase_name) const {
    const auto it = headers.find(lowercase_name);
    return it == headers.end() ? std::string() : it->second;
}

std::optional<HttpRequest> parse_request_head(std::string_view head) {
    HttpRequest request;
    const auto line_end = head.find("\r\n");
    const std::string_view line = head.substr(0, line_end);
    const auto sp1 = line.find(' ');
    const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || sp1 == 0)
        return std::nullopt;
    request.method = std::string(line.substr(0, sp1));
    const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    request.version = std::string(line.substr(sp2 + 1));
    if (!std::all_of(request.method.begin(), request.method.end(), is_token_char) ||
        target.empty() || (request.version != "HTTP/1.1" && request.version != "HTTP/1.0"))
        return std::nullopt;
    request.path = std::string(target.substr(0, target.find('?')));
    std::size_t at = line_end == std::string_view::npos ? head.size() : line_end + 2;
    while (at < head.size()) {
        auto end = head.find("\r\n", at);
        if (end == std::string_view::npos) end = head.size();
        const std::string_view field = head.substr(at, end - at);
        at = end + 2;
        if (field.empty()) continue;
        const auto colon = field.find(':');
        if (colon == std::string_view::npos || colon == 0) return std::nullopt;
        const std::string_view name = field.substr(0, colon);
        if (!std::all_of(name.begin(), name.end(), is_token_char)) return std::nullopt;
        const std::string key = lower(name);
        std::string value = trim(field.substr(colon + 1));
        auto [it, fresh] = request.headers.emplace(key, value);
        if (!fresh) it->second += ", " + value;
    }
    return request;
}

std::string status_text(int status) {
    switch (status) {
        case 200:
            return "OK";
        case 202:
            return "Accepted";
        case 204:
            return "No Content";
        case 400:
            return "Bad Request";
        case 401:
            return "Unauthorized";
        case 403:
            return "Forbidden";
        case 404:
            return "Not Found";
        case 405:
            return "Method Not Allowed";
        case 406:
            return "Not Acceptable";
        case 411:
            return "Length Required";
        case 413:
            return "Content Too Large";
        case 415:
            return "Unsupported Media Type";
        case 431:
            return "Request Header Fields Too Large";
        case 500:
            return "Internal Server Error";
        case 503:
            return "Service Unavailable";
        default:
            return "Status";
    }
}

std::string response_head(int status,
                          const std::vector<std::pair<std::string, std::string>>& headers) {
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " + status_text(status) + "\r\n";
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
