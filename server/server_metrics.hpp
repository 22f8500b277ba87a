// What `cellblock serve --metrics` exposes, and where each figure comes from:
// the sessions' events, which it observes as the audit trail does
// (session_events.hpp: creates, executions, events, closes, the gateway's
// requests, dropped messages), the creates refused and the file bytes moved, a snapshot the loop
// takes each second (sessions by state), and at scrape time the pool, the zygotes and the process
// itself. Labels stay bounded: an image, a reason or outcome from a fixed set, an ename of the
// catalogue (error_names.hpp), never a session id. docs/operations.md lists every metric.
//
// The event methods and tick() run on the server's loop; render(), healthz()
// and readyz() on the metrics endpoint's thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/session_store.hpp"
#include "metrics_http.hpp"
#include "metrics_registry.hpp"
#include "session_events.hpp"

namespace cellblock {

// Bounded label values from the server's free texts (unit-tested).
// A close reason: its word before any ':' when it is one of the server's
// reasons (closed_by_request, idle_timeout, lifetime, memory_limit,
// kernel_died, exec_timeout, interrupt_ignored, node_lost, server_shutdown,
// server_error, client_shutdown); "other" otherwise.
std::string close_reason_label(std::string_view reason);
// An ename of the catalogue as is; "" for none; "code" for any other (an
// exception the session's code raised: its class is the code's to name).
std::string error_label(std::string_view ename);
// Why the relay dropped a message: bad_signature, replayed, too_large,
// malformed, unknown_parent, unexpected_reply, not_a_request, other.
std::string drop_reason_label(std::string_view why);

// The process's own figures, as Prometheus client libraries name them.
struct ProcessStats {
    double cpu_seconds = 0;  // user + system, every thread
    double resident_bytes = 0;
    double virtual_bytes = 0;
    double open_fds = 0;
    double max_fds = 0;
    double start_time_seconds = 0;  // unix time
};
ProcessStats read_process_stats();

class ServerMetrics final : public SessionEvents {
  public:
    using Clock = std::chrono::steady_clock;
    // The loop counts as stalled (healthz 503) when its last tick is older.
    static constexpr std::chrono::seconds kLoopStall{10};
    static constexpr std::chrono::seconds kTick{1};

    explicit ServerMetrics(const std::string& version);

    // --- events, on the loop ---
    void created(SessionTag session, bool warm, double seconds) override;
    void execution(SessionTag session, const ExecutionRecord& record) override;
    void event(SessionTag session, const std::string& kind, const std::string& detail) override;
    void egress(SessionTag session, const EgressEvent& event) override;
    void closed(const SessionEnd& end) override;
    void dropped(std::string_view where, std::string_view why) override;
    // A session_create answered with an error (image "" when it named none known).
    void create_refused(const std::string& image, const std::string& ename);
    // direction "in" (into /data/input) or "out"; via "manager" or "local".
    void file_bytes(const char* direction, const char* via, std::uint64_t bytes);

    // The loop's snapshot each kTick: open sessions by (image, state) and
    // creates waiting by image; whether a create would be taken now, and why
    // not. It also proves the loop turns (healthz).
    struct Snapshot {
        std::vector<std::string> images;  // every image the server has: its series stay at 0
        std::map<std::pair<std::string, std::string>, int> sessions;
        std::map<std::string, int> waiting;
        std::size_t max_sessions = 0;
        // Hibernated sessions' sealed snapshots on disk, and their cap.
        std::uint64_t snapshot_bytes = 0, snapshot_max_bytes = 0;
        bool stopping = false;
    };
    void tick(Clock::time_point now, const Snapshot& snapshot);

    // --- the endpoint's thread ---
    // pool: SandboxPool::state(); extras: SandboxPool::extras().
    std::string render(MetricsFormat format, const nlohmann::json& pool,
                       const nlohmann::json& extras);
    HealthCheck healthz(Clock::time_point now) const;
    // `default_image` and `pool`: a default image whose pool wants sandboxes
    // and keeps failing to start them is not ready.
    HealthCheck readyz(Clock::time_point now, const std::string& default_image,
                       const nlohmann::json& pool) const;

    MetricsRegistry& registry() { return registry_; }

  private:
    MetricsRegistry registry_;
    MetricFamily& build_info_;
    MetricFamily& sessions_;
    MetricFamily& sessions_max_;
    MetricFamily& snapshot_bytes_;
    MetricFamily& sleeps_;
    MetricFamily& snapshot_max_bytes_;
    MetricFamily& creates_;
    MetricFamily& create_seconds_;
    MetricFamily& closes_;
    MetricFamily& executions_;
    MetricFamily& execution_seconds_;
    MetricFamily& truncated_;
    MetricFamily& memory_kills_;
    MetricFamily& cpu_events_;
    MetricFamily& file_bytes_;
    MetricFamily& gateway_requests_;
    MetricFamily& gateway_refusals_;
    MetricFamily& gateway_bytes_;
    MetricFamily& dropped_;
    MetricFamily& pool_sandboxes_;
    MetricFamily& pool_target_;
    MetricFamily& pool_failures_;
    MetricFamily& zygotes_;
    MetricFamily& swarm_nodes_;
    MetricFamily& loop_age_;
    MetricFamily& process_cpu_;
    MetricFamily& process_rss_;
    MetricFamily& process_vm_;
    MetricFamily& process_fds_;
    MetricFamily& process_max_fds_;
    MetricFamily& process_start_;

    // Written by tick(), read by the endpoint.
    std::atomic<std::int64_t> last_tick_ns_{0};
    mutable std::mutex ready_mutex_;
    bool accepting_ = false;
    std::string ready_text_ = "the server has not started its loop yet";
};

}  // namespace cellblock
