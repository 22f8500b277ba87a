// Session limits and the policy the server enforces on a session's message
// stream, as values with no ZMQ and no clock of their own (time is passed in),
// so every rule is unit-testable.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/image.hpp"

namespace cellblock {

// A credential the gateway adds to a session's HTTPS requests for one host
// (docs/network.md), by reference: the value is read by the server from its
// environment ("env:NAME") or a root-only file ("file:/path") and never enters
// the sandbox. The server offers a fixed set (--egress-secret); a session may
// take any of them, exactly as offered.
struct NetworkSecret {
    std::string host;        // an exact DNS name, lowercase
    std::string header;      // "Authorization"
    std::string value_from;  // "env:NAME" or "file:/absolute/path"

    bool operator==(const NetworkSecret&) const = default;
    nlohmann::json to_json() const;
    // Throws PolicyError(InvalidLimits) naming what is wrong.
    static NetworkSecret from_json(const nlohmann::json& j);
    // "HOST:HEADER=SOURCE", the form of --egress-secret.
    static NetworkSecret parse(std::string_view text);
};

// A session's way out (docs/network.md): none, or the egress gateway, which
// reaches only the host patterns in `allow` (egress_rules.hpp). In JSON, the
// object "network" of the limits: {mode, allow, max_bytes, max_connections,
// request_timeout_s, secrets}.
struct NetworkLimits {
    std::string mode = "none";                       // "none" or "gateway"
    std::vector<std::string> allow;                  // canonical HostPattern texts
    std::int64_t max_bytes = std::int64_t{1} << 30;  // both ways, over the session's life
    std::int64_t max_connections = 16;               // open at once
    double request_timeout_s = 60;  // to connect, and at most between two reads of a connection
    std::vector<NetworkSecret> secrets;  // each for a host that `allow` names

    bool gateway() const { return mode == "gateway"; }
    nlohmann::json to_json() const;
};

// Everything a session request may ask for. Flat in JSON, plus "network":
// {max_executions, idle_timeout_s, hibernate_after_s, lifetime_s, exec_timeout_s,
//  interrupt_grace_s, output_bytes, memory_mb, pids, disk_mb, shm_mb, output_mb, cpus, nofile}.
struct SessionLimits {
    std::int64_t max_executions = 1000;
    double idle_timeout_s = 1800;
    // Idle this long, the session hibernates to disk (docs/hibernation.md)
    // instead of holding its memory; the idle timeout and lifetime still
    // close it. The default, a week, is past the default idle timeout: off.
    double hibernate_after_s = 7 * 24 * 3600;
    double lifetime_s = 24 * 3600;
    double exec_timeout_s = 30;
    // After a client's interrupt_request, how long the running execution may
    // go on before the kernel is killed (InterruptIgnored).
    double interrupt_grace_s = 5;
    std::int64_t output_bytes = 1 << 20;  // output (streams, display data) kept per execution
    SandboxLimits sandbox;
    NetworkLimits network;

    nlohmann::json to_json() const;
    // Fields absent from `j` keep `base`'s values (null counts as {}). Unknown
    // fields and mistyped or non-positive values throw PolicyError("InvalidLimits", ...).
    static SessionLimits from_json(const nlohmann::json& j, const SessionLimits& base);
};

// An error that reaches a client as {status: "error", ename, evalue}.
class PolicyError : public std::runtime_error {
  public:
    PolicyError(std::string ename, const std::string& evalue)
        : std::runtime_error(evalue), ename_(std::move(ename)) {}
    const std::string& ename() const { return ename_; }

  private:
    std::string ename_;
};

struct ServerPolicy {
    SessionLimits defaults;
    SessionLimits maxima;     // no layer may go above these
    double kill_grace_s = 3;  // after an interrupt at the deadline, before the kill
    // How long a closed session's own channels stay bound, answering
    // SessionClosed to requests in flight; the registry keeps the rest.
    double closed_channels_s = 30;
    std::int64_t max_message_bytes = 16 << 20;  // one iopub message larger is replaced by a notice
    std::int64_t max_file_bytes = 16ll << 30;   // one file, streamed in chunks
    std::int64_t max_inline_file_bytes = 64 << 20;  // one file in one message (file_put/get)
    int max_sessions = 256;  // open and starting sessions at once (closed ones do not count)
    double max_create_wait_s = 120;  // a session_create still waiting for a sandbox: ServerBusy

    ServerPolicy();  // sensible maxima (e.g. 100000 executions, 1 week, 3600 s per execution, 16
                     // GB)

    // Throws PolicyError("InvalidLimits", ...) if a default or maximum is not
    // positive or a default is above its maximum (a misconfigured server).
    void validate() const;

    // server defaults < image limits < request; each field of the image or the
    // request above `maxima` (for network: mode gateway where the maximum is
    // none, an allow pattern no maximum pattern covers) throws PolicyError("LimitAboveMaximum",
    // "<field> <v> is above the server's maximum <max>").
    SessionLimits effective(const nlohmann::json& image_limits,
                            const nlohmann::json& request_limits) const;
    nlohmann::json to_json() const;  // {defaults, maxima, kill_grace_s, ...}
};

using Clock = std::chrono::steady_clock;

// The per-session rules, fed the events of the stream by the proxy.
class SessionGovernor {
  public:
    SessionGovernor(SessionLimits limits, const ServerPolicy& policy, Clock::time_point now);

    struct ExecuteDecision {
        bool forward = true;
        std::string ename, evalue;     // when !forward
        Clock::time_point deadline{};  // when forward: interrupt at this time
    };
    // A client's execute_request. `requested_timeout_s` is metadata.cellblock.timeout_s.
    // Refuses past max_executions (ExecutionLimitExceeded), a timeout above
    // the server maximum (LimitAboveMaximum) and a non-positive one (InvalidLimits).
    // A refused request is not counted. Any request resets the idle clock.
    ExecuteDecision on_execute_request(Clock::time_point now,
                                       std::optional<double> requested_timeout_s);
    // Any client request (resets the idle clock).
    void on_client_request(Clock::time_point now);
    // A client's interrupt_request. While an execution runs, the first one
    // starts its grace: interrupt_ignored() turns true interrupt_grace_s later
    // unless the execute_reply comes first. Later interrupts do not extend it.
    void on_interrupt(Clock::time_point now);
    // When the running execution's grace ends (none: no interrupt pending).
    std::optional<Clock::time_point> interrupt_deadline() const { return interrupt_deadline_; }
    bool interrupt_ignored(Clock::time_point now) const {
        return interrupt_deadline_ && now >= *interrupt_deadline_;
    }
    // The kernel's execute_reply: returns metadata.cellblock for it. The idle
    // clock restarts here, so a long execution does not expire the session at once.
    nlohmann::json on_execute_reply(Clock::time_point now, std::uint64_t cpu_ms,
                                    std::uint64_t memory_peak_bytes);

    struct StreamDecision {
        std::size_t keep = 0;     // bytes of this message's text to keep
        bool add_marker = false;  // append the one marker now
        std::string marker;       // "\n[cellblock: output truncated at N bytes; the rest ...]\n"
    };
    // A stream message of the current execution with `bytes` of text. The proxy
    // cuts the text at utf8_safe_prefix(text, keep), never mid-character.
    StreamDecision on_stream(std::size_t bytes);
    // The same, given the text: `keep` is already at a UTF-8 character boundary.
    StreamDecision on_stream(std::string_view text);
    // A display_data, update_display_data or execute_result message of the
    // current execution, `bytes` long: it shares the stream text's budget and
    // is kept whole or dropped whole. `add_notice`: the first thing dropped,
    // to be replaced by a notice (no stream marker was sent yet).
    struct DisplayDecision {
        bool keep = false;
        bool add_notice = false;
    };
    DisplayDecision on_display(std::size_t bytes);
    // What the kernel dropped at its source past the same budget (its
    // execute_reply's metadata.cellblock_source.dropped_bytes), counted with
    // what the relay dropped.
    void on_dropped_at_source(std::uint64_t bytes);
    // Bytes dropped in the current execution so far (for the reply and the audit).
    std::uint64_t dropped_bytes() const { return dropped_; }
    bool truncated() const { return dropped_ > 0; }

    std::int64_t executions() const { return executions_; }
    std::int64_t executions_left() const;
    bool busy() const { return busy_; }
    // Idle: no client request for idle_timeout_s and not busy. Lifetime: age.
    // Returns the reason ("idle_timeout", "lifetime") once it is due, else nullopt.
    std::optional<std::string> expiry(Clock::time_point now) const;
    // Earliest time expiry() could change its answer (never before `now`). While
    // busy only the lifetime counts: ask again after the execute_reply.
    Clock::time_point next_expiry_check(Clock::time_point now) const;
    // Idle (no client request, not busy) for hibernate_after_s, and past the
    // retry time of the last failed attempt, if any.
    bool hibernation_due(Clock::time_point now) const;
    // When hibernation_due() turns true, or nullopt while busy.
    std::optional<Clock::time_point> next_hibernation(Clock::time_point now) const;
    // An automatic hibernation failed (the save timed out under load, the
    // snapshot did not fit, the disk was full): tried again on its own after
    // max(hibernate_after_s, kHibernateRetryMin), twice as long after each
    // failure, at most kHibernateRetryMax, and afresh after the next client
    // request. Returns the wait before the next try.
    Clock::duration hibernation_declined(Clock::time_point now);
    static constexpr std::chrono::seconds kHibernateRetryMin{60};
    static constexpr std::chrono::seconds kHibernateRetryMax{3600};

    const SessionLimits& limits() const { return limits_; }

    // Seconds since the session was created, and since its last client request.
    double age_s(Clock::time_point now) const;
    double idle_s(Clock::time_point now) const;
    // A session taken over from an earlier server (docs/restarts.md): its
    // executions, age and idle time go on from there.
    void carry_on(Clock::time_point now, std::int64_t executions, double age_s, double idle_s);

  private:
    StreamDecision shape_stream(std::size_t bytes, std::size_t room_to_keep);

    SessionLimits limits_;
    const ServerPolicy& policy_;  // must outlive the governor
    // last_request_: the last client request or the end of the last execution.
    Clock::time_point created_, last_request_, exec_started_{};
    double exec_timeout_s_ = 0;  // the timeout of the current (or last) execution
    std::optional<Clock::time_point> interrupt_deadline_;
    std::int64_t executions_ = 0;
    bool busy_ = false;
    // Failed automatic hibernations since the last client request, and when
    // the next may be tried (hibernation_declined).
    int hibernation_failures_ = 0;
    std::optional<Clock::time_point> hibernation_retry_at_;
    // Output kept and dropped in this execution (streams and display data),
    // and the part of dropped_ the kernel reported dropping at its source.
    std::uint64_t stream_bytes_ = 0, dropped_ = 0, dropped_at_source_ = 0;
    bool marker_sent_ = false;
};

// The length of the longest prefix of `text` of at most `max_bytes` bytes that
// does not end inside a UTF-8 multi-byte sequence (invalid UTF-8 is cut at max_bytes).
std::size_t utf8_safe_prefix(std::string_view text, std::size_t max_bytes);

}  // namespace cellblock
