#include "server_metrics.hpp"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "cellblock/error_names.hpp"
#include "egress_gateway.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

// Seconds, from a warm hand-out (milliseconds) to a cold boot of a large image.
const std::vector<double> kCreateBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                            1,     2.5,  5,     10,   30,  60};
// Seconds, from a 1+1 to the longest execution timeouts.
const std::vector<double> kExecuteBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900};

bool contains(std::string_view text, std::string_view part) {
    return text.find(part) != std::string_view::npos;
}

}  // namespace

std::string close_reason_label(std::string_view reason) {
    static constexpr std::array<std::string_view, 11> kReasons = {
        "closed_by_request", "idle_timeout", "lifetime",     "memory_limit",
        "kernel_died",       "exec_timeout", "node_lost",    "server_shutdown",
        "interrupt_ignored", "server_error", "resume_failed"};
    if (reason == "shutdown requested by the client") return "client_shutdown";
    const std::string_view word = reason.substr(0, reason.find(':'));
    for (const auto known : kReasons) {
        if (word == known) return std::string(known);
    }
    return "other";
}

std::string error_label(std::string_view ename) {
    if (ename.empty()) return "";
    for (const auto& e : kErrorNames) {
        if (e.name == ename) return std::string(ename);
    }
    return "code";
}

std::string drop_reason_label(std::string_view why) {
    if (contains(why, "bad signature")) return "bad_signature";
    if (contains(why, "replayed")) return "replayed";
    if (contains(why, "too large") || contains(why, "too many")) return "too_large";
    if (contains(why, "parent is not a request")) return "unknown_parent";
    if (contains(why, "not open") || contains(why, "does not answer")) return "unexpected_reply";
    if (contains(why, "is not a request")) return "not_a_request";
    if (contains(why, "JSON") || contains(why, "header lacks") || contains(why, "without") ||
        contains(why, "delimiter") || contains(why, "frame")) {
        return "malformed";
    }
    return "other";
}

ProcessStats read_process_stats() {
    ProcessStats s;
    rusage usage{};
    if (::getrusage(RUSAGE_SELF, &usage) == 0) {
        s.cpu_seconds = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                        static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
    }
    const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
    if (std::ifstream statm("/proc/self/statm"); statm) {
        double size = 0, resident = 0;
        statm >> size >> resident;
        s.virtual_bytes = size * page;
        s.resident_bytes = resident * page;
    }
    if (DIR* dir = ::opendir("/proc/self/fd")) {
        int count = 0;
        while (const dirent* entry = ::readdir(dir)) {
            if (entry->d_name[0] != '.') ++count;
        }
        ::closedir(dir);
        s.open_fds = count - 1;  // the directory's own descriptor
    }
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0) s.max_fds = static_cast<double>(nofile.rlim_cur);
    // Field 22 of /proc/self/stat (after the command in parentheses): clock
    // ticks since boot; boot time is btime in /proc/stat.
    std::ifstream stat("/proc/self/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    double btime = 0;
    if (std::ifstream proc_stat("/proc/stat"); proc_stat) {
        for (std::string l; std::getline(proc_stat, l);) {
            if (l.starts_with("btime ")) btime = std::stod(l.substr(6));
        }
    }
    if (close != std::string::npos && btime > 0) {
        std::istringstream fields(line.substr(close + 2));
        std::string field;
        // Fields 3.. follow the command; starttime is field 22.
        for (int i = 3; i <= 22 && fields >> field; ++i) {
            if (i == 22) {
                s.start_time_seconds =
                    btime + std::stod(field) / static_cast<double>(::sysconf(_SC_CLK_TCK));
            }
        }
    }
    return s;
}

ServerMetrics::ServerMetrics(const std::string& version)
    : build_info_(
          registry_.gauge("cellblock_build_info", "the running cellblock's version", {"version"})),
      sessions_(registry_.gauge(
          "cellblock_sessions",
          "sessions by image and state: starting (a create waiting for a sandbox), idle, busy, "
          "hibernated (and hibernating, resuming while they do)",
          {"image", "state"})),
      sessions_max_(
          registry_.gauge("cellblock_sessions_max",
                          "open and starting sessions the server takes (--max-sessions)")),
      snapshot_bytes_(registry_.gauge(
          "cellblock_snapshot_bytes",
          "hibernated sessions' sealed snapshots on the server's disk, all together")),
      sleeps_(registry_.counter("cellblock_hibernations",
                                "hibernation steps by image and outcome: hibernated, "
                                "hibernate_failed (the session stayed awake), resumed",
                                {"image", "outcome"})),
      snapshot_max_bytes_(registry_.gauge(
          "cellblock_snapshot_max_bytes",
          "the most they may take together (--snapshots-max-mb); past it, StorageFull")),
      creates_(registry_.counter("cellblock_session_creates",
                                 "session_create requests answered, by image and outcome: warm "
                                 "or cold (created), or the ename of the refusal",
                                 {"image", "outcome"})),
      create_seconds_(registry_.histogram(
          "cellblock_session_create_seconds",
          "seconds from a session_create's arrival to its session's hand-out, by image and start "
          "(warm: from the pool; cold: booted for it)",
          {"image", "start"}, kCreateBuckets)),
      closes_(registry_.counter("cellblock_session_closes", "sessions closed, by image and reason",
                                {"image", "reason"})),
      executions_(registry_.counter(
          "cellblock_executions",
          "executions by image, outcome (ok, error, aborted, timeout, refused) and error (an "
          "ename of the catalogue, 'code' for an exception the code raised, '' for none)",
          {"image", "outcome", "error"})),
      execution_seconds_(registry_.histogram(
          "cellblock_execution_seconds",
          "wall seconds of executions the kernel ran, from the request to the reply, by image",
          {"image"}, kExecuteBuckets)),
      truncated_(registry_.counter("cellblock_executions_output_truncated",
                                   "executions whose output was cut at the output cap, by image",
                                   {"image"})),
      memory_kills_(registry_.counter(
          "cellblock_memory_kills",
          "sessions whose kernel the memory cgroup killed (closed: memory_limit), by image",
          {"image"})),
      cpu_events_(registry_.counter(
          "cellblock_cpu_fairness_events",
          "CPU fairness changes of a session's weight: demoted, yielding, restored", {"event"})),
      file_bytes_(registry_.counter(
          "cellblock_file_transfer_bytes",
          "bytes of files moved into /data/input (in) and out of /data/output (out), through the "
          "manager socket or the local file socket",
          {"direction", "via"})),
      gateway_requests_(registry_.counter("cellblock_gateway_requests",
                                          "connections the egress gateway judged, by verdict",
                                          {"verdict"})),
      gateway_refusals_(registry_.counter(
          "cellblock_gateway_refusals",
          "connections the egress gateway refused, by the HTTP status it answered", {"status"})),
      gateway_bytes_(registry_.counter("cellblock_gateway_bytes",
                                       "bytes the egress gateway relayed, up (to the internet) and "
                                       "down",
                                       {"direction"})),
      dropped_(registry_.counter("cellblock_relay_dropped_messages",
                                 "messages the relay dropped, by side (client, kernel) and reason",
                                 {"side", "reason"})),
      pool_sandboxes_(registry_.gauge("cellblock_pool_sandboxes",
                                      "sandboxes in the warm pool, by image and state (ready, "
                                      "starting)",
                                      {"image", "state"})),
      pool_target_(registry_.gauge("cellblock_pool_target",
                                   "warm sandboxes the pool keeps, by image (--pool)", {"image"})),
      pool_failures_(registry_.gauge(
          "cellblock_pool_start_failures",
          "the pool's failed starts in a row, by image (0 once one starts)", {"image"})),
      zygotes_(registry_.gauge(
          "cellblock_zygotes",
          "zygotes by image and state: running (sessions fork from it), refused (this host "
          "cannot fork them; sessions boot)",
          {"image", "state"})),
      swarm_nodes_(registry_.gauge("cellblock_swarm_nodes",
                                   "Swarm nodes the swarm backend sees, by state and availability",
                                   {"state", "availability"})),
      loop_age_(registry_.gauge("cellblock_loop_tick_age_seconds",
                                "seconds since the server's loop last ticked (it ticks every "
                                "second; /healthz fails past 10)")),
      process_cpu_(registry_.counter("process_cpu_seconds",
                                     "user and system CPU time of the server, in seconds")),
      process_rss_(registry_.gauge("process_resident_memory_bytes",
                                   "resident memory of the server, in bytes")),
      process_vm_(registry_.gauge("process_virtual_memory_bytes",
                                  "virtual memory of the server, in bytes")),
      process_fds_(registry_.gauge("process_open_fds", "open file descriptors of the server")),
      process_max_fds_(registry_.gauge("process_max_fds", "the server's descriptor limit")),
      process_start_(registry_.gauge("process_start_time_seconds",
                                     "start time of the server, in seconds since the epoch")) {
    build_info_.set({version}, 1);
}

void ServerMetrics::created(SessionTag session, bool warm, double seconds) {
    const char* start = warm ? "warm" : "cold";
    creates_.add({session.image, start});
    create_seconds_.observe({session.image, start}, seconds);
}

void ServerMetrics::create_refused(const std::string& image, const std::string& ename) {
    creates_.add({image, error_label(ename)});
}

void ServerMetrics::execution(SessionTag session, const ExecutionRecord& record) {
    const std::string& image = session.image;
    const std::string outcome = record.status.empty() ? "unknown" : record.status;
    executions_.add({image, outcome, error_label(record.ename)});
    execution_seconds_.observe({image}, record.wall_ms / 1000);
    if (record.truncated) truncated_.add({image});
}

void ServerMetrics::event(SessionTag session, const std::string& kind, const std::string& detail) {
    if (kind == "refused") {
        // "<msg_id> <ename>: <evalue>": an execution refused before it ran
        // (the cap, a limit); it used no count.
        const auto space = detail.find(' ');
        const auto colon = detail.find(':', space == std::string::npos ? 0 : space);
        const std::string ename = space == std::string::npos || colon == std::string::npos
                                      ? ""
                                      : detail.substr(space + 1, colon - space - 1);
        std::string error = error_label(ename);
        if (error == "code" || error.empty()) error = "other";
        executions_.add({session.image, "refused", error});
    } else if (kind.starts_with("cpu_")) {
        cpu_events_.add({kind.substr(4)});
    } else if (kind == "hibernated" || kind == "hibernate_failed" || kind == "resumed") {
        sleeps_.add({session.image, kind});
    }
}

void ServerMetrics::closed(const SessionEnd& end) {
    const std::string label = close_reason_label(end.reason);
    closes_.add({end.image, label});
    if (label == "memory_limit") memory_kills_.add({end.image});
}

void ServerMetrics::dropped(std::string_view where, std::string_view why) {
    dropped_.add({where.starts_with("kernel") ? "kernel" : "client", drop_reason_label(why)});
}

void ServerMetrics::egress(SessionTag, const EgressEvent& event) {
    const json& detail = event.detail;
    const auto number = [&](const char* key) -> double {
        const auto it = detail.find(key);
        return it != detail.end() && it->is_number() ? it->get<double>() : 0.0;
    };
    const auto verdict = detail.find("verdict");
    const std::string v =
        verdict != detail.end() && verdict->is_string() ? verdict->get<std::string>() : "";
    // The gateway's verdicts are its own few words; anything else is "other".
    static constexpr std::array<std::string_view, 3> kVerdicts = {"allowed", "refused", "cut"};
    const bool known = std::find(kVerdicts.begin(), kVerdicts.end(), v) != kVerdicts.end();
    gateway_requests_.add({known ? v : "other"});
    if (v == "refused") {
        const int status = static_cast<int>(number("status"));
        gateway_refusals_.add({status >= 100 && status < 600 ? std::to_string(status) : "none"});
    }
    gateway_bytes_.add({"up"}, number("bytes_up"));
    gateway_bytes_.add({"down"}, number("bytes_down"));
}

void ServerMetrics::file_bytes(const char* direction, const char* via, std::uint64_t bytes) {
    file_bytes_.add({direction, via}, static_cast<double>(bytes));
}

void ServerMetrics::tick(Clock::time_point now, const Snapshot& snapshot) {
    // Every state of every image the server has keeps a series (0 too): a
    // sum or an alert over it does not see a series vanish.
    std::map<LabelValues, double> sessions;
    for (const auto& image : snapshot.images) {
        for (const char* state : {"starting", "idle", "busy", "hibernated"}) {
            sessions[{image, state}] = 0;
        }
    }
    for (const auto& [key, count] : snapshot.sessions) sessions[{key.first, key.second}] = count;
    for (const auto& [image, count] : snapshot.waiting) sessions[{image, "starting"}] = count;
    sessions_.replace(sessions);
    sessions_max_.set({}, static_cast<double>(snapshot.max_sessions));
    snapshot_bytes_.set({}, static_cast<double>(snapshot.snapshot_bytes));
    snapshot_max_bytes_.set({}, static_cast<double>(snapshot.snapshot_max_bytes));
    std::size_t open = 0, waiting = 0;
    for (const auto& [key, count] : snapshot.sessions) open += static_cast<std::size_t>(count);
    for (const auto& [image, count] : snapshot.waiting) waiting += static_cast<std::size_t>(count);
    last_tick_ns_ = now.time_since_epoch().count();
    std::lock_guard lock(ready_mutex_);
    if (snapshot.stopping) {
        accepting_ = false;
        ready_text_ = "not ready: the server is shutting down";
    } else if (open + waiting >= snapshot.max_sessions) {
        accepting_ = false;
        ready_text_ = fmt::format(
            "not ready: {} sessions open and {} starting: at the server's maximum of {}", open,
            waiting, snapshot.max_sessions);
    } else {
        accepting_ = true;
        ready_text_ = fmt::format("manager: bound; sessions: {} open, {} starting, maximum {}",
                                  open, waiting, snapshot.max_sessions);
    }
}

std::string ServerMetrics::render(MetricsFormat format, const json& pool, const json& extras) {
    pool_sandboxes_.clear();
    pool_target_.clear();
    pool_failures_.clear();
    for (const auto& [image, p] : pool.items()) {
        pool_sandboxes_.set({image, "ready"}, p.value("ready", 0.0));
        pool_sandboxes_.set({image, "starting"}, p.value("starting", 0.0));
        pool_target_.set({image}, p.value("target", 0.0));
        pool_failures_.set({image}, p.value("failures", 0.0));
    }
    zygotes_.clear();
    swarm_nodes_.clear();
    for (const auto& extra : extras) {
        const std::string kind = extra.value("kind", "");
        if (kind == "zygote") {
            zygotes_.add({extra.value("image", ""), "running"}, 1);
        } else if (kind == "zygote_refused") {
            zygotes_.add({extra.value("image", ""), "refused"}, 1);
        } else if (kind == "node") {
            swarm_nodes_.add({extra.value("state", ""), extra.value("availability", "")}, 1);
        }
    }
    const auto last = last_tick_ns_.load();
    loop_age_.set({}, last == 0 ? 0.0
                                : std::chrono::duration<double>(Clock::now().time_since_epoch() -
                                                                Clock::duration(last))
                                      .count());
    const ProcessStats p = read_process_stats();
    process_cpu_.set({}, p.cpu_seconds);
    process_rss_.set({}, p.resident_bytes);
    process_vm_.set({}, p.virtual_bytes);
    process_fds_.set({}, p.open_fds);
    process_max_fds_.set({}, p.max_fds);
    process_start_.set({}, p.start_time_seconds);
    return registry_.render(format);
}

HealthCheck ServerMetrics::healthz(Clock::time_point now) const {
    const auto last = last_tick_ns_.load();
    if (last == 0) return {false, "not alive yet: the server's loop has not started"};
    const double age =
        std::chrono::duration<double>(now.time_since_epoch() - Clock::duration(last)).count();
    if (age > std::chrono::duration<double>(kLoopStall).count()) {
        return {false, fmt::format("stalled: the server's loop last turned {:.1f} s ago", age)};
    }
    return {true, fmt::format("ok: the server's loop turned {:.1f} s ago", age)};
}

HealthCheck ServerMetrics::readyz(Clock::time_point now, const std::string& default_image,
                                  const json& pool) const {
    const HealthCheck alive = healthz(now);
    if (!alive.ok) return {false, "not ready: " + alive.text};
    std::string text;
    bool ok = false;
    {
        std::lock_guard lock(ready_mutex_);
        ok = accepting_;
        text = ready_text_;
    }
    if (const auto p = pool.find(default_image); ok && p != pool.end()) {
        const int target = p->value("target", 0), ready = p->value("ready", 0),
                  failures = p->value("failures", 0);
        if (target > 0 && ready == 0 && failures >= 3) {
            return {false, fmt::format("not ready: the pool of the default image {} failed to "
                                       "start {} sandboxes in a row: {}",
                                       default_image, failures, p->value("last_error", ""))};
        }
        text += fmt::format("\npool {}: {} ready of {}", default_image, ready, target);
    }
    return {ok, text};
}

}  // namespace cellblock
