// The metrics registry as a value: families, series, and their text in both
// formats, checked byte for byte.
#include "metrics_registry.hpp"

#include <limits>
#include <stdexcept>

#include <gtest/gtest.h>

#include "egress_gateway.hpp"
#include "server_metrics.hpp"

namespace cellblock {
namespace {

TEST(MetricNumber, ShortestRoundTripAndSpecials) {
    EXPECT_EQ(metric_number(0), "0");
    EXPECT_EQ(metric_number(3), "3");
    EXPECT_EQ(metric_number(0.25), "0.25");
    EXPECT_EQ(metric_number(1e21), "1e+21");
    EXPECT_EQ(metric_number(std::numeric_limits<double>::infinity()), "+Inf");
    EXPECT_EQ(metric_number(-std::numeric_limits<double>::infinity()), "-Inf");
    EXPECT_EQ(metric_number(std::numeric_limits<double>::quiet_NaN()), "NaN");
    EXPECT_EQ(metric_number(1, true), "1.0");
    EXPECT_EQ(metric_number(0.005, true), "0.005");
}

TEST(MetricsRegistry, CounterInBothFormats) {
    MetricsRegistry r;
    auto& c = r.counter("cellblock_session_closes", "sessions closed", {"image", "reason"});
    c.add({"host", "idle_timeout"});
    c.add({"host", "idle_timeout"}, 2);
    c.add({"data", "memory_limit"});
    c.add({"data", "memory_limit"}, -5);  // a counter never goes down
    EXPECT_EQ(r.render(MetricsFormat::prometheus_text),
              "# HELP cellblock_session_closes_total sessions closed\n"
              "# TYPE cellblock_session_closes_total counter\n"
              "cellblock_session_closes_total{image=\"data\",reason=\"memory_limit\"} 1\n"
              "cellblock_session_closes_total{image=\"host\",reason=\"idle_timeout\"} 3\n");
    EXPECT_EQ(r.render(MetricsFormat::openmetrics),
              "# TYPE cellblock_session_closes counter\n"
              "# HELP cellblock_session_closes sessions closed\n"
              "cellblock_session_closes_total{image=\"data\",reason=\"memory_limit\"} 1\n"
              "cellblock_session_closes_total{image=\"host\",reason=\"idle_timeout\"} 3\n"
              "# EOF\n");
}

TEST(MetricsRegistry, GaugeSetAddClearAndNoLabels) {
    MetricsRegistry r;
    auto& g = r.gauge("cellblock_sessions", "open sessions", {"state"});
    auto& m = r.gauge("cellblock_sessions_max", "the maximum");
    g.set({"idle"}, 4);
    g.add({"idle"}, -1);
    g.set({"busy"}, 1);
    m.set({}, 100);
    EXPECT_EQ(r.render(MetricsFormat::prometheus_text),
              "# HELP cellblock_sessions open sessions\n"
              "# TYPE cellblock_sessions gauge\n"
              "cellblock_sessions{state=\"busy\"} 1\n"
              "cellblock_sessions{state=\"idle\"} 3\n"
              "# HELP cellblock_sessions_max the maximum\n"
              "# TYPE cellblock_sessions_max gauge\n"
              "cellblock_sessions_max 100\n");
    g.replace({{{"idle"}, 7}});
    EXPECT_NE(r.render(MetricsFormat::prometheus_text)
                  .find("cellblock_sessions{state=\"idle\"} 7\n"
                        "# HELP cellblock_sessions_max"),
              std::string::npos);
    g.clear();
    EXPECT_EQ(r.render(MetricsFormat::openmetrics),
              "# TYPE cellblock_sessions gauge\n"
              "# HELP cellblock_sessions open sessions\n"
              "# TYPE cellblock_sessions_max gauge\n"
              "# HELP cellblock_sessions_max the maximum\n"
              "cellblock_sessions_max 100\n"
              "# EOF\n");
}

TEST(MetricsRegistry, HistogramBucketsAreCumulative) {
    MetricsRegistry r;
    auto& h = r.histogram("cellblock_execution_seconds", "wall seconds", {"image"}, {0.1, 1, 10});
    h.observe({"host"}, 0.05);
    h.observe({"host"}, 0.1);  // on a bound: in that bucket (le)
    h.observe({"host"}, 2);
    h.observe({"host"}, 50);
    const std::string series =
        "cellblock_execution_seconds_bucket{image=\"host\",le=\"0.1\"} 2\n"
        "cellblock_execution_seconds_bucket{image=\"host\",le=\"1.0\"} 2\n"
        "cellblock_execution_seconds_bucket{image=\"host\",le=\"10.0\"} 3\n"
        "cellblock_execution_seconds_bucket{image=\"host\",le=\"+Inf\"} 4\n"
        "cellblock_execution_seconds_sum{image=\"host\"} 52.15\n"
        "cellblock_execution_seconds_count{image=\"host\"} 4\n";
    EXPECT_EQ(r.render(MetricsFormat::prometheus_text),
              "# HELP cellblock_execution_seconds wall seconds\n"
              "# TYPE cellblock_execution_seconds histogram\n" +
                  series);
    EXPECT_EQ(r.render(MetricsFormat::openmetrics),
              "# TYPE cellblock_execution_seconds histogram\n"
              "# HELP cellblock_execution_seconds wall seconds\n" +
                  series + "# EOF\n");
}

TEST(MetricsRegistry, EscapesHelpAndLabelValues) {
    MetricsRegistry r;
    auto& g = r.gauge("x", "a \"quoted\" back\\slash\nnewline", {"v"});
    g.set({"a\"b\\c\nd"}, 1);
    EXPECT_EQ(r.render(MetricsFormat::prometheus_text),
              "# HELP x a \"quoted\" back\\\\slash\\nnewline\n"
              "# TYPE x gauge\n"
              "x{v=\"a\\\"b\\\\c\\nd\"} 1\n");
    EXPECT_EQ(r.render(MetricsFormat::openmetrics),
              "# TYPE x gauge\n"
              "# HELP x a \\\"quoted\\\" back\\\\slash\\nnewline\n"
              "x{v=\"a\\\"b\\\\c\\nd\"} 1\n"
              "# EOF\n");
}

TEST(MetricsRegistry, RefusesBadNamesAndLabels) {
    MetricsRegistry r;
    EXPECT_THROW(r.counter("requests_total", "x"), std::invalid_argument);
    EXPECT_THROW(r.gauge("1abc", "x"), std::invalid_argument);
    EXPECT_THROW(r.gauge("a-b", "x"), std::invalid_argument);
    EXPECT_THROW(r.gauge("ok", "x", {"le"}), std::invalid_argument);
    EXPECT_THROW(r.gauge("ok", "x", {"__reserved"}), std::invalid_argument);
    EXPECT_THROW(r.histogram("h", "x", {}, {1, 1}), std::invalid_argument);
    r.gauge("taken", "x");
    EXPECT_THROW(r.gauge("taken", "x"), std::invalid_argument);
    auto& g = r.gauge("two", "x", {"a", "b"});
    EXPECT_THROW(g.set({"only one"}, 1), std::invalid_argument);
}

TEST(ServerMetricsLabels, CloseReasonsAreBounded) {
    EXPECT_EQ(close_reason_label("idle_timeout"), "idle_timeout");
    EXPECT_EQ(close_reason_label("memory_limit: the kernel was killed (OOM)"), "memory_limit");
    EXPECT_EQ(close_reason_label("kernel_died: exit 1"), "kernel_died");
    EXPECT_EQ(close_reason_label("shutdown requested by the client"), "client_shutdown");
    EXPECT_EQ(close_reason_label("closed_by_request"), "closed_by_request");
    EXPECT_EQ(close_reason_label("anything else"), "other");
}

TEST(ServerMetricsLabels, ErrorsFromTheCatalogueOnly) {
    EXPECT_EQ(error_label(""), "");
    EXPECT_EQ(error_label("ExecutionLimitExceeded"), "ExecutionLimitExceeded");
    EXPECT_EQ(error_label("MemoryLimitExceeded"), "MemoryLimitExceeded");
    EXPECT_EQ(error_label("ZeroDivisionError"), "code");
    EXPECT_EQ(error_label("MyOwnError_4f2a"), "code");
}

TEST(ServerMetricsLabels, DropReasons) {
    EXPECT_EQ(drop_reason_label("bad signature"), "bad_signature");
    EXPECT_EQ(drop_reason_label("replayed message"), "replayed");
    EXPECT_EQ(drop_reason_label("frame too large"), "too_large");
    EXPECT_EQ(drop_reason_label("too many frames"), "too_large");
    EXPECT_EQ(drop_reason_label("parent is not a request of this session: 'x'"), "unknown_parent");
    EXPECT_EQ(drop_reason_label("reply to a request that is not open: 'x'"), "unexpected_reply");
    EXPECT_EQ(drop_reason_label("'x' is not a request"), "not_a_request");
    EXPECT_EQ(drop_reason_label("frame 2 is not a JSON object"), "malformed");
    EXPECT_EQ(drop_reason_label("something new"), "other");
}

// The server's metrics from events, as an operator reads them.
TEST(ServerMetrics, CountsWhatTheObserversSee) {
    ServerMetrics m("0.1.0");
    const std::string s1 = "s1", s2 = "s2", host = "host";
    m.created({s1, host}, true, 0.004);
    m.created({s2, host}, false, 1.2);
    m.create_refused("", "UnknownImage");
    ExecutionRecord ok;
    ok.session_id = "s1";
    ok.status = "ok";
    ok.wall_ms = 3;
    m.execution({s1, host}, ok);
    ExecutionRecord failed = ok;
    failed.status = "error";
    failed.ename = "ZeroDivisionError";
    m.execution({s1, host}, failed);
    m.event({s1, host}, "refused", "msg-1 ExecutionLimitExceeded: 3 executions, the cap is 3");
    m.event({s2, host}, "cpu_demoted", "a fork storm");
    m.closed({"s2", "host", "memory_limit: killed"});
    m.dropped("kernel iopub", "parent is not a request of this session: 'x'");
    EgressEvent refused;
    refused.session_id = "s1";
    refused.detail = {{"verdict", "refused"}, {"status", 403}, {"bytes_up", 10}, {"bytes_down", 0}};
    m.egress({s1, host}, refused);
    m.file_bytes("in", "manager", 1024);
    ServerMetrics::Snapshot snap;
    snap.images = {"host", "data"};
    snap.sessions[{"host", "idle"}] = 1;
    snap.waiting["host"] = 2;
    snap.max_sessions = 3;
    const auto now = ServerMetrics::Clock::now();
    m.tick(now, snap);
    const std::string text =
        m.render(MetricsFormat::prometheus_text,
                 {{"host", {{"ready", 2}, {"starting", 0}, {"target", 2}, {"failures", 0}}}},
                 nlohmann::json::array({{{"kind", "zygote"}, {"image", "host"}}}));
    for (const char* line : {
             "cellblock_session_creates_total{image=\"host\",outcome=\"warm\"} 1\n",
             "cellblock_session_creates_total{image=\"host\",outcome=\"cold\"} 1\n",
             "cellblock_session_creates_total{image=\"\",outcome=\"UnknownImage\"} 1\n",
             "cellblock_session_create_seconds_bucket{image=\"host\",start=\"warm\",le=\"0.005\"} "
             "1\n",
             "cellblock_executions_total{image=\"host\",outcome=\"ok\",error=\"\"} 1\n",
             "cellblock_executions_total{image=\"host\",outcome=\"error\",error=\"code\"} 1\n",
             "cellblock_executions_total{image=\"host\",outcome=\"refused\",error="
             "\"ExecutionLimitExceeded\"} 1\n",
             "cellblock_execution_seconds_count{image=\"host\"} 2\n",
             "cellblock_cpu_fairness_events_total{event=\"demoted\"} 1\n",
             "cellblock_session_closes_total{image=\"host\",reason=\"memory_limit\"} 1\n",
             "cellblock_memory_kills_total{image=\"host\"} 1\n",
             "cellblock_relay_dropped_messages_total{side=\"kernel\",reason=\"unknown_parent\"} "
             "1\n",
             "cellblock_gateway_requests_total{verdict=\"refused\"} 1\n",
             "cellblock_gateway_refusals_total{status=\"403\"} 1\n",
             "cellblock_gateway_bytes_total{direction=\"up\"} 10\n",
             "cellblock_file_transfer_bytes_total{direction=\"in\",via=\"manager\"} 1024\n",
             "cellblock_sessions{image=\"host\",state=\"idle\"} 1\n",
             "cellblock_sessions{image=\"host\",state=\"starting\"} 2\n",
             "cellblock_sessions{image=\"host\",state=\"busy\"} 0\n",
             "cellblock_sessions{image=\"data\",state=\"idle\"} 0\n",
             "cellblock_sessions_max 3\n",
             "cellblock_pool_sandboxes{image=\"host\",state=\"ready\"} 2\n",
             "cellblock_zygotes{image=\"host\",state=\"running\"} 1\n",
             "cellblock_build_info{version=\"0.1.0\"} 1\n",
             "# TYPE process_cpu_seconds_total counter\n",
             "# TYPE process_resident_memory_bytes gauge\n",
         }) {
        EXPECT_NE(text.find(line), std::string::npos) << line << "\nnot in\n" << text;
    }
    // 1 open + 2 starting = the maximum: not ready, but alive.
    EXPECT_TRUE(m.healthz(now).ok);
    const HealthCheck ready = m.readyz(now, "host", nlohmann::json::object());
    EXPECT_FALSE(ready.ok);
    EXPECT_NE(ready.text.find("maximum of 3"), std::string::npos) << ready.text;
    EXPECT_FALSE(m.healthz(now + std::chrono::seconds(11)).ok);
}

TEST(ServerMetrics, ReadyUntilStoppingOrThePoolFails) {
    ServerMetrics m("0.1.0");
    const auto now = ServerMetrics::Clock::now();
    EXPECT_FALSE(m.healthz(now).ok);  // no tick yet
    ServerMetrics::Snapshot snap;
    snap.max_sessions = 10;
    m.tick(now, snap);
    EXPECT_TRUE(m.readyz(now, "host", nlohmann::json::object()).ok);
    const nlohmann::json failing = {
        {"host", {{"ready", 0}, {"target", 2}, {"failures", 4}, {"last_error", "runc: boom"}}}};
    const HealthCheck pool = m.readyz(now, "host", failing);
    EXPECT_FALSE(pool.ok);
    EXPECT_NE(pool.text.find("runc: boom"), std::string::npos);
    snap.stopping = true;
    m.tick(now, snap);
    EXPECT_FALSE(m.readyz(now, "host", nlohmann::json::object()).ok);
}

}  // namespace
}  // namespace cellblock
