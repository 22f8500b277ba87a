// The egress gateway's rules as values (docs/network.md): the host patterns of
// a session's allowlist, whether one allowlist stays within another (a session
// cannot widen what the server allows), and the address ranges the gateway
// never connects to unless the operator opts one in. No sockets, no DNS.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock {

// One allowlist entry: "host:port", "*.suffix:port" or "*:port", with a port
// of 1-65535 or "*" (any port). Host names are kept lowercase; "*.example.com"
// matches every name under example.com but not example.com itself; "*" alone
// matches every host, IP literals included. An IP literal host ("127.0.0.1:80",
// "[::1]:80") matches only that literal as written in the request.
struct HostPattern {
    std::string host;  // lowercase: "api.example.com", "*.example.com", "*", "127.0.0.1", "::1"
    int port = 0;      // 0: any port

    // Throws PolicyError(InvalidLimits, "network.allow 'x': why") for an entry
    // that is not a pattern (no port, port 0 or above 65535, empty labels,
    // characters outside [a-z0-9-.], a '*' anywhere but a leading "*.").
    static HostPattern parse(std::string_view text);
    std::string to_string() const;  // the canonical text parse() accepts back

    // `host` as requested: compared case-insensitively, a trailing dot ignored.
    bool matches(std::string_view host, int port) const;
    // True when every host:port that `inner` matches, this pattern matches too.
    bool covers(const HostPattern& inner) const;
};

// A requested host made comparable: lowercase, no trailing dot, IPv6 literal
// without brackets (and in inet_ntop's canonical form). Empty when it is
// neither a valid DNS name (labels of 1-63 characters of [a-z0-9-_], at most
// 253 in all, the last not all digits) nor an IP literal; a legacy numeric
// IPv4 form a resolver would read as an address ("127.1", "0x7f.0.0.1") is
// neither.
std::string normalise_host(std::string_view host);

// An IPv4 or IPv6 address, as bytes (IPv4 in the first 4).
struct IpAddress {
    int family = 0;  // AF_INET or AF_INET6
    std::array<std::uint8_t, 16> bytes{};

    static std::optional<IpAddress> parse(std::string_view text);  // no brackets, no port
    std::string to_string() const;
};

// An address range in CIDR notation ("10.0.0.0/8", "fc00::/7", "127.0.0.1"
// meaning /32 or /128). parse() refuses bits set past the prefix ("10.0.0.1/8").
struct AddressRange {
    IpAddress base;
    int prefix = 0;

    static std::optional<AddressRange> parse(std::string_view text);
    bool contains(const IpAddress& address) const;  // false across families
    std::string to_string() const;
};

// Why the gateway refuses to connect to an address whatever the allowlist
// says: the range it falls in, and the IPv4 it embeds when that is what was
// judged. Covers 0/8, 10/8, 100.64/10, 127/8, 169.254/16 (cloud metadata),
// 172.16/12, 192.0.0/24, 192.168/16, 198.18/15, 224/4, 240/4, ::, ::1, ::/96
// (deprecated IPv4-compatible), fc00::/7, fe80::/10, ff00::/8, and an
// IPv4-mapped or NAT64 (64:ff9b::/96) address by the IPv4 it embeds.
struct ReservedAddress {
    std::string address;   // "::ffff:127.0.0.1"
    std::string embedded;  // "127.0.0.1" when judged by an embedded IPv4, else empty
    std::string range;     // "a loopback address (127.0.0.0/8)"

    // The address as the subject of a sentence: "127.0.0.1 is a loopback
    // address (127.0.0.0/8)", "::ffff:127.0.0.1 embeds 127.0.0.1, a loopback
    // address (127.0.0.0/8)".
    std::string sentence() const;
    // The gateway's refusal of `host` (a name, or the address itself):
    // "api.example resolves to 10.1.2.3, a private address (10.0.0.0/8)", or
    // sentence() when the client named the address.
    std::string refusal(std::string_view host) const;
};

// nullopt for a public address, or one inside a range of `opted_in`.
std::optional<ReservedAddress> reserved_address(const IpAddress& address,
                                                const std::vector<AddressRange>& opted_in);

}  // namespace cellblock
