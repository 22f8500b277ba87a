// The --egress-* flags of `serve`, `kernel` and `kernelspec install` as one
// value (server/egress_gateway.hpp): what they make of the server's maximum,
// and which combinations are refused before any gateway starts.
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "cellblock/session_policy.hpp"
#include "egress_gateway.hpp"
#include "error_of.hpp"

namespace cellblock {
namespace {

using cellblock::testing::error_of;

TEST(EgressSettings, NoAllowListLeavesTheServerWithoutNetwork) {
    EgressSettings settings;
    ServerPolicy policy;
    settings.apply_to(policy);
    const NetworkLimits& maxima = policy.maxima.network;
    EXPECT_FALSE(maxima.gateway());
    EXPECT_TRUE(maxima.allow.empty());
    EXPECT_NO_THROW(settings.check(maxima));
    // And no gateway process is started for it.
    EXPECT_EQ(start_egress_gateway(settings, maxima, "/nonexistent/cellblock-gateway"), nullptr);
}

TEST(EgressSettings, AnAllowListOpensTheGatewayAndBecomesTheDefaultList) {
    EgressSettings settings;
    settings.allow = {"API.example.com:443", "*.pythonhosted.org:443"};
    ServerPolicy policy;
    settings.apply_to(policy);
    const NetworkLimits &maxima = policy.maxima.network, &defaults = policy.defaults.network;
    EXPECT_TRUE(maxima.gateway());
    EXPECT_EQ(maxima.allow,
              (std::vector<std::string>{"api.example.com:443", "*.pythonhosted.org:443"}));
    EXPECT_EQ(defaults.allow, maxima.allow);
    // A session still asks for the gateway itself: the default mode is unchanged.
    EXPECT_FALSE(defaults.gateway());
    EXPECT_NO_THROW(settings.check(maxima));
}

TEST(EgressSettings, ABadPatternIsNamedWithItsFlag) {
    EgressSettings settings;
    settings.allow = {"pypi.org:443", "not a pattern"};
    ServerPolicy policy;
    const std::string why = error_of([&] { settings.apply_to(policy); });
    EXPECT_NE(why.find("--egress-allow not a pattern"), std::string::npos) << why;
}

TEST(EgressSettings, SecretsNeedAnAllowList) {
    EgressSettings settings;
    settings.secrets = {"api.example.com:Authorization=env:TOKEN"};
    ServerPolicy policy;
    const std::string why = error_of([&] { settings.apply_to(policy); });
    EXPECT_NE(why.find("--egress-secret needs a gateway"), std::string::npos) << why;
    settings.allow = {"api.example.com:443"};
    settings.apply_to(policy);
    const NetworkLimits& maxima = policy.maxima.network;
    ASSERT_EQ(maxima.secrets.size(), 1u);
    EXPECT_EQ(maxima.secrets[0].host, "api.example.com");
    EXPECT_EQ(maxima.secrets[0].header, "Authorization");
}

TEST(EgressSettings, FlagsOnlyAGatewayUsesAreRefusedWithoutOne) {
    const NetworkLimits none;
    for (const auto& set : {+[](EgressSettings& s) { s.private_ranges = {"127.0.0.1/32"}; },
                            +[](EgressSettings& s) { s.resolve["a.test"] = "127.0.0.1"; },
                            +[](EgressSettings& s) { s.ca = "/etc/ssl/certs/ca.pem"; }}) {
        EgressSettings settings;
        set(settings);
        const std::string why = error_of([&] { settings.check(none); });
        EXPECT_NE(why.find("need a gateway"), std::string::npos) << why;
        EXPECT_THROW(start_egress_gateway(settings, none, "/nonexistent"), std::runtime_error);
    }
}

TEST(EgressSettings, ResolveItemsAreNameEqualsAddress) {
    EgressSettings settings;
    settings.add_resolve("api.test.example=127.0.0.1");
    EXPECT_EQ(settings.resolve.at("api.test.example"), "127.0.0.1");
    for (const char* bad : {"no-equals", "=127.0.0.1", "name="}) {
        const std::string why = error_of([&] { settings.add_resolve(bad); });
        EXPECT_NE(why.find("expected NAME=ADDRESS"), std::string::npos) << bad << ": " << why;
    }
}

TEST(EgressSettings, TheGatewayUserMustBeAnUnprivilegedUserOfThisHost) {
    EgressSettings settings;
    settings.allow = {"api.example.com:443"};
    ServerPolicy policy;
    settings.apply_to(policy);
    const NetworkLimits& maxima = policy.maxima.network;
    for (const char* user : {"root", "no-such-user-of-this-host"}) {
        settings.user = user;
        const std::string why =
            error_of([&] { start_egress_gateway(settings, maxima, "/nonexistent"); });
        EXPECT_NE(why.find("not an unprivileged user"), std::string::npos) << user << ": " << why;
    }
}

}  // namespace
}  // namespace cellblock
