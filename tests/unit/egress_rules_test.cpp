// The egress allowlist and the reserved address ranges are values: no socket
// is opened and no name is resolved here.
#include "cellblock/egress_rules.hpp"

#include <arpa/inet.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cellblock/session_policy.hpp"

namespace cellblock {
namespace {

HostPattern pattern(std::string_view text) { return HostPattern::parse(text); }

// The PolicyError parse throws for `text` (fails the test if none).
PolicyError parse_error(std::string_view text) {
    try {
        HostPattern::parse(text);
    } catch (const PolicyError& e) {
        return e;
    }
    ADD_FAILURE() << "'" << text << "' parsed";
    return PolicyError("none", "none");
}

IpAddress ip(std::string_view text) {
    const auto address = IpAddress::parse(text);
    EXPECT_TRUE(address) << text;
    return address.value_or(IpAddress{});
}

AddressRange range(std::string_view text) {
    const auto r = AddressRange::parse(text);
    EXPECT_TRUE(r) << text;
    return r.value_or(AddressRange{});
}

// ---- HostPattern::parse ----

TEST(HostPattern, ParsesSuffixAndPort) {
    const HostPattern p = pattern("*.example.com:443");
    EXPECT_EQ(p.host, "*.example.com");
    EXPECT_EQ(p.port, 443);
    EXPECT_EQ(p.to_string(), "*.example.com:443");
}

TEST(HostPattern, StarHostAndStarPort) {
    const HostPattern p = pattern("*:*");
    EXPECT_EQ(p.host, "*");
    EXPECT_EQ(p.port, 0);
    EXPECT_EQ(p.to_string(), "*:*");
    const HostPattern any_port = pattern("api.example.com:*");
    EXPECT_EQ(any_port.host, "api.example.com");
    EXPECT_EQ(any_port.port, 0);
    EXPECT_EQ(any_port.to_string(), "api.example.com:*");
}

TEST(HostPattern, IpLiterals) {
    const HostPattern v6 = pattern("[::1]:80");
    EXPECT_EQ(v6.host, "::1");
    EXPECT_EQ(v6.port, 80);
    EXPECT_EQ(v6.to_string(), "[::1]:80");
    EXPECT_EQ(pattern("[0:0::1]:80").host, "::1");  // canonical, as requests are compared
    EXPECT_EQ(pattern("[2001:DB8::A]:1").host, "2001:db8::a");
    const HostPattern v4 = pattern("127.0.0.1:8080");
    EXPECT_EQ(v4.host, "127.0.0.1");
    EXPECT_EQ(v4.port, 8080);
}

TEST(HostPattern, UppercaseIsNormalised) {
    EXPECT_EQ(pattern("API.Example.COM:443").host, "api.example.com");
    EXPECT_EQ(pattern("*.EXAMPLE.com:1").to_string(), "*.example.com:1");
}

TEST(HostPattern, PortBounds) {
    EXPECT_EQ(pattern("x:1").port, 1);
    EXPECT_EQ(pattern("x:65535").port, 65535);
    EXPECT_STREQ(parse_error("x:0").what(), "network.allow 'x:0': the port must be 1-65535 or *");
    EXPECT_STREQ(parse_error("x:65536").what(),
                 "network.allow 'x:65536': the port must be 1-65535 or *");
    for (const char* bad : {"x:", "x:-1", "x:+80", "x:080000", "x:8o", "x: 80", "x:**"}) {
        parse_error(bad);
    }
}

TEST(HostPattern, RefusesEntriesThatAreNotPatterns) {
    const PolicyError no_port = parse_error("example.com");
    EXPECT_EQ(no_port.ename(), "InvalidLimits");
    EXPECT_STREQ(no_port.what(),
                 "network.allow 'example.com': no port (host:port, or host:* for any)");
    EXPECT_STREQ(parse_error("a..b:1").what(), "network.allow 'a..b:1': empty label");
    EXPECT_STREQ(parse_error("*foo.com:1").what(),
                 "network.allow '*foo.com:1': '*' is allowed only as a leading '*.' or alone");
    EXPECT_STREQ(parse_error("::1:80").what(),
                 "network.allow '::1:80': an IPv6 address goes in brackets ([::1]:80)");
    for (const char* bad : {"", ":80", ".example.com:1", "example.com.:1", "a.*.com:1", "*.*.com:1",
                            "*.:1", "ex ample.com:1", "ex_ample.com:1", "exa%mple.com:1", "[::1]",
                            "[::1]80", "[1.2.3.4]:80", "[example.com]:80", "[::1:80",
                            "1.2.3.999:80", "127.1:80", "*.0.0.1:80", "caf\xc3\xa9.com:1"}) {
        EXPECT_EQ(parse_error(bad).ename(), "InvalidLimits") << bad;
    }
}

TEST(HostPattern, LabelAndNameLengths) {
    const std::string label63(63, 'a');
    EXPECT_EQ(pattern(label63 + ".com:1").host, label63 + ".com");
    EXPECT_STREQ(
        parse_error(std::string(64, 'a') + ".com:1").what(),
        ("network.allow '" + std::string(64, 'a') + ".com:1': label over 63 characters").c_str());
    std::string name = label63 + "." + label63 + "." + label63 + "." + std::string(61, 'b');
    ASSERT_EQ(name.size(), 253U);
    EXPECT_EQ(pattern(name + ":1").host, name);
    parse_error(name + "b:1");
}

TEST(HostPattern, ToStringParsesBack) {
    for (const char* text : {"*.example.com:443", "*:*", "api.example.com:*", "[::1]:80",
                             "10.1.2.3:5432", "[fe80::1]:*"}) {
        const HostPattern p = pattern(text);
        EXPECT_EQ(p.to_string(), text);
        const HostPattern again = pattern(p.to_string());
        EXPECT_EQ(again.host, p.host);
        EXPECT_EQ(again.port, p.port);
    }
}

// ---- HostPattern::matches ----

TEST(HostPatternMatches, SuffixMatchesNamesUnderItButNotTheDomain) {
    const HostPattern p = pattern("*.example.com:443");
    EXPECT_TRUE(p.matches("api.example.com", 443));
    EXPECT_TRUE(p.matches("a.b.example.com", 443));
    EXPECT_FALSE(p.matches("example.com", 443));
    EXPECT_FALSE(p.matches("badexample.com", 443));
    EXPECT_FALSE(p.matches("example.com.evil.net", 443));
    EXPECT_FALSE(p.matches(".example.com", 443));
}

TEST(HostPatternMatches, CaseAndTrailingDotAreIgnored) {
    const HostPattern p = pattern("api.example.com:443");
    EXPECT_TRUE(p.matches("API.Example.Com", 443));
    EXPECT_TRUE(p.matches("api.example.com.", 443));
    EXPECT_FALSE(p.matches("api.example.com..", 443));
    EXPECT_TRUE(pattern("*.example.com:1").matches("X.EXAMPLE.COM.", 1));
}

TEST(HostPatternMatches, Port) {
    const HostPattern p = pattern("api.example.com:443");
    EXPECT_FALSE(p.matches("api.example.com", 80));
    EXPECT_FALSE(p.matches("api.example.com", 0));
    const HostPattern any = pattern("api.example.com:*");
    EXPECT_TRUE(any.matches("api.example.com", 80));
    EXPECT_TRUE(any.matches("api.example.com", 65535));
    EXPECT_FALSE(any.matches("other.example.com", 80));
}

TEST(HostPatternMatches, StarMatchesEveryValidHostIncludingLiterals) {
    const HostPattern p = pattern("*:443");
    EXPECT_TRUE(p.matches("example.com", 443));
    EXPECT_TRUE(p.matches("127.0.0.1", 443));
    EXPECT_TRUE(p.matches("[::1]", 443));
    EXPECT_FALSE(p.matches("example.com", 80));
    EXPECT_FALSE(p.matches("", 443));
    EXPECT_FALSE(p.matches("bad host", 443));
    EXPECT_FALSE(p.matches("127.1", 443));
}

TEST(HostPatternMatches, IpLiteralsMatchOnlyThemselves) {
    const HostPattern v6 = pattern("[::1]:80");
    EXPECT_TRUE(v6.matches("[::1]", 80));
    EXPECT_TRUE(v6.matches("::1", 80));
    EXPECT_TRUE(v6.matches("[0:0:0:0:0:0:0:1]", 80));
    EXPECT_FALSE(v6.matches("localhost", 80));
    EXPECT_FALSE(v6.matches("127.0.0.1", 80));
    const HostPattern v4 = pattern("127.0.0.1:80");
    EXPECT_TRUE(v4.matches("127.0.0.1", 80));
    EXPECT_FALSE(v4.matches("127.1", 80));
    EXPECT_FALSE(v4.matches("[::ffff:127.0.0.1]", 80));
    // A suffix is about names: an address is not "under" a domain.
    EXPECT_FALSE(pattern("*.example.com:80").matches("10.0.0.1", 80));
}

// ---- HostPattern::covers ----

TEST(HostPatternCovers, ExactCoversOnlyTheSameHost) {
    const HostPattern p = pattern("api.example.com:443");
    EXPECT_TRUE(p.covers(pattern("api.example.com:443")));
    EXPECT_TRUE(p.covers(pattern("API.example.com:443")));
    EXPECT_FALSE(p.covers(pattern("www.example.com:443")));
    EXPECT_FALSE(p.covers(pattern("*.api.example.com:443")));
    EXPECT_FALSE(p.covers(pattern("*:443")));
}

TEST(HostPatternCovers, SuffixCoversNamesAndNarrowerSuffixes) {
    const HostPattern p = pattern("*.example.com:443");
    EXPECT_TRUE(p.covers(pattern("api.example.com:443")));
    EXPECT_TRUE(p.covers(pattern("*.example.com:443")));
    EXPECT_TRUE(p.covers(pattern("*.api.example.com:443")));
    EXPECT_FALSE(p.covers(pattern("example.com:443")));
    EXPECT_FALSE(p.covers(pattern("*.badexample.com:443")));
    EXPECT_FALSE(p.covers(pattern("*.com:443")));
    EXPECT_FALSE(p.covers(pattern("*:443")));
    EXPECT_FALSE(p.covers(pattern("10.0.0.1:443")));
}

TEST(HostPatternCovers, StarCoversEveryHost) {
    const HostPattern p = pattern("*:443");
    for (const char* inner : {"a.com:443", "*.a.com:443", "*:443", "[::1]:443", "10.0.0.1:443"}) {
        EXPECT_TRUE(p.covers(pattern(inner))) << inner;
    }
    EXPECT_FALSE(p.covers(pattern("a.com:80")));
    EXPECT_FALSE(p.covers(pattern("a.com:*")));
}

TEST(HostPatternCovers, Ports) {
    EXPECT_TRUE(pattern("a.com:*").covers(pattern("a.com:443")));
    EXPECT_TRUE(pattern("a.com:*").covers(pattern("a.com:*")));
    EXPECT_FALSE(pattern("a.com:443").covers(pattern("a.com:*")));
    EXPECT_FALSE(pattern("a.com:443").covers(pattern("a.com:444")));
    EXPECT_TRUE(pattern("*:*").covers(pattern("*.a.com:*")));
    EXPECT_TRUE(pattern("[::1]:*").covers(pattern("[::1]:80")));
}

// ---- normalise_host ----

TEST(NormaliseHost, NamesAreLowercaseWithoutTrailingDot) {
    EXPECT_EQ(normalise_host("Api.Example.COM"), "api.example.com");
    EXPECT_EQ(normalise_host("example.com."), "example.com");
    EXPECT_EQ(normalise_host("_dmarc.example.com"), "_dmarc.example.com");
    EXPECT_EQ(normalise_host("localhost"), "localhost");
    EXPECT_EQ(normalise_host("xn--caf-dma.example"), "xn--caf-dma.example");
}

TEST(NormaliseHost, IpLiterals) {
    EXPECT_EQ(normalise_host("127.0.0.1"), "127.0.0.1");
    EXPECT_EQ(normalise_host("[::1]"), "::1");
    EXPECT_EQ(normalise_host("::1"), "::1");
    EXPECT_EQ(normalise_host("[2001:DB8:0:0::1]"), "2001:db8::1");
    EXPECT_EQ(normalise_host("[::FFFF:127.0.0.1]"), "::ffff:127.0.0.1");
}

TEST(NormaliseHost, InvalidIsEmpty) {
    const std::string label64(64, 'a');
    for (const std::string& bad : {std::string(""),
                                   std::string("."),
                                   std::string(".."),
                                   std::string("a..b"),
                                   std::string(".a"),
                                   std::string("a b"),
                                   std::string("a\tb"),
                                   std::string("a/b"),
                                   std::string("a@b"),
                                   std::string("a%2eb"),
                                   std::string("*.a.com"),
                                   std::string("*"),
                                   std::string("caf\xc3\xa9.com"),
                                   label64 + ".com",
                                   std::string(254, 'a'),
                                   std::string("[::1"),
                                   std::string("[example.com]"),
                                   std::string("[1.2.3.4]"),
                                   std::string("[fe80::1%eth0]"),
                                   std::string("1.2.3.4:80"),
                                   std::string("1.2.3.4\0", 8),
                                   std::string("a\0b", 3),
                                   std::string("127.1"),
                                   std::string("0x7f.0.0.1"),
                                   std::string("2130706433"),
                                   std::string("1.2.3.999"),
                                   std::string("01.2.3.4")}) {
        EXPECT_EQ(normalise_host(bad), "") << bad;
    }
}

TEST(NormaliseHost, IsIdempotent) {
    for (const char* host : {"A.b.C.", "[::1]", "10.0.0.1", "x-y_z.example"}) {
        const std::string once = normalise_host(host);
        ASSERT_FALSE(once.empty()) << host;
        EXPECT_EQ(normalise_host(once), once);
    }
}

// ---- IpAddress and AddressRange ----

TEST(IpAddress, ParsesBothFamiliesAndPrintsCanonically) {
    const IpAddress v4 = ip("192.0.2.7");
    EXPECT_EQ(v4.family, AF_INET);
    EXPECT_EQ(v4.bytes[0], 192);
    EXPECT_EQ(v4.bytes[3], 7);
    EXPECT_EQ(v4.bytes[4], 0);
    EXPECT_EQ(v4.to_string(), "192.0.2.7");
    const IpAddress v6 = ip("2001:DB8:0:0:0:0:0:1");
    EXPECT_EQ(v6.family, AF_INET6);
    EXPECT_EQ(v6.bytes[0], 0x20);
    EXPECT_EQ(v6.bytes[15], 1);
    EXPECT_EQ(v6.to_string(), "2001:db8::1");
}

TEST(IpAddress, RefusesWhatIsNotAnAddress) {
    for (const std::string& bad :
         {std::string(""), std::string("[::1]"), std::string("1.2.3.4:80"), std::string("1.2.3"),
          std::string("256.1.1.1"), std::string("example.com"), std::string(" 1.2.3.4"),
          std::string("1.2.3.4\0junk", 12), std::string("::1/128"), std::string(100, '1')}) {
        EXPECT_FALSE(IpAddress::parse(bad)) << bad;
    }
}

TEST(AddressRange, ParsesCidrAndSingleAddresses) {
    const AddressRange r = range("10.0.0.0/8");
    EXPECT_EQ(r.prefix, 8);
    EXPECT_EQ(r.to_string(), "10.0.0.0/8");
    EXPECT_EQ(range("127.0.0.1").prefix, 32);
    EXPECT_EQ(range("127.0.0.1").to_string(), "127.0.0.1/32");
    EXPECT_EQ(range("::1").prefix, 128);
    EXPECT_EQ(range("fc00::/7").to_string(), "fc00::/7");
    EXPECT_EQ(range("0.0.0.0/0").prefix, 0);
}

TEST(AddressRange, RefusesBadPrefixesAndHostBits) {
    for (const char* bad :
         {"10.0.0.0/33", "::/129", "10.0.0.0/", "10.0.0.0/-1", "10.0.0.0/+8", "10.0.0.0/08x",
          "10.0.0.1/8", "fc01::/7", "/8", "x/8", "10.0.0.0/8/8", "10.0.0.0/0008"}) {
        EXPECT_FALSE(AddressRange::parse(bad)) << bad;
    }
}

TEST(AddressRange, Contains) {
    const AddressRange r = range("100.64.0.0/10");
    EXPECT_TRUE(r.contains(ip("100.64.0.0")));
    EXPECT_TRUE(r.contains(ip("100.127.255.255")));
    EXPECT_FALSE(r.contains(ip("100.128.0.0")));
    EXPECT_FALSE(r.contains(ip("100.63.255.255")));
    const AddressRange v6 = range("fe80::/10");
    EXPECT_TRUE(v6.contains(ip("febf:ffff::1")));
    EXPECT_FALSE(v6.contains(ip("fec0::1")));
    EXPECT_TRUE(range("0.0.0.0/0").contains(ip("203.0.113.9")));
    EXPECT_TRUE(range("192.0.2.7").contains(ip("192.0.2.7")));
    EXPECT_FALSE(range("192.0.2.7").contains(ip("192.0.2.6")));
}

TEST(AddressRange, NeverContainsAcrossFamilies) {
    EXPECT_FALSE(range("0.0.0.0/0").contains(ip("::")));
    EXPECT_FALSE(range("::/0").contains(ip("0.0.0.0")));
    EXPECT_FALSE(range("::/0").contains(IpAddress{}));
}

// ---- reserved_address ----

struct ReservedCase {
    const char* address;
    const char* range;
};

TEST(ReservedAddress, EveryListedRange) {
    const ReservedCase cases[] = {
        {"0.0.0.0", "0.0.0.0/8"},
        {"0.255.255.255", "0.0.0.0/8"},
        {"10.0.0.1", "10.0.0.0/8"},
        {"10.255.255.255", "10.0.0.0/8"},
        {"100.64.0.1", "100.64.0.0/10"},
        {"100.127.255.254", "100.64.0.0/10"},
        {"127.0.0.1", "127.0.0.0/8"},
        {"127.255.0.9", "127.0.0.0/8"},
        {"169.254.0.1", "169.254.0.0/16"},
        {"169.254.169.254", "169.254.0.0/16"},
        {"172.16.0.1", "172.16.0.0/12"},
        {"172.31.255.255", "172.16.0.0/12"},
        {"192.0.0.8", "192.0.0.0/24"},
        {"192.168.1.1", "192.168.0.0/16"},
        {"198.18.0.1", "198.18.0.0/15"},
        {"198.19.255.255", "198.18.0.0/15"},
        {"224.0.0.1", "224.0.0.0/4"},
        {"239.255.255.255", "224.0.0.0/4"},
        {"240.0.0.1", "240.0.0.0/4"},
        {"255.255.255.255", "240.0.0.0/4"},
        {"::", "::/128"},
        {"::1", "::1/128"},
        {"::127.0.0.1", "::/96"},
        {"fc00::1", "fc00::/7"},
        {"fd12:3456::1", "fc00::/7"},
        {"fe80::1", "fe80::/10"},
        {"ff02::1", "ff00::/8"},
    };
    for (const auto& c : cases) {
        const auto why = reserved_address(ip(c.address), {});
        ASSERT_TRUE(why) << c.address;
        const std::string sentence = why->sentence();
        EXPECT_TRUE(sentence.starts_with(std::string(c.address) + " is ")) << sentence;
        EXPECT_TRUE(sentence.ends_with(std::string("(") + c.range + ")")) << sentence;
    }
}

TEST(ReservedAddress, SaysWhatTheRangeIs) {
    EXPECT_EQ(reserved_address(ip("127.0.0.1"), {})->sentence(),
              "127.0.0.1 is a loopback address (127.0.0.0/8)");
    EXPECT_EQ(reserved_address(ip("169.254.169.254"), {})->sentence(),
              "169.254.169.254 is a link-local address (where cloud metadata services answer) "
              "(169.254.0.0/16)");
}

TEST(ReservedAddress, JudgesMappedAndNat64ByTheEmbeddedIpv4) {
    EXPECT_EQ(reserved_address(ip("::ffff:127.0.0.1"), {})->sentence(),
              "::ffff:127.0.0.1 embeds 127.0.0.1, a loopback address (127.0.0.0/8)");
    EXPECT_EQ(reserved_address(ip("64:ff9b::a00:1"), {})->sentence(),
              "64:ff9b::a00:1 embeds 10.0.0.1, a private address (10.0.0.0/8)");
    EXPECT_TRUE(reserved_address(ip("::ffff:169.254.169.254"), {}));
    // Public IPv4 inside them is public (documentation ranges; nothing is sent).
    EXPECT_FALSE(reserved_address(ip("::ffff:192.0.2.1"), {}));
    EXPECT_FALSE(reserved_address(ip("64:ff9b::c000:201"), {}));
}

// The gateway's 403 text, as docs/network.md prints it: a name "resolves to"
// an address described once; an address the client named is described alone.
TEST(ReservedAddress, RefusalIsOneSentenceForANameOrALiteral) {
    EXPECT_EQ(reserved_address(ip("10.1.2.3"), {})->refusal("api.example"),
              "api.example resolves to 10.1.2.3, a private address (10.0.0.0/8)");
    EXPECT_EQ(reserved_address(ip("127.0.0.2"), {})->refusal("127.0.0.2"),
              "127.0.0.2 is a loopback address (127.0.0.0/8)");
    EXPECT_EQ(reserved_address(ip("::ffff:127.0.0.1"), {})->refusal("mapped.example"),
              "mapped.example resolves to ::ffff:127.0.0.1, which embeds 127.0.0.1, a loopback "
              "address (127.0.0.0/8)");
    EXPECT_EQ(reserved_address(ip("::ffff:127.0.0.1"), {})->refusal("::ffff:127.0.0.1"),
              "::ffff:127.0.0.1 embeds 127.0.0.1, a loopback address (127.0.0.0/8)");
}

TEST(ReservedAddress, PublicAddressesPass) {
    // Documentation ranges (RFC 5737, RFC 3849) and well-known public ones.
    for (const char* address :
         {"192.0.2.1", "198.51.100.7", "203.0.113.200", "8.8.8.8", "1.1.1.1", "172.32.0.1",
          "100.128.0.1", "11.0.0.1", "2001:db8::1", "2606:4700::1111", "::1:0:0:1"}) {
        EXPECT_EQ(reserved_address(ip(address), {}), std::nullopt) << address;
    }
}

TEST(ReservedAddress, OptedInExemptsOnlyThatRange) {
    const std::vector<AddressRange> opted{range("10.1.0.0/16"), range("fd00::/8")};
    EXPECT_FALSE(reserved_address(ip("10.1.2.3"), opted));
    EXPECT_TRUE(reserved_address(ip("10.2.0.1"), opted));
    EXPECT_FALSE(reserved_address(ip("fd00::5"), opted));
    EXPECT_TRUE(reserved_address(ip("fc00::5"), opted));
    EXPECT_TRUE(reserved_address(ip("127.0.0.1"), opted));
    EXPECT_TRUE(reserved_address(ip("169.254.169.254"), opted));
    // The embedded address is what was opted in.
    EXPECT_FALSE(reserved_address(ip("::ffff:10.1.0.9"), opted));
    EXPECT_TRUE(reserved_address(ip("::ffff:10.2.0.9"), opted));
    const std::vector<AddressRange> metadata{range("169.254.169.254")};
    EXPECT_FALSE(reserved_address(ip("169.254.169.254"), metadata));
    EXPECT_TRUE(reserved_address(ip("169.254.169.253"), metadata));
}

}  // namespace
}  // namespace cellblock
