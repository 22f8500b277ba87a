#include "http_head.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

#include "cellblock/egress_rules.hpp"

namespace cellblock::gateway {

namespace {

// RFC 9110 tchar: what a method and a header name are made of.
bool is_tchar(unsigned char c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
    constexpr std::string_view kPunctuation = "!#$%&'*+-.^_`|~";
    return c != 0 && kPunctuation.find(static_cast<char>(c)) != std::string_view::npos;
}

bool is_token(std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
        return is_tchar(static_cast<unsigned char>(c));
    });
}

bool is_control(unsigned char c) { return c < 0x20 || c == 0x7f; }

char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool iequals(std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                              [](char x, char y) { return lower(x) == lower(y); });
}

bool istarts_with(std::string_view s, std::string_view prefix) {
    return s.size() >= prefix.size() && iequals(s.substr(0, prefix.size()), prefix);
}

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Attacker bytes quoted in an error body or the audit: short and printable.
std::string quoted(std::string_view s) {
    constexpr std::size_t kShown = 64;
    std::string out = "'";
    for (const char c : s.substr(0, kShown)) {
        const auto u = static_cast<unsigned char>(c);
        out += (is_control(u) || u >= 0x80) ? '?' : c;
    }
    if (s.size() > kShown) out += "...";
    return out + "'";
}

HeadParse failed(int status, std::string why) {
    HeadParse parse;
    parse.status = HeadParse::Status::error;
    parse.error_status = status;
    parse.error = std::move(why);
    return parse;
}

// "HTTP/d.d": 0 when it is HTTP/1.0 or 1.1, 505 for another version, 400 when
// it is not a version at all.
int version_problem(std::string_view v) {
    if (v == "HTTP/1.0" || v == "HTTP/1.1") return 0;
    if (v.size() == 8 && v.starts_with("HTTP/") && is_digit(v[5]) && v[6] == '.' &&
        is_digit(v[7])) {
        return 505;
    }
    return 400;
}

// Why a complete request line is refused, or empty.
std::string request_line_problem(std::string_view line, HttpRequestHead& head, int& status) {
    status = 400;
    if (line.empty()) return "empty request line";
    for (const char c : line) {
        const auto u = static_cast<unsigned char>(c);
        if (is_control(u) || u >= 0x80) return "control or non-ASCII bytes in the request line";
    }
    const std::size_t first = line.find(' ');
    const std::size_t last = line.rfind(' ');
    if (first == std::string_view::npos || first == last) {
        return "malformed request line (METHOD target HTTP/1.1)";
    }
    const std::string_view method = line.substr(0, first);
    const std::string_view target = line.substr(first + 1, last - first - 1);
    const std::string_view version = line.substr(last + 1);
    if (target.empty() || target.find(' ') != std::string_view::npos) {
        return "malformed request line (METHOD target HTTP/1.1)";
    }
    if (!is_token(method)) return "the method is not a token";
    if (const int v = version_problem(version); v != 0) {
        status = v;
        return v == 505 ? "only HTTP/1.0 and HTTP/1.1 are supported, not " + quoted(version)
                        : "malformed HTTP version " + quoted(version);
    }
    head.method = method;
    head.target = target;
    head.version = version;
    return "";
}

// Why a complete header line is refused, or empty.
std::string header_problem(std::string_view line, HttpRequestHead& head) {
    if (line.front() == ' ' || line.front() == '\t') return "obsolete line folding in the headers";
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) return "a header line without a colon";
    const std::string_view name = line.substr(0, colon);
    if (!name.empty() && (name.back() == ' ' || name.back() == '\t')) {
        return "whitespace between a header name and its colon";
    }
    if (!is_token(name)) return "a header name that is not a token";
    const std::string_view value = trim(line.substr(colon + 1));
    for (const char c : value) {
        if (c != '\t' && is_control(static_cast<unsigned char>(c))) {
            return "control characters in header " + quoted(name);
        }
    }
    head.headers.emplace_back(name, value);
    return "";
}

// "host", "host:port", "[v6]" or "[v6]:port", with `default_port` when the
// port is absent (0: required). Fills `target`, or returns why not.
std::string parse_authority(std::string_view authority, int default_port, ProxyTarget& target) {
    std::string_view host = authority;
    std::string_view port;
    bool has_port = false;
    if (authority.starts_with('[')) {
        const std::size_t close = authority.find(']');
        if (close == std::string_view::npos) return "no ']' after the IPv6 address";
        host = authority.substr(0, close + 1);
        const std::string_view rest = authority.substr(close + 1);
        if (!rest.empty()) {
            if (rest.front() != ':') return "junk after the IPv6 address";
            port = rest.substr(1);
            has_port = true;
        }
    } else if (const std::size_t colon = authority.rfind(':'); colon != std::string_view::npos) {
        host = authority.substr(0, colon);
        port = authority.substr(colon + 1);
        has_port = true;
        // "::1:443" could be an address with or without a port: brackets say which.
        if (host.find(':') != std::string_view::npos) return "an IPv6 address goes in brackets";
    }
    if (!has_port && default_port == 0) return "no port";
    int number = default_port;
    if (has_port) {
        if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), is_digit)) {
            return "bad port " + quoted(port);
        }
        number = 0;
        for (const char c : port) number = number * 10 + (c - '0');
        if (number < 1 || number > 65535) return "port " + std::string(port) + " is not 1-65535";
    }
    std::string normal = normalise_host(host);
    if (normal.empty()) return quoted(host) + " is not a host name or IP address";
    target.host = std::move(normal);
    target.port = number;
    return "";
}

TargetParse target_error(std::string why) {
    TargetParse parse;
    parse.error_status = 400;
    parse.error = std::move(why);
    return parse;
}

constexpr std::array<std::string_view, 7> kHopByHop = {
    "connection", "proxy-connection", "proxy-authorization", "keep-alive", "te",
    "trailer",    "upgrade"};

// Headers that Connection may not remove: the gateway and the upstream must
// agree on where the body ends, and Host is the gateway's to write.
constexpr std::array<std::string_view, 3> kKeptWhateverConnectionSays = {
    "content-length", "transfer-encoding", "host"};

bool listed(std::string_view name, auto const& names) {
    return std::any_of(names.begin(), names.end(),
                       [&](std::string_view n) { return iequals(n, name); });
}

}  // namespace

HeadParse parse_request_head(std::string_view buffer, const HttpLimits& limits) {
    // Nothing past max_head_bytes is looked at: a head that ends there or later is too large.
    const std::string_view window =
        buffer.substr(0, std::min(buffer.size(), limits.max_head_bytes));
    HeadParse parse;
    std::size_t at = 0;
    bool first = true;
    while (true) {
        const std::size_t newline = window.find('\n', at);
        std::string_view line = window.substr(
            at, newline == std::string_view::npos ? std::string_view::npos : newline - at);
        if (line.ends_with('\r')) line.remove_suffix(1);
        if (line.size() > limits.max_line_bytes) {
            return failed(431,
                          "a line is over " + std::to_string(limits.max_line_bytes) + " bytes");
        }
        if (newline == std::string_view::npos) {
            if (buffer.size() >= limits.max_head_bytes) {
                return failed(431, "the request head is over " +
                                       std::to_string(limits.max_head_bytes) + " bytes");
            }
            return parse;  // incomplete
        }
        at = newline + 1;
        if (first) {
            int status = 0;
            if (std::string why = request_line_problem(line, parse.head, status); !why.empty()) {
                return failed(status, std::move(why));
            }
            first = false;
            continue;
        }
        if (line.empty()) break;
        if (parse.head.headers.size() >= limits.max_headers) {
            return failed(431, "more than " + std::to_string(limits.max_headers) + " headers");
        }
        if (std::string why = header_problem(line, parse.head); !why.empty()) {
            return failed(400, std::move(why));
        }
    }
    parse.status = HeadParse::Status::complete;
    parse.head.head_bytes = at;
    return parse;
}

TargetParse proxy_target(const HttpRequestHead& head) {
    TargetParse parse;
    const std::string_view target = head.target;
    if (head.method == "CONNECT") {
        if (std::string why = parse_authority(target, 0, parse.target); !why.empty()) {
            return target_error("CONNECT needs host:port: " + why);
        }
        parse.target.tunnel = true;
        parse.ok = true;
        return parse;
    }
    constexpr std::string_view kHttp = "http://";
    if (!istarts_with(target, kHttp)) {
        if (istarts_with(target, "https://")) {
            return target_error(
                "https:// URLs go through CONNECT: use this gateway as the https proxy too");
        }
        if (const std::size_t scheme = target.find("://"); scheme != std::string_view::npos) {
            return target_error("only http:// URLs (and https through CONNECT), not " +
                                quoted(target.substr(0, scheme + 3)));
        }
        return target_error("not a proxy request: send an absolute http:// URL");
    }
    const std::string_view rest = target.substr(kHttp.size());
    const std::size_t end = rest.find_first_of("/?#");
    const std::string_view authority = rest.substr(0, end);
    if (authority.find('@') != std::string_view::npos) {
        return target_error("userinfo (user@) in the URL is refused");
    }
    if (std::string why = parse_authority(authority, 80, parse.target); !why.empty()) {
        return target_error("bad URL " + quoted(target) + ": " + why);
    }
    std::string_view path = end == std::string_view::npos ? "" : rest.substr(end);
    path = path.substr(0, path.find('#'));  // a fragment is the client's, never sent
    parse.target.origin_form = path.starts_with('/') ? std::string(path) : "/" + std::string(path);
    parse.ok = true;
    return parse;
}

std::string forward_head(const HttpRequestHead& head, const ProxyTarget& target) {
    // Connection may name more hop-by-hop headers ("Connection: close, X-Foo").
    std::vector<std::string_view> named;
    for (const auto& [name, value] : head.headers) {
        if (!iequals(name, "connection")) continue;
        std::string_view list = value;
        while (!list.empty()) {
            const std::size_t comma = list.find(',');
            const std::string_view item = trim(list.substr(0, comma));
            if (!item.empty() && !listed(item, kKeptWhateverConnectionSays)) named.push_back(item);
            list = comma == std::string_view::npos ? "" : list.substr(comma + 1);
        }
    }
    std::string out = head.method + " " + target.origin_form + " HTTP/1.1\r\n";
    // Host comes from the target, never the client: the allowlist judged the
    // target, and a client's own Host would reach another site on a shared
    // front end (a CDN) behind an allowed name.
    const bool v6 = target.host.find(':') != std::string::npos;
    out += "Host: " + (v6 ? "[" + target.host + "]" : target.host);
    if (target.port != 80) out += ":" + std::to_string(target.port);
    out += "\r\n";
    for (const auto& [name, value] : head.headers) {
        if (iequals(name, "host") || listed(name, kHopByHop) || listed(name, named)) continue;
        out += name + ": " + value + "\r\n";
    }
    out += "Connection: close\r\n\r\n";
    return out;
}

BodyFraming body_framing(const HttpRequestHead& head) {
    BodyFraming framing;
    const auto fail = [&](std::string why) {
        framing.ok = false;
        framing.error = std::move(why);
        return framing;
    };
    bool has_length = false, has_coding = false;
    for (const auto& [name, value] : head.headers) {
        std::string lower_name(name);
        for (char& c : lower_name)
            c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (lower_name == "transfer-encoding") {
            std::string coding(value);
            for (char& c : coding)
                c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            if (has_coding || coding != "chunked") {
                return fail("Transfer-Encoding " + value.substr(0, 64) +
                            ": the gateway forwards only one chunked coding");
            }
            has_coding = true;
        } else if (lower_name == "content-length") {
            if (value.empty() || value.size() > 18 ||
                !std::all_of(value.begin(), value.end(),
                             [](char c) { return c >= '0' && c <= '9'; })) {
                return fail("Content-Length " + value.substr(0, 64) + " is not a number");
            }
            const unsigned long long n = std::stoull(value);
            if (has_length && n != framing.length) {
                return fail("two Content-Length headers that differ");
            }
            has_length = true;
            framing.length = n;
        }
    }
    if (has_coding && has_length) {
        return fail("both Transfer-Encoding and Content-Length: the body's end is ambiguous");
    }
    framing.kind = has_coding   ? BodyFraming::Kind::chunked
                   : has_length ? BodyFraming::Kind::length
                                : BodyFraming::Kind::none;
    return framing;
}

std::size_t ChunkedScanner::feed(std::string_view data) {
    constexpr std::size_t kMaxLine = 1024;
    constexpr std::size_t kMaxTrailers = 100;
    std::size_t used = 0;
    while (used < data.size() && state_ != State::done && state_ != State::failed) {
        if (state_ == State::data) {
            const std::size_t take = static_cast<std::size_t>(
                std::min<unsigned long long>(remaining_, data.size() - used));
            used += take;
            remaining_ -= take;
            if (remaining_ == 0) state_ = State::data_end;
            continue;
        }
        // A line: chunk size, the CRLF after a chunk's data, or a trailer.
        const char c = data[used++];
        if (c != '\n') {
            if (c == '\r') {
                saw_cr_ = true;
                continue;
            }
            if (saw_cr_ || line_.size() >= kMaxLine || state_ == State::data_end) {
                // A bare CR, a line too long, or data past the chunk's size.
                state_ = State::failed;
                break;
            }
            line_.push_back(c);
            continue;
        }
        saw_cr_ = false;
        std::string line = std::move(line_);
        line_.clear();
        if (state_ == State::data_end) {
            state_ = line.empty() ? State::size : State::failed;
        } else if (state_ == State::size) {
            const std::string digits = line.substr(0, line.find(';'));
            std::size_t end = 0;
            while (end < digits.size() && std::isxdigit(static_cast<unsigned char>(digits[end])))
                ++end;
            std::size_t tail = end;
            while (tail < digits.size() && (digits[tail] == ' ' || digits[tail] == '\t')) ++tail;
            if (end == 0 || end > 15 || tail != digits.size()) {
                state_ = State::failed;
                break;
            }
            remaining_ = std::stoull(digits.substr(0, end), nullptr, 16);
            state_ = remaining_ == 0 ? State::trailer : State::data;
        } else if (state_ == State::trailer) {
            if (line.empty()) {
                state_ = State::done;
            } else if (++trailers_ > kMaxTrailers) {
                state_ = State::failed;
            }
        }
    }
    return state_ == State::failed ? 0 : used;
}

std::string_view http_reason_phrase(int status) {
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
        case 407:
            return "Proxy Authentication Required";
        case 408:
            return "Request Timeout";
        case 411:
            return "Length Required";
        case 413:
            return "Content Too Large";
        case 414:
            return "URI Too Long";
        case 415:
            return "Unsupported Media Type";
        case 429:
            return "Too Many Requests";
        case 431:
            return "Request Header Fields Too Large";
        case 500:
            return "Internal Server Error";
        case 501:
            return "Not Implemented";
        case 502:
            return "Bad Gateway";
        case 503:
            return "Service Unavailable";
        case 504:
            return "Gateway Timeout";
        case 505:
            return "HTTP Version Not Supported";
    }
    return "Error";
}

std::string error_response(int status, std::string_view body) {
    if (status < 100 || status > 999) status = 500;
    std::string text(body);
    if (!text.ends_with('\n')) text += '\n';
    return "HTTP/1.1 " + std::to_string(status) + " " + std::string(http_reason_phrase(status)) +
           "\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: " +
           std::to_string(text.size()) + "\r\nConnection: close\r\n\r\n" + text;
}

int response_status(std::string_view start) {
    // "HTTP/d.d ddd" and then a space or the end of the line.
    if (start.size() < 13 || !start.starts_with("HTTP/") || !is_digit(start[5]) ||
        start[6] != '.' || !is_digit(start[7]) || start[8] != ' ') {
        return 0;
    }
    const std::string_view code = start.substr(9, 3);
    if (!std::all_of(code.begin(), code.end(), is_digit)) return 0;
    if (start[12] != ' ' && start[12] != '\r' && start[12] != '\n') return 0;
    const int status = (code[0] - '0') * 100 + (code[1] - '0') * 10 + (code[2] - '0');
    return status >= 100 ? status : 0;
}

}  // namespace cellblock::gateway
