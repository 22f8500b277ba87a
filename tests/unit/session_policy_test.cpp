// The session policy is a value fed events with explicit times: no clock, no sleeping.
#include "cellblock/session_policy.hpp"

#include <chrono>
#include <string>

#include <gtest/gtest.h>

namespace cellblock {
namespace {
using nlohmann::json;
using namespace std::chrono_literals;

const Clock::time_point t0{std::chrono::hours(1000)};

// Runs `f` and returns the PolicyError it throws (fails the test if none).
template <typename F>
PolicyError policy_error(F&& f) {
    try {
        f();
    } catch (const PolicyError& e) {
        return e;
    }
    ADD_FAILURE() << "no PolicyError was thrown";
    return PolicyError("none", "none");
}

// ---- limits and layering ----

TEST(SessionLimits, JsonRoundTripHasEveryFieldFlat) {
    SessionLimits limits;
    limits.exec_timeout_s = 12.5;
    limits.sandbox.memory_mb = 700;
    const json j = limits.to_json();
    for (const char* name :
         {"max_executions", "idle_timeout_s", "hibernate_after_s", "lifetime_s", "exec_timeout_s",
          "interrupt_grace_s", "output_bytes", "memory_mb", "pids", "disk_mb", "shm_mb",
          "output_mb", "cpus", "nofile", "network"}) {
        EXPECT_TRUE(j.contains(name)) << name;
    }
    EXPECT_EQ(j.size(), 15U);
    EXPECT_EQ(j["network"]["mode"], "none");
    const SessionLimits back = SessionLimits::from_json(j, SessionLimits{});
    EXPECT_EQ(back.to_json(), j);
}

// ---- network (the egress gateway's policy) ----

ServerPolicy gateway_server(std::vector<std::string> allow) {
    ServerPolicy policy;
    policy.maxima.network.mode = "gateway";
    policy.maxima.network.allow = allow;
    policy.defaults.network.allow = allow;
    return policy;
}

TEST(NetworkLimits, NoneByDefaultAndGatewayOnlyWhereTheServerHasOne) {
    const ServerPolicy plain;
    EXPECT_FALSE(plain.effective(json::object(), json::object()).network.gateway());
    const PolicyError e = policy_error([&] {
        plain.effective(json::object(), json{{"network", {{"mode", "gateway"}}}});
    });
    EXPECT_EQ(e.ename(), "LimitAboveMaximum");
    EXPECT_NE(std::string(e.what()).find("--egress-allow"), std::string::npos) << e.what();
}

TEST(NetworkLimits, AllowListStaysWithinTheServers) {
    const ServerPolicy policy = gateway_server({"*.example.com:443", "pypi.org:*"});
    const SessionLimits all =
        policy.effective(json::object(), json{{"network", {{"mode", "gateway"}}}});
    EXPECT_TRUE(all.network.gateway());
    EXPECT_EQ(all.network.allow, (std::vector<std::string>{"*.example.com:443", "pypi.org:*"}));

    const SessionLimits narrow = policy.effective(
        json::object(),
        json{{"network",
              {{"mode", "gateway"}, {"allow", {"API.Example.com:443", "pypi.org:443"}}}}});
    EXPECT_EQ(narrow.network.allow,
              (std::vector<std::string>{"api.example.com:443", "pypi.org:443"}));

    for (const char* wider :
         {"example.com:443", "api.example.com:80", "*.com:443", "*:443", "evil.test:443"}) {
        const PolicyError e = policy_error([&] {
            policy.effective(json::object(),
                             json{{"network", {{"mode", "gateway"}, {"allow", {wider}}}}});
        });
        EXPECT_EQ(e.ename(), "LimitAboveMaximum") << wider;
        EXPECT_NE(std::string(e.what()).find("not within the server's allowlist"),
                  std::string::npos)
            << e.what();
    }
}

TEST(NetworkLimits, MistakesAreInvalidLimits) {
    const ServerPolicy policy = gateway_server({"*:*"});
    for (const json& bad :
         {json{{"network", "gateway"}}, json{{"network", {{"mode", "open"}}}},
          json{{"network", {{"allow", "pypi.org:443"}}}},
          json{{"network", {{"allow", {"pypi.org"}}}}}, json{{"network", {{"allow", {443}}}}},
          json{{"network", {{"max_bytes", 0}}}}, json{{"network", {{"request_timeout_s", -1}}}},
          json{{"network", {{"proxy", true}}}}}) {
        const PolicyError e = policy_error([&] { policy.effective(json::object(), bad); });
        EXPECT_EQ(e.ename(), "InvalidLimits") << bad.dump();
        EXPECT_NE(std::string(e.what()).find("network"), std::string::npos) << e.what();
    }
}

TEST(NetworkLimits, CapsAreBoundedByTheMaxima) {
    ServerPolicy policy = gateway_server({"*:*"});
    policy.maxima.network.max_connections = 8;
    const PolicyError e = policy_error([&] {
        policy.effective(json::object(), json{{"network", {{"max_connections", 9}}}});
    });
    EXPECT_EQ(e.ename(), "LimitAboveMaximum");
    const SessionLimits ok = policy.effective(
        json::object(), json{{"network", {{"max_connections", 8}, {"max_bytes", 1000}}}});
    EXPECT_EQ(ok.network.max_connections, 8);
    EXPECT_EQ(ok.network.max_bytes, 1000);
}

TEST(NetworkLimits, ImageLayerThenRequest) {
    const ServerPolicy policy = gateway_server({"pypi.org:443"});
    const json image = {{"network", {{"mode", "gateway"}}}};
    EXPECT_TRUE(policy.effective(image, json::object()).network.gateway());
    EXPECT_FALSE(policy.effective(image, json{{"network", {{"mode", "none"}}}}).network.gateway());
    const PolicyError e = policy_error([&] {
        policy.effective(json{{"network", {{"allow", {"evil.test:443"}}}}}, json::object());
    });
    EXPECT_NE(std::string(e.what()).find("image limits: "), std::string::npos) << e.what();
}

TEST(NetworkLimits, ValidateRefusesADefaultGatewayWithoutOne) {
    ServerPolicy policy;
    policy.defaults.network.mode = "gateway";
    EXPECT_THROW(policy.validate(), PolicyError);
    gateway_server({"pypi.org:443"}).validate();
}

TEST(SessionLimits, AbsentFieldsKeepTheBase) {
    SessionLimits base;
    base.max_executions = 7;
    base.sandbox.pids = 33;
    const SessionLimits out = SessionLimits::from_json(json{{"pids", 44}}, base);
    EXPECT_EQ(out.max_executions, 7);
    EXPECT_EQ(out.sandbox.pids, 44);
    EXPECT_EQ(SessionLimits::from_json(json(), base).to_json(), base.to_json());
}

TEST(SessionLimits, UnknownFieldIsInvalid) {
    const PolicyError e = policy_error([] {
        SessionLimits::from_json(json{{"foo", 1}}, SessionLimits{});
    });
    EXPECT_EQ(e.ename(), "InvalidLimits");
    EXPECT_STREQ(e.what(), "unknown limit 'foo'");
}

TEST(SessionLimits, WrongTypesAndNonPositiveValuesAreInvalid) {
    for (const json& bad :
         {json{{"memory_mb", "512"}}, json{{"memory_mb", true}}, json{{"memory_mb", 1.5}},
          json{{"memory_mb", 0}}, json{{"max_executions", -3}}, json{{"exec_timeout_s", 0.0}},
          json{{"exec_timeout_s", -1}}, json{{"cpus", nullptr}},
          json{{"idle_timeout_s", json::array({1})}}, json::array()}) {
        const PolicyError e = policy_error([&] { SessionLimits::from_json(bad, SessionLimits{}); });
        EXPECT_EQ(e.ename(), "InvalidLimits") << bad.dump();
    }
    EXPECT_STREQ(policy_error([] {
                     SessionLimits::from_json(json{{"pids", 0}}, SessionLimits{});
                 }).what(),
                 "pids must be positive, got 0");
    EXPECT_STREQ(policy_error([] {
                     SessionLimits::from_json(json{{"pids", "many"}}, SessionLimits{});
                 }).what(),
                 "pids must be a positive integer, got string");
}

TEST(SessionLimits, NumbersAreAcceptedInEitherJsonForm) {
    const SessionLimits out = SessionLimits::from_json(
        json{{"memory_mb", 2048.0}, {"exec_timeout_s", 45}, {"cpus", 0.5}}, SessionLimits{});
    EXPECT_EQ(out.sandbox.memory_mb, 2048);
    EXPECT_DOUBLE_EQ(out.exec_timeout_s, 45);
    EXPECT_DOUBLE_EQ(out.sandbox.cpus, 0.5);
}

TEST(ServerPolicy, DefaultsAreWithinTheMaxima) {
    const ServerPolicy policy;
    EXPECT_NO_THROW(policy.validate());
    EXPECT_EQ(policy.defaults.to_json(), SessionLimits{}.to_json());
    EXPECT_EQ(policy.maxima.max_executions, 100000);
    EXPECT_DOUBLE_EQ(policy.maxima.exec_timeout_s, 3600);
    EXPECT_DOUBLE_EQ(policy.maxima.lifetime_s, 7 * 24 * 3600);
    EXPECT_GE(policy.maxima.sandbox.cpus, 1.0);
    const json j = policy.to_json();
    EXPECT_EQ(j.at("maxima").at("memory_mb"), 16384);
    EXPECT_EQ(j.at("defaults"), SessionLimits{}.to_json());
    EXPECT_TRUE(j.contains("kill_grace_s"));
    EXPECT_TRUE(j.contains("max_sessions"));
}

TEST(ServerPolicy, ValidateCatchesADefaultAboveItsMaximum) {
    ServerPolicy policy;
    policy.defaults.sandbox.pids = policy.maxima.sandbox.pids + 1;
    EXPECT_EQ(policy_error([&] { policy.validate(); }).ename(), "InvalidLimits");
    // And a session never receives it.
    EXPECT_EQ(policy_error([&] { policy.effective(json::object(), json::object()); }).ename(),
              "LimitAboveMaximum");
}

TEST(ServerPolicy, LayersAreDefaultsThenImageThenRequest) {
    ServerPolicy policy;
    policy.defaults.max_executions = 10;
    policy.defaults.exec_timeout_s = 20;
    policy.defaults.sandbox.memory_mb = 256;
    policy.defaults.sandbox.pids = 100;
    const json image = {{"exec_timeout_s", 60}, {"memory_mb", 512}, {"pids", 200}};
    const json request = {{"memory_mb", 1024}};
    const SessionLimits out = policy.effective(image, request);
    EXPECT_EQ(out.max_executions, 10);         // server default
    EXPECT_DOUBLE_EQ(out.exec_timeout_s, 60);  // image over default
    EXPECT_EQ(out.sandbox.pids, 200);          // image over default
    EXPECT_EQ(out.sandbox.memory_mb, 1024);    // request over image
    // A request may also ask for less than the image.
    EXPECT_EQ(policy.effective(image, json{{"pids", 5}}).sandbox.pids, 5);
    // No layers at all: the defaults.
    EXPECT_EQ(policy.effective(json(), json()).to_json(), policy.defaults.to_json());
}

TEST(ServerPolicy, RequestAboveTheMaximumIsAnErrorNotAClamp) {
    ServerPolicy policy;
    policy.maxima.exec_timeout_s = 600;
    const PolicyError e = policy_error([&] {
        policy.effective(json::object(), json{{"exec_timeout_s", 900}});
    });
    EXPECT_EQ(e.ename(), "LimitAboveMaximum");
    EXPECT_STREQ(e.what(), "exec_timeout_s 900 is above the server's maximum 600");
    // Exactly the maximum is allowed.
    EXPECT_DOUBLE_EQ(policy.effective(json(), json{{"exec_timeout_s", 600}}).exec_timeout_s, 600);
    // Larger than the field itself can hold is still "above the maximum".
    EXPECT_EQ(policy_error([&] {
                  policy.effective(json(), json{{"memory_mb", 3000000000LL}});
              }).ename(),
              "LimitAboveMaximum");
}

TEST(ServerPolicy, ImageAboveTheMaximumIsAnError) {
    const ServerPolicy policy;
    const PolicyError e = policy_error([&] {
        policy.effective(json{{"memory_mb", 99999}}, json::object());
    });
    EXPECT_EQ(e.ename(), "LimitAboveMaximum");
    EXPECT_STREQ(e.what(), "image limits: memory_mb 99999 is above the server's maximum 16384");
    // A request cannot rescue it by asking for less of something else.
    EXPECT_THROW(policy.effective(json{{"pids", 5000}}, json{{"memory_mb", 512}}), PolicyError);
}

TEST(ServerPolicy, UnknownAndMistypedFieldsInEitherLayer) {
    const ServerPolicy policy;
    PolicyError e = policy_error([&] { policy.effective(json(), json{{"foo", 1}}); });
    EXPECT_EQ(e.ename(), "InvalidLimits");
    EXPECT_STREQ(e.what(), "unknown limit 'foo'");
    e = policy_error([&] { policy.effective(json{{"gpus", 1}}, json()); });
    EXPECT_EQ(e.ename(), "InvalidLimits");
    EXPECT_STREQ(e.what(), "image limits: unknown limit 'gpus'");
    e = policy_error([&] { policy.effective(json(), json{{"cpus", "2"}}); });
    EXPECT_EQ(e.ename(), "InvalidLimits");
    e = policy_error([&] { policy.effective(json(), json{{"lifetime_s", -5}}); });
    EXPECT_EQ(e.ename(), "InvalidLimits");
    e = policy_error([&] { policy.effective(json(), json("lots")); });
    EXPECT_EQ(e.ename(), "InvalidLimits");
}

// ---- execution cap and timeouts ----

SessionLimits small_limits() {
    SessionLimits limits;
    limits.max_executions = 3;
    limits.exec_timeout_s = 30;
    limits.idle_timeout_s = 600;
    limits.lifetime_s = 3600;
    limits.output_bytes = 100;
    return limits;
}

TEST(SessionGovernor, CapReachedOnTheFourthOfThreeAndTheRefusedOneIsNotCounted) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    for (int i = 1; i <= 3; ++i) {
        const auto d = gov.on_execute_request(t0 + std::chrono::seconds(i), std::nullopt);
        EXPECT_TRUE(d.forward) << i;
        gov.on_execute_reply(t0 + std::chrono::seconds(i) + 100ms, 1, 1);
    }
    EXPECT_EQ(gov.executions(), 3);
    EXPECT_EQ(gov.executions_left(), 0);
    for (int attempt = 0; attempt < 2; ++attempt) {
        const auto d = gov.on_execute_request(t0 + 10s, std::nullopt);
        EXPECT_FALSE(d.forward);
        EXPECT_EQ(d.ename, "ExecutionLimitExceeded");
        EXPECT_EQ(d.evalue, "this session allows 3 executions; all 3 are used");
        EXPECT_EQ(gov.executions(), 3);
        EXPECT_FALSE(gov.busy());
    }
}

TEST(SessionGovernor, DeadlineIsTheSessionTimeoutByDefault) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    const auto d = gov.on_execute_request(t0 + 5s, std::nullopt);
    ASSERT_TRUE(d.forward);
    EXPECT_EQ(d.deadline, t0 + 35s);
    EXPECT_TRUE(gov.busy());
}

TEST(SessionGovernor, RequestedTimeoutMayExceedTheSessionsUpToTheServerMaximum) {
    ServerPolicy policy;
    policy.maxima.exec_timeout_s = 600;
    SessionGovernor gov(small_limits(), policy, t0);

    auto d = gov.on_execute_request(t0, 120.0);  // above the session's 30, below 600
    ASSERT_TRUE(d.forward);
    EXPECT_EQ(d.deadline, t0 + 120s);
    EXPECT_DOUBLE_EQ(gov.on_execute_reply(t0 + 1s, 0, 0).at("timeout_s").get<double>(), 120);

    d = gov.on_execute_request(t0 + 2s, 600.0);  // exactly the maximum
    ASSERT_TRUE(d.forward);
    EXPECT_EQ(d.deadline, t0 + 602s);
    gov.on_execute_reply(t0 + 3s, 0, 0);

    d = gov.on_execute_request(t0 + 4s, 601.0);
    EXPECT_FALSE(d.forward);
    EXPECT_EQ(d.ename, "LimitAboveMaximum");
    EXPECT_EQ(d.evalue, "timeout_s 601 is above the server's maximum 600");
    EXPECT_EQ(gov.executions(), 2);
    EXPECT_FALSE(gov.busy());

    for (double bad : {0.0, -1.0}) {
        d = gov.on_execute_request(t0 + 5s, bad);
        EXPECT_FALSE(d.forward);
        EXPECT_EQ(d.ename, "InvalidLimits");
    }
    EXPECT_EQ(gov.executions(), 2);

    d = gov.on_execute_request(t0 + 6s, 0.5);  // less than the session's is fine
    ASSERT_TRUE(d.forward);
    EXPECT_EQ(d.deadline, t0 + 6500ms);
}

// ---- interrupt escalation ----

TEST(SessionGovernor, AnIgnoredInterruptIsDueAfterTheGraceOfTheFirstInterrupt) {
    const ServerPolicy policy;
    SessionLimits limits = small_limits();
    limits.interrupt_grace_s = 5;
    SessionGovernor gov(limits, policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);
    EXPECT_EQ(gov.interrupt_deadline(), std::nullopt);
    gov.on_interrupt(t0 + 2s);
    EXPECT_EQ(gov.interrupt_deadline(), t0 + 7s);
    gov.on_interrupt(t0 + 4s);  // a second interrupt does not extend the grace
    EXPECT_EQ(gov.interrupt_deadline(), t0 + 7s);
    EXPECT_FALSE(gov.interrupt_ignored(t0 + 6999ms));
    EXPECT_TRUE(gov.interrupt_ignored(t0 + 7s));
}

TEST(SessionGovernor, AReplyEndsTheGraceAndAnIdleInterruptStartsNone) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    gov.on_interrupt(t0);  // nothing runs: nothing to escalate
    EXPECT_EQ(gov.interrupt_deadline(), std::nullopt);
    ASSERT_TRUE(gov.on_execute_request(t0 + 1s, std::nullopt).forward);
    gov.on_interrupt(t0 + 2s);
    gov.on_execute_reply(t0 + 3s, 0, 0);  // the code stopped (KeyboardInterrupt)
    EXPECT_EQ(gov.interrupt_deadline(), std::nullopt);
    EXPECT_FALSE(gov.interrupt_ignored(t0 + 1h));
    ASSERT_TRUE(gov.on_execute_request(t0 + 4s, std::nullopt).forward);
    EXPECT_FALSE(gov.interrupt_ignored(t0 + 1h));  // a new execution starts with none
}

TEST(SessionLimits, InterruptGraceIsALimitWithAMaximum) {
    const ServerPolicy policy;
    EXPECT_DOUBLE_EQ(policy.defaults.interrupt_grace_s, 5);
    EXPECT_DOUBLE_EQ(policy.effective(json(), json{{"interrupt_grace_s", 1.5}}).interrupt_grace_s,
                     1.5);
    const PolicyError e = policy_error([&] {
        policy.effective(json(), json{{"interrupt_grace_s", 601}});
    });
    EXPECT_EQ(e.ename(), "LimitAboveMaximum");
    EXPECT_STREQ(e.what(), "interrupt_grace_s 601 is above the server's maximum 600");
}

// ---- idle and lifetime ----

TEST(SessionGovernor, IdleExpiryOnlyWhenNotBusy) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);  // idle 600 s, lifetime 3600 s
    EXPECT_EQ(gov.expiry(t0 + 599s), std::nullopt);
    EXPECT_EQ(gov.expiry(t0 + 600s), "idle_timeout");

    gov.on_client_request(t0 + 500s);  // resets the idle clock
    EXPECT_EQ(gov.expiry(t0 + 1099s), std::nullopt);
    EXPECT_EQ(gov.expiry(t0 + 1100s), "idle_timeout");

    // A long execution: never idle while it runs.
    ASSERT_TRUE(gov.on_execute_request(t0 + 1000s, 1000.0).forward);
    EXPECT_EQ(gov.expiry(t0 + 1900s), std::nullopt);
    // Its reply restarts the idle clock, so the session does not expire at once.
    gov.on_execute_reply(t0 + 1950s, 0, 0);
    EXPECT_EQ(gov.expiry(t0 + 1951s), std::nullopt);
    EXPECT_EQ(gov.expiry(t0 + 2549s), std::nullopt);
    EXPECT_EQ(gov.expiry(t0 + 2550s), "idle_timeout");
}

TEST(SessionGovernor, LifetimeExpiryEvenWhenBusy) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0 + 3500s, 600.0).forward);
    EXPECT_TRUE(gov.busy());
    EXPECT_EQ(gov.expiry(t0 + 3599s), std::nullopt);
    EXPECT_EQ(gov.expiry(t0 + 3600s), "lifetime");
    // Lifetime wins when both are due.
    SessionGovernor quiet(small_limits(), policy, t0);
    EXPECT_EQ(quiet.expiry(t0 + 4000s), "lifetime");
}

TEST(SessionGovernor, NextExpiryCheckIsTheEarlierOfIdleAndLifetime) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    EXPECT_EQ(gov.next_expiry_check(t0), t0 + 600s);  // idle first
    gov.on_client_request(t0 + 3200s);
    EXPECT_EQ(gov.next_expiry_check(t0 + 3200s), t0 + 3600s);  // lifetime first now

    SessionGovernor busy(small_limits(), policy, t0);
    ASSERT_TRUE(busy.on_execute_request(t0 + 10s, std::nullopt).forward);
    EXPECT_EQ(busy.next_expiry_check(t0 + 10s), t0 + 3600s);  // busy: only lifetime
    busy.on_execute_reply(t0 + 20s, 0, 0);
    EXPECT_EQ(busy.next_expiry_check(t0 + 20s), t0 + 620s);

    // Already due: never a time in the past.
    EXPECT_EQ(busy.next_expiry_check(t0 + 5000s), t0 + 5000s);
}

// ---- output shaping ----

TEST(SessionGovernor, StreamIsCutOnceWithOneMarkerAndExactDropCount) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);  // 100 bytes per execution
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);

    auto d = gov.on_stream(std::size_t{60});
    EXPECT_EQ(d.keep, 60U);
    EXPECT_FALSE(d.add_marker);
    d = gov.on_stream(std::size_t{30});
    EXPECT_EQ(d.keep, 30U);
    EXPECT_FALSE(d.add_marker);
    EXPECT_FALSE(gov.truncated());

    d = gov.on_stream(std::size_t{25});  // crosses: 10 kept, 15 dropped
    EXPECT_EQ(d.keep, 10U);
    EXPECT_TRUE(d.add_marker);
    EXPECT_EQ(d.marker,
              "\n[cellblock: output truncated at 100 bytes; the rest of this execution's "
              "output is dropped]\n");
    EXPECT_EQ(gov.dropped_bytes(), 15U);

    int markers = 1;
    std::uint64_t expected_dropped = 15;
    for (std::size_t n = 1; n <= 50; ++n) {
        d = gov.on_stream(n);
        EXPECT_EQ(d.keep, 0U);
        markers += d.add_marker ? 1 : 0;
        expected_dropped += n;
    }
    EXPECT_EQ(markers, 1);
    EXPECT_EQ(gov.dropped_bytes(), expected_dropped);
    EXPECT_TRUE(gov.truncated());

    const json meta = gov.on_execute_reply(t0 + 1s, 0, 0);
    EXPECT_EQ(meta.at("output_bytes"), 100);
    EXPECT_EQ(meta.at("output_truncated"), true);
    EXPECT_EQ(meta.at("output_dropped_bytes"), expected_dropped);

    // The next execution starts afresh.
    ASSERT_TRUE(gov.on_execute_request(t0 + 2s, std::nullopt).forward);
    EXPECT_EQ(gov.dropped_bytes(), 0U);
    EXPECT_FALSE(gov.truncated());
    d = gov.on_stream(std::size_t{100});
    EXPECT_EQ(d.keep, 100U);
    EXPECT_FALSE(d.add_marker);
    d = gov.on_stream(std::size_t{1});
    EXPECT_EQ(d.keep, 0U);
    EXPECT_TRUE(d.add_marker);
    EXPECT_EQ(gov.dropped_bytes(), 1U);
}

TEST(SessionGovernor, MessageEndingExactlyAtTheLimitAddsNoMarker) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);
    auto d = gov.on_stream(std::size_t{100});
    EXPECT_EQ(d.keep, 100U);
    EXPECT_FALSE(d.add_marker);
    d = gov.on_stream(std::size_t{0});
    EXPECT_FALSE(d.add_marker);
    EXPECT_FALSE(gov.truncated());
    d = gov.on_stream(std::size_t{7});  // the first byte over carries the marker
    EXPECT_EQ(d.keep, 0U);
    EXPECT_TRUE(d.add_marker);
    EXPECT_EQ(gov.dropped_bytes(), 7U);
}

// Display data shares the streams' budget, whole or not at all; the first
// thing dropped (a stream byte or a display) is the one that carries a notice.
TEST(SessionGovernor, DisplayDataSharesTheBudgetAndIsDroppedWhole) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);  // 100 bytes per execution
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);
    EXPECT_EQ(gov.on_stream(std::size_t{40}).keep, 40U);
    auto d = gov.on_display(50);
    EXPECT_TRUE(d.keep);
    EXPECT_FALSE(d.add_notice);
    d = gov.on_display(20);  // 110 > 100: dropped whole, with the notice
    EXPECT_FALSE(d.keep);
    EXPECT_TRUE(d.add_notice);
    d = gov.on_display(5);  // would fit, but nothing resumes after a cut
    EXPECT_FALSE(d.keep);
    EXPECT_FALSE(d.add_notice);
    const auto s = gov.on_stream(std::size_t{3});
    EXPECT_EQ(s.keep, 0U);
    EXPECT_FALSE(s.add_marker);  // the notice was the one marker
    EXPECT_EQ(gov.dropped_bytes(), 28U);
    const json meta = gov.on_execute_reply(t0 + 1s, 0, 0);
    EXPECT_EQ(meta.at("output_bytes"), 90);
    EXPECT_EQ(meta.at("output_truncated"), true);
    EXPECT_EQ(meta.at("output_dropped_bytes"), 28);
}

// What the kernel reports it dropped at its source counts as dropped, apart too.
TEST(SessionGovernor, OutputDroppedAtTheSourceIsCountedAndReported) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);
    EXPECT_EQ(gov.on_stream(std::size_t{101}).keep, 100U);
    gov.on_dropped_at_source(5000);
    EXPECT_EQ(gov.dropped_bytes(), 5001U);
    json meta = gov.on_execute_reply(t0 + 1s, 0, 0);
    EXPECT_EQ(meta.at("output_dropped_bytes"), 5001);
    EXPECT_EQ(meta.at("output_dropped_in_kernel_bytes"), 5000);
    EXPECT_EQ(meta.at("output_truncated"), true);
    // A kernel's figure cannot wrap the sum.
    ASSERT_TRUE(gov.on_execute_request(t0 + 2s, std::nullopt).forward);
    gov.on_dropped_at_source(UINT64_MAX);
    gov.on_dropped_at_source(UINT64_MAX);
    EXPECT_EQ(gov.dropped_bytes(), std::uint64_t{2} << 52);
    meta = gov.on_execute_reply(t0 + 3s, 0, 0);
    EXPECT_EQ(meta.at("output_dropped_in_kernel_bytes"), std::uint64_t{2} << 52);
}

TEST(Utf8SafePrefix, NeverEndsInsideACharacter) {
    const std::string text =
        "ab\xC3\xA9"          // é, 2 bytes, at 2..3
        "\xE2\x82\xAC"        // €, 3 bytes, at 4..6
        "\xF0\x9F\x98\x80!";  // 😀, 4 bytes, at 7..10, then '!'
    ASSERT_EQ(text.size(), 12U);
    EXPECT_EQ(utf8_safe_prefix(text, 0), 0U);
    EXPECT_EQ(utf8_safe_prefix(text, 2), 2U);
    EXPECT_EQ(utf8_safe_prefix(text, 3), 2U);  // inside é
    EXPECT_EQ(utf8_safe_prefix(text, 4), 4U);
    EXPECT_EQ(utf8_safe_prefix(text, 5), 4U);  // inside €
    EXPECT_EQ(utf8_safe_prefix(text, 6), 4U);
    EXPECT_EQ(utf8_safe_prefix(text, 7), 7U);
    EXPECT_EQ(utf8_safe_prefix(text, 8), 7U);  // inside 😀
    EXPECT_EQ(utf8_safe_prefix(text, 9), 7U);
    EXPECT_EQ(utf8_safe_prefix(text, 10), 7U);
    EXPECT_EQ(utf8_safe_prefix(text, 11), 11U);
    EXPECT_EQ(utf8_safe_prefix(text, 12), 12U);
    EXPECT_EQ(utf8_safe_prefix(text, 1000), 12U);
    EXPECT_EQ(utf8_safe_prefix("", 5), 0U);
    // Not UTF-8 (a run of continuation bytes): cut where asked.
    EXPECT_EQ(utf8_safe_prefix("\x80\x80\x80\x80\x80\x80", 5), 5U);
}

TEST(SessionGovernor, StreamTextIsCutAtACharacterBoundary) {
    SessionLimits limits = small_limits();
    limits.output_bytes = 5;
    const ServerPolicy policy;
    SessionGovernor gov(limits, policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0, std::nullopt).forward);
    const std::string euros = "\xE2\x82\xAC\xE2\x82\xAC";  // €€: the limit falls in the 2nd
    auto d = gov.on_stream(std::string_view(euros));
    EXPECT_EQ(d.keep, 3U);
    EXPECT_TRUE(d.add_marker);
    EXPECT_EQ(gov.dropped_bytes(), 3U);
    // The 2 bytes of room left never let text resume after the marker.
    d = gov.on_stream(std::string_view("ab"));
    EXPECT_EQ(d.keep, 0U);
    EXPECT_FALSE(d.add_marker);
    EXPECT_EQ(gov.dropped_bytes(), 5U);
    EXPECT_EQ(gov.on_execute_reply(t0 + 1s, 0, 0).at("output_bytes"), 3);
}

// ---- reply metadata ----

TEST(SessionGovernor, ReplyMetadataCarriesTheBudget) {
    const ServerPolicy policy;
    SessionGovernor gov(small_limits(), policy, t0);
    ASSERT_TRUE(gov.on_execute_request(t0 + 1s, std::nullopt).forward);
    gov.on_stream(std::size_t{42});
    const json meta = gov.on_execute_reply(t0 + 1s + 1234ms, 987, 50u << 20);
    EXPECT_FALSE(gov.busy());
    EXPECT_EQ(meta, (json{{"executions_used", 1},
                          {"executions_left", 2},
                          {"max_executions", 3},
                          {"wall_ms", 1234},
                          {"cpu_ms", 987},
                          {"memory_peak_bytes", 50u << 20},
                          {"output_bytes", 42},
                          {"output_truncated", false},
                          {"output_dropped_bytes", 0},
                          {"output_dropped_in_kernel_bytes", 0},
                          {"timeout_s", 30.0}}));
}

TEST(SessionGovernor, AFailedHibernationIsRetriedLaterEachTimeUpToAnHour) {
    ServerPolicy policy;
    SessionLimits limits = small_limits();
    limits.hibernate_after_s = 5;
    SessionGovernor gov(limits, policy, t0);
    EXPECT_TRUE(gov.hibernation_due(t0 + 5s));
    // At least a minute even when hibernate_after_s is shorter; then doubling, to an hour.
    auto now = t0 + 5s;
    for (const int expected : {60, 120, 240, 480, 960, 1920, 3600, 3600}) {
        const auto wait = gov.hibernation_declined(now);
        EXPECT_EQ(std::chrono::duration_cast<std::chrono::seconds>(wait).count(), expected);
        EXPECT_FALSE(gov.hibernation_due(now + wait - 1s));
        EXPECT_TRUE(gov.hibernation_due(now + wait));
        EXPECT_EQ(gov.next_hibernation(now), now + wait);
        now += wait;
    }
    // A client's request: only hibernate_after_s of idleness again.
    gov.on_client_request(now);
    EXPECT_TRUE(gov.hibernation_due(now + 5s));
    EXPECT_EQ(std::chrono::duration_cast<std::chrono::seconds>(gov.hibernation_declined(now + 5s))
                  .count(),
              60);
}

}  // namespace
}  // namespace cellblock
