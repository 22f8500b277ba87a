#include "cellblock/egress_rules.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>

#include "cellblock/error_names.hpp"
#include "cellblock/session_policy.hpp"

namespace cellblock {

namespace {

constexpr std::size_t kMaxNameBytes = 253;
constexpr std::size_t kMaxLabelBytes = 63;

char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

std::string lowercase(std::string_view text) {
    std::string out(text);
    std::transform(out.begin(), out.end(), out.begin(), lower);
    return out;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// inet_pton reads a C string: a NUL inside `text` would end it early, so
// "1.2.3.4\0junk" must not pass as 1.2.3.4.
std::optional<IpAddress> parse_ip(std::string_view text, int family) {
    if (text.empty() || text.size() >= INET6_ADDRSTRLEN ||
        text.find('\0') != std::string_view::npos) {
        return std::nullopt;
    }
    const std::string c_text(text);
    IpAddress address;
    if (inet_pton(family, c_text.c_str(), address.bytes.data()) != 1) return std::nullopt;
    address.family = family;
    return address;
}

// A name resolvers would read as an IPv4 address ("127.1", "0x7f.0.0.1",
// "2130706433") without it being the one dotted-quad form inet_pton takes: it
// is neither a name nor a literal an allowlist entry could be compared with.
bool legacy_ipv4_form(const std::string& name) {
    in_addr ignored{};
    if (inet_aton(name.c_str(), &ignored) != 0) return true;
    const std::size_t dot = name.rfind('.');
    const std::string_view last =
        std::string_view(name).substr(dot == std::string::npos ? 0 : dot + 1);
    return std::all_of(last.begin(), last.end(), is_digit);
}

// Why `name` (already lowercase, no trailing dot) is not a DNS name, or empty
// when it is one. Allowlist entries keep to [a-z0-9-.]; requested names may
// also hold '_' (DNS has such names, "_dmarc.example.com").
std::string name_problem(const std::string& name, bool allow_underscore) {
    if (name.empty()) return "empty host";
    if (name.size() > kMaxNameBytes) return "host name over 253 characters";
    std::size_t label = 0;
    for (const char c : name) {
        if (c == '.') {
            if (label == 0) return "empty label";
            label = 0;
            continue;
        }
        const bool allowed =
            (c >= 'a' && c <= 'z') || is_digit(c) || c == '-' || (allow_underscore && c == '_');
        if (!allowed) return "characters outside [a-z0-9-.]";
        if (++label > kMaxLabelBytes) return "label over 63 characters";
    }
    if (label == 0) return "empty label";
    if (legacy_ipv4_form(name)) return "neither a host name nor an IP address";
    return "";
}

bool is_ip_literal(std::string_view host) {
    return parse_ip(host, AF_INET) || parse_ip(host, AF_INET6);
}

// Any port, or 1-65535; nullopt otherwise.
std::optional<int> parse_port(std::string_view text) {
    if (text == "*") return 0;
    if (text.empty() || text.size() > 5 || !std::all_of(text.begin(), text.end(), is_digit)) {
        return std::nullopt;
    }
    int port = 0;
    for (const char c : text) port = port * 10 + (c - '0');
    if (port < 1 || port > 65535) return std::nullopt;
    return port;
}

// `host` is strictly under `suffix` ("a.example.com" under "example.com").
bool under(std::string_view host, std::string_view suffix) {
    return host.size() > suffix.size() + 1 && host.ends_with(suffix) &&
           host[host.size() - suffix.size() - 1] == '.';
}

bool is_suffix_pattern(const std::string& host) { return host.starts_with("*."); }

struct ReservedRange {
    const char* range;
    const char* what;
};

// Checked in order; the IPv4 rows also judge an address embedded in IPv6.
constexpr ReservedRange kReserved[] = {
    {"0.0.0.0/8", "a 'this network' address"},
    {"10.0.0.0/8", "a private address"},
    {"100.64.0.0/10", "a shared (carrier-grade NAT) address"},
    {"127.0.0.0/8", "a loopback address"},
    {"169.254.0.0/16", "a link-local address (where cloud metadata services answer)"},
    {"172.16.0.0/12", "a private address"},
    {"192.0.0.0/24", "an IETF protocol assignment address"},
    {"192.168.0.0/16", "a private address"},
    {"198.18.0.0/15", "a benchmarking address"},
    {"224.0.0.0/4", "a multicast address"},
    {"240.0.0.0/4", "a reserved address"},
    {"::/128", "the unspecified address"},
    {"::1/128", "a loopback address"},
    // Deprecated IPv4-compatible addresses: tunnelled to the IPv4 they embed
    // where the sit module is loaded, so refused like the mapped ones.
    {"::/96", "a deprecated IPv4-compatible address"},
    {"fc00::/7", "a unique local address"},
    {"fe80::/10", "a link-local address"},
    {"ff00::/8", "a multicast address"},
};

const std::vector<std::pair<AddressRange, const char*>>& reserved_ranges() {
    static const auto ranges = [] {
        std::vector<std::pair<AddressRange, const char*>> out;
        for (const auto& r : kReserved) out.emplace_back(*AddressRange::parse(r.range), r.what);
        return out;
    }();
    return ranges;
}

// The IPv4 address an IPv4-mapped (::ffff:0:0/96) or NAT64 (64:ff9b::/96)
// address reaches.
std::optional<IpAddress> embedded_ipv4(const IpAddress& address) {
    static const AddressRange mapped = *AddressRange::parse("::ffff:0:0/96");
    static const AddressRange nat64 = *AddressRange::parse("64:ff9b::/96");
    if (!mapped.contains(address) && !nat64.contains(address)) return std::nullopt;
    IpAddress v4;
    v4.family = AF_INET;
    std::copy(address.bytes.begin() + 12, address.bytes.end(), v4.bytes.begin());
    return v4;
}

bool in_any(const IpAddress& address, const std::vector<AddressRange>& ranges) {
    return std::any_of(ranges.begin(), ranges.end(),
                       [&](const AddressRange& r) { return r.contains(address); });
}

}  // namespace

HostPattern HostPattern::parse(std::string_view text) {
    const auto fail = [&](const std::string& why) {
        return PolicyError(ename::InvalidLimits,
                           "network.allow '" + std::string(text) + "': " + why);
    };
    std::string_view host_text;
    std::string_view port_text;
    if (text.starts_with('[')) {
        const std::size_t close = text.find(']');
        if (close == std::string_view::npos) throw fail("no ']' after the IPv6 address");
        host_text = text.substr(1, close - 1);
        if (close + 1 >= text.size() || text[close + 1] != ':') throw fail("no port (host:port)");
        port_text = text.substr(close + 2);
        if (!parse_ip(host_text, AF_INET6)) throw fail("not an IPv6 address in brackets");
    } else {
        const std::size_t colon = text.rfind(':');
        if (colon == std::string_view::npos) throw fail("no port (host:port, or host:* for any)");
        host_text = text.substr(0, colon);
        port_text = text.substr(colon + 1);
        if (host_text.find(':') != std::string_view::npos) {
            throw fail("an IPv6 address goes in brackets ([::1]:80)");
        }
    }
    const auto port = parse_port(port_text);
    if (!port) throw fail("the port must be 1-65535 or *");

    HostPattern pattern;
    pattern.port = *port;
    const std::string host = lowercase(host_text);
    if (host == "*") {
        pattern.host = host;
    } else if (const auto ip =
                   text.starts_with('[') ? parse_ip(host, AF_INET6) : parse_ip(host, AF_INET)) {
        pattern.host = ip->to_string();
    } else {
        const bool suffix = is_suffix_pattern(host);
        const std::string name = suffix ? host.substr(2) : host;
        if (name.find('*') != std::string::npos) {
            throw fail("'*' is allowed only as a leading '*.' or alone");
        }
        if (const std::string why = name_problem(name, false); !why.empty()) throw fail(why);
        pattern.host = host;
    }
    return pattern;
}

std::string HostPattern::to_string() const {
    const std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    return h + ":" + (port == 0 ? "*" : std::to_string(port));
}

bool HostPattern::matches(std::string_view requested, int requested_port) const {
    if (port != 0 && port != requested_port) return false;
    const std::string name = normalise_host(requested);
    if (name.empty()) return false;
    if (host == "*") return true;
    if (is_suffix_pattern(host)) {
        return !is_ip_literal(name) && under(name, std::string_view(host).substr(2));
    }
    return name == host;
}

bool HostPattern::covers(const HostPattern& inner) const {
    if (port != 0 && port != inner.port) return false;
    if (host == "*") return true;
    if (inner.host == "*") return false;
    if (!is_suffix_pattern(host)) return host == inner.host;
    const std::string_view suffix = std::string_view(host).substr(2);
    if (is_suffix_pattern(inner.host)) {
        const std::string_view inner_suffix = std::string_view(inner.host).substr(2);
        return inner_suffix == suffix || under(inner_suffix, suffix);
    }
    return !is_ip_literal(inner.host) && under(inner.host, suffix);
}

std::string normalise_host(std::string_view host) {
    if (host.size() > kMaxNameBytes + 2) return "";
    if (host.starts_with('[')) {
        if (!host.ends_with(']')) return "";
        const auto ip = parse_ip(host.substr(1, host.size() - 2), AF_INET6);
        return ip ? ip->to_string() : "";
    }
    if (host.find(':') != std::string_view::npos) {
        const auto ip = parse_ip(host, AF_INET6);
        return ip ? ip->to_string() : "";
    }
    if (host.ends_with('.')) host.remove_suffix(1);
    std::string name = lowercase(host);
    if (parse_ip(name, AF_INET)) return name;
    return name_problem(name, true).empty() ? name : "";
}

std::optional<IpAddress> IpAddress::parse(std::string_view text) {
    if (auto v4 = parse_ip(text, AF_INET)) return v4;
    return parse_ip(text, AF_INET6);
}

std::string IpAddress::to_string() const {
    char text[INET6_ADDRSTRLEN] = {};
    if (family != AF_INET && family != AF_INET6) return "";
    if (inet_ntop(family, bytes.data(), text, sizeof text) == nullptr) return "";
    return text;
}

// A base with bits set past the prefix ("10.0.0.1/8") is refused rather than
// widened: the operator meant one of two things and we cannot tell which.
std::optional<AddressRange> AddressRange::parse(std::string_view text) {
    const std::size_t slash = text.find('/');
    const auto base = IpAddress::parse(text.substr(0, slash));
    if (!base) return std::nullopt;
    const int bits = base->family == AF_INET ? 32 : 128;
    int prefix = bits;
    if (slash != std::string_view::npos) {
        const std::string_view digits = text.substr(slash + 1);
        if (digits.empty() || digits.size() > 3 ||
            !std::all_of(digits.begin(), digits.end(), is_digit)) {
            return std::nullopt;
        }
        prefix = 0;
        for (const char c : digits) prefix = prefix * 10 + (c - '0');
        if (prefix > bits) return std::nullopt;
    }
    AddressRange range{*base, prefix};
    IpAddress masked = *base;
    for (int bit = prefix; bit < bits; ++bit) {
        masked.bytes[bit / 8] &= static_cast<std::uint8_t>(~(0x80u >> (bit % 8)));
    }
    if (masked.bytes != base->bytes) return std::nullopt;
    return range;
}

bool AddressRange::contains(const IpAddress& address) const {
    const int bits = base.family == AF_INET ? 32 : 128;
    if (address.family != base.family || prefix < 0 || prefix > bits) return false;
    const int whole = prefix / 8;
    if (!std::equal(base.bytes.begin(), base.bytes.begin() + whole, address.bytes.begin())) {
        return false;
    }
    const int rest = prefix % 8;
    if (rest == 0) return true;
    const auto mask = static_cast<std::uint8_t>(0xFFu << (8 - rest));
    return (base.bytes[whole] & mask) == (address.bytes[whole] & mask);
}

std::string AddressRange::to_string() const {
    return base.to_string() + "/" + std::to_string(prefix);
}

std::optional<ReservedAddress> reserved_address(const IpAddress& address,
                                                const std::vector<AddressRange>& opted_in) {
    const auto v4 = embedded_ipv4(address);
    if (in_any(address, opted_in) || (v4 && in_any(*v4, opted_in))) return std::nullopt;
    const IpAddress& judged = v4 ? *v4 : address;
    for (const auto& [range, what] : reserved_ranges()) {
        if (!range.contains(judged)) continue;
        return ReservedAddress{address.to_string(), v4 ? v4->to_string() : std::string(),
                               std::string(what) + " (" + range.to_string() + ")"};
    }
    return std::nullopt;
}

std::string ReservedAddress::sentence() const {
    if (!embedded.empty()) return address + " embeds " + embedded + ", " + range;
    return address + " is " + range;
}

std::string ReservedAddress::refusal(std::string_view host) const {
    const auto literal = IpAddress::parse(host);
    if (literal && literal->to_string() == address) return sentence();
    const std::string apposition = embedded.empty()
                                       ? address + ", " + range
                                       : address + ", which embeds " + embedded + ", " + range;
    return std::string(host) + " resolves to " + apposition;
}

}  // namespace cellblock
