// Limits and their enforcement (session_policy.hpp): the one limits parser
// every entry point goes through, ServerPolicy, and the SessionGovernor.
// Over 500 lines with a reason: the parser is a list of named checks (about
// 300 lines, one per limit and network field), and the governor shares its
// number formatting and saturating clock conversions, so errors and
// deadlines read the same from both.
#include "cellblock/session_policy.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>
#include <type_traits>

#include "cellblock/egress_rules.hpp"
#include "cellblock/error_names.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

// Calls visit(name, field...) for every limit, with the same field taken from
// each of `limits` (so two layers can be compared field by field). The names
// are the JSON names.
template <typename Visitor, typename... Limits>
void for_each_limit(Visitor&& visit, Limits&... limits) {
    visit("max_executions", limits.max_executions...);
    visit("idle_timeout_s", limits.idle_timeout_s...);
    visit("hibernate_after_s", limits.hibernate_after_s...);
    visit("lifetime_s", limits.lifetime_s...);
    visit("exec_timeout_s", limits.exec_timeout_s...);
    visit("interrupt_grace_s", limits.interrupt_grace_s...);
    visit("output_bytes", limits.output_bytes...);
    visit("memory_mb", limits.sandbox.memory_mb...);
    visit("pids", limits.sandbox.pids...);
    visit("disk_mb", limits.sandbox.disk_mb...);
    visit("shm_mb", limits.sandbox.shm_mb...);
    visit("output_mb", limits.sandbox.output_mb...);
    visit("cpus", limits.sandbox.cpus...);
    visit("nofile", limits.sandbox.nofile...);
}

// Values are checked in a wide type before they are narrowed into the field, so
// "memory_mb 3000000000" is reported as above the maximum, not as garbage.
template <typename T>
using Wide = std::conditional_t<std::is_integral_v<T>, std::int64_t, double>;

template <typename T>
std::string format_number(T v) {
    if constexpr (std::is_integral_v<T>) {
        return std::to_string(v);
    } else {
        std::ostringstream out;  // 900, 0.5, 604800: no trailing zeros
        out << std::setprecision(15) << v;
        return out.str();
    }
}

PolicyError invalid(const std::string& what) { return PolicyError(ename::InvalidLimits, what); }

std::int64_t parse_integer(std::string_view name, const json& value) {
    const std::string field(name);
    std::int64_t v = 0;
    if (value.is_number_unsigned()) {
        const auto u = value.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
            throw invalid(field + " " + value.dump() + " is out of range");
        }
        v = static_cast<std::int64_t>(u);
    } else if (value.is_number_integer()) {
        v = value.get<std::int64_t>();
    } else if (value.is_number_float()) {
        // Some clients write every number as a float (1000.0): accept whole ones.
        const double d = value.get<double>();
        if (!std::isfinite(d) || d != std::floor(d)) {
            throw invalid(field + " must be a whole number, got " + value.dump());
        }
        if (std::fabs(d) >= 9.2e18) throw invalid(field + " " + value.dump() + " is out of range");
        v = static_cast<std::int64_t>(d);
    } else {
        throw invalid(field + " must be a positive integer, got " + std::string(value.type_name()));
    }
    if (v <= 0) throw invalid(field + " must be positive, got " + std::to_string(v));
    return v;
}

double parse_real(std::string_view name, const json& value) {
    const std::string field(name);
    if (!value.is_number()) {
        throw invalid(field + " must be a positive number, got " + std::string(value.type_name()));
    }
    const double v = value.get<double>();
    if (!std::isfinite(v)) throw invalid(field + " must be a finite number");
    if (v <= 0) throw invalid(field + " must be positive, got " + format_number(v));
    return v;
}

template <typename T>
Wide<T> parse_value(std::string_view name, const json& value) {
    if constexpr (std::is_integral_v<T>) {
        return parse_integer(name, value);
    } else {
        return parse_real(name, value);
    }
}

constexpr std::size_t kMaxAllowPatterns = 256;
constexpr std::size_t kMaxSecrets = 16;

bool is_token(std::string_view s) {
    if (s.empty() || s.size() > 64) return false;
    return std::all_of(s.begin(), s.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) ||
               std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
    });
}

std::string lowercase(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

std::string join_patterns(const std::vector<std::string>& patterns) {
    if (patterns.empty()) return "none";
    std::string out;
    for (const auto& p : patterns) out += (out.empty() ? "" : ", ") + p;
    return out;
}

// Applies the "network" object of one layer onto `out`, within `maxima`.
void apply_network(const json& j, NetworkLimits& out, const NetworkLimits* maxima,
                   const std::string& origin) {
    if (j.is_null()) return;
    if (!j.is_object()) {
        throw invalid(origin + "network must be a JSON object, got " + std::string(j.type_name()));
    }
    const auto above = [&](const std::string& what) {
        return PolicyError(ename::LimitAboveMaximum, origin + what);
    };
    NetworkLimits next = out;
    for (const auto& item : j.items()) {
        const std::string& key = item.key();
        const json& value = item.value();
        const std::string name = "network." + key;
        try {
            if (key == "mode") {
                if (!value.is_string() || (value != "none" && value != "gateway")) {
                    throw invalid(name + " must be \"none\" or \"gateway\", got " + value.dump());
                }
                next.mode = value.get<std::string>();
                if (maxima && next.gateway() && !maxima->gateway()) {
                    throw above(
                        "network.mode gateway is above the server's maximum none (the server "
                        "has no egress gateway: start it with --egress-allow PATTERN)");
                }
            } else if (key == "allow") {
                if (!value.is_array()) {
                    throw invalid(name + " must be a list of \"host:port\" patterns, got " +
                                  std::string(value.type_name()));
                }
                if (value.size() > kMaxAllowPatterns) {
                    throw invalid(name + " has " + std::to_string(value.size()) +
                                  " patterns; at most " + std::to_string(kMaxAllowPatterns));
                }
                std::vector<std::string> allow;
                for (const auto& entry : value) {
                    if (!entry.is_string()) {
                        throw invalid(name + " entries must be strings, got " + entry.dump());
                    }
                    const HostPattern pattern = HostPattern::parse(entry.get<std::string>());
                    if (maxima) {
                        const bool within = std::any_of(
                            maxima->allow.begin(), maxima->allow.end(), [&](const std::string& m) {
                                return HostPattern::parse(m).covers(pattern);
                            });
                        if (!within) {
                            throw above("network.allow '" + pattern.to_string() +
                                        "' is not within the server's allowlist (" +
                                        join_patterns(maxima->allow) + ")");
                        }
                    }
                    allow.push_back(pattern.to_string());
                }
                next.allow = std::move(allow);
            } else if (key == "max_bytes" || key == "max_connections") {
                const std::int64_t v = parse_integer(name, value);
                std::int64_t& field = key == "max_bytes" ? next.max_bytes : next.max_connections;
                const std::int64_t maximum =
                    maxima ? (key == "max_bytes" ? maxima->max_bytes : maxima->max_connections) : v;
                if (v > maximum) {
                    throw above(name + " " + std::to_string(v) + " is above the server's maximum " +
                                std::to_string(maximum));
                }
                field = v;
            } else if (key == "secrets") {
                if (!value.is_array()) {
                    throw invalid(name + " must be a list of {host, header, value_from}, got " +
                                  std::string(value.type_name()));
                }
                if (value.size() > kMaxSecrets) {
                    throw invalid(name + " has " + std::to_string(value.size()) +
                                  " entries; at most " + std::to_string(kMaxSecrets));
                }
                std::vector<NetworkSecret> secrets;
                for (const auto& entry : value) {
                    NetworkSecret secret = NetworkSecret::from_json(entry);
                    if (maxima && std::find(maxima->secrets.begin(), maxima->secrets.end(),
                                            secret) == maxima->secrets.end()) {
                        throw above("network.secrets " + secret.to_json().dump() +
                                    " is not one the server offers (--egress-secret)");
                    }
                    secrets.push_back(std::move(secret));
                }
                next.secrets = std::move(secrets);
            } else if (key == "request_timeout_s") {
                const double v = parse_real(name, value);
                if (maxima && v > maxima->request_timeout_s) {
                    throw above(name + " " + format_number(v) + " is above the server's maximum " +
                                format_number(maxima->request_timeout_s));
                }
                next.request_timeout_s = v;
            } else {
                throw invalid("unknown limit '" + name + "'");
            }
        } catch (const PolicyError& e) {
            const std::string what = e.what();
            if (what.starts_with(origin)) throw;
            throw PolicyError(e.ename(), origin + what);
        }
    }
    // A secret is for a host the session may reach (on some port).
    for (const auto& secret : next.secrets) {
        const bool allowed = std::any_of(next.allow.begin(), next.allow.end(), [&](const auto& p) {
            const HostPattern pattern = HostPattern::parse(p);
            return pattern.matches(secret.host, pattern.port == 0 ? 443 : pattern.port);
        });
        if (!allowed) {
            throw invalid(origin + "network.secrets: " + secret.host +
                          " is not in network.allow (" + join_patterns(next.allow) + ")");
        }
    }
    out = std::move(next);
}

// Applies one layer (`j`, a flat object of limits) onto `out`. With `maxima`,
// a value above its maximum throws LimitAboveMaximum. `origin` prefixes errors
// that are not the requester's own ("image limits: ").
void apply_layer(const json& j, SessionLimits& out, const SessionLimits* maxima,
                 const std::string& origin) {
    if (j.is_null()) return;
    if (!j.is_object()) {
        throw invalid(origin + "limits must be a JSON object, got " + std::string(j.type_name()));
    }
    SessionLimits next = out;
    const SessionLimits& bounds = maxima ? *maxima : out;  // read only when there are maxima
    for (const auto& item : j.items()) {
        const std::string& key = item.key();
        const json& value = item.value();
        if (key == "network") {
            apply_network(value, next.network, maxima ? &maxima->network : nullptr, origin);
            continue;
        }
        bool known = false;
        for_each_limit(
            [&](std::string_view name, auto& field, const auto& maximum) {
                if (name != key) return;
                known = true;
                using T = std::remove_reference_t<decltype(field)>;
                Wide<T> v{};
                try {
                    v = parse_value<T>(name, value);
                } catch (const PolicyError& e) {
                    throw PolicyError(e.ename(), origin + e.what());
                }
                if (maxima && v > static_cast<Wide<T>>(maximum)) {
                    throw PolicyError(ename::LimitAboveMaximum,
                                      origin + key + " " + format_number(v) +
                                          " is above the server's maximum " +
                                          format_number(static_cast<Wide<T>>(maximum)));
                }
                if constexpr (std::is_integral_v<T>) {
                    if (v > static_cast<Wide<T>>(std::numeric_limits<T>::max())) {
                        throw invalid(origin + key + " " + format_number(v) + " is out of range");
                    }
                }
                field = static_cast<T>(v);
            },
            next, bounds);
        if (!known) throw invalid(origin + "unknown limit '" + key + "'");
    }
    out = next;
}

// Seconds as a clock duration, saturating far beyond any real limit rather than
// overflowing (limits built by hand need not have passed through the maxima).
Clock::duration seconds(double s) {
    constexpr double kCap = 100.0 * 365 * 24 * 3600;
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(std::clamp(s, 0.0, kCap)));
}

std::int64_t whole_ms(Clock::duration d) {
    return std::max<std::int64_t>(0,
                                  std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

}  // namespace

// ---- SandboxLimits, SessionLimits ----

SandboxLimits SandboxLimits::from_json(const json& j, const SandboxLimits& base) {
    if (!j.is_object()) {
        throw invalid("limits must be a JSON object, got " + std::string(j.type_name()));
    }
    const json sandbox_fields = base.to_json();
    for (const auto& item : j.items()) {
        if (!sandbox_fields.contains(item.key())) {
            throw invalid("limits: '" + item.key() + "' is not a sandbox limit");
        }
    }
    SessionLimits layered;
    layered.sandbox = base;
    apply_layer(j, layered, nullptr, "limits: ");
    return layered.sandbox;
}

json NetworkSecret::to_json() const {
    return {{"host", host}, {"header", header}, {"value_from", value_from}};
}

NetworkSecret NetworkSecret::from_json(const json& j) {
    if (!j.is_object()) {
        throw invalid("network.secrets entries must be {host, header, value_from}, got " +
                      j.dump());
    }
    NetworkSecret s;
    for (const auto& item : j.items()) {
        if (!item.value().is_string()) {
            throw invalid("network.secrets." + item.key() + " must be a string");
        }
        const std::string v = item.value().get<std::string>();
        if (item.key() == "host") {
            s.host = normalise_host(v);
            if (s.host.empty() || IpAddress::parse(s.host)) {
                throw invalid("network.secrets.host '" + v + "' is not a DNS name");
            }
        } else if (item.key() == "header") {
            static const std::vector<std::string> reserved = {"host",
                                                              "content-length",
                                                              "transfer-encoding",
                                                              "connection",
                                                              "proxy-connection",
                                                              "proxy-authorization",
                                                              "keep-alive",
                                                              "te",
                                                              "trailer",
                                                              "upgrade"};
            if (!is_token(v) ||
                std::find(reserved.begin(), reserved.end(), lowercase(v)) != reserved.end()) {
                throw invalid("network.secrets.header '" + v +
                              "' is not a header the gateway may set");
            }
            s.header = v;
        } else if (item.key() == "value_from") {
            const bool env =
                v.starts_with("env:") && v.size() > 4 &&
                std::all_of(v.begin() + 4, v.end(),
                            [](char c) {
                                return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                            }) &&
                !std::isdigit(static_cast<unsigned char>(v[4]));
            const bool file = v.starts_with("file:/") && v.find("/../") == std::string::npos;
            if (!env && !file) {
                throw invalid("network.secrets.value_from '" + v +
                              "' must be env:NAME or file:/absolute/path");
            }
            s.value_from = v;
        } else {
            throw invalid("unknown limit 'network.secrets." + item.key() + "'");
        }
    }
    if (s.host.empty() || s.header.empty() || s.value_from.empty()) {
        throw invalid("network.secrets entries need host, header and value_from, got " + j.dump());
    }
    return s;
}

NetworkSecret NetworkSecret::parse(std::string_view text) {
    const auto eq = text.find('=');
    const auto colon = text.substr(0, eq).rfind(':');
    if (eq == std::string_view::npos || colon == std::string_view::npos) {
        throw invalid("'" + std::string(text) + "' must be HOST:HEADER=env:NAME or file:/path");
    }
    return from_json({{"host", std::string(text.substr(0, colon))},
                      {"header", std::string(text.substr(colon + 1, eq - colon - 1))},
                      {"value_from", std::string(text.substr(eq + 1))}});
}

json NetworkLimits::to_json() const {
    json secret_list = json::array();
    for (const auto& s : secrets) secret_list.push_back(s.to_json());
    return {{"mode", mode},
            {"allow", allow},
            {"secrets", secret_list},
            {"max_bytes", max_bytes},
            {"max_connections", max_connections},
            {"request_timeout_s", request_timeout_s}};
}

json SessionLimits::to_json() const {
    json j = json::object();
    for_each_limit([&](std::string_view name, const auto& field) { j[std::string(name)] = field; },
                   *this);
    j["network"] = network.to_json();
    return j;
}

SessionLimits SessionLimits::from_json(const json& j, const SessionLimits& base) {
    SessionLimits out = base;
    apply_layer(j, out, nullptr, "");
    return out;
}

// ---- ServerPolicy ----

ServerPolicy::ServerPolicy() {
    constexpr double kWeek = 7 * 24 * 3600;
    maxima.max_executions = 100000;
    maxima.idle_timeout_s = kWeek;
    maxima.hibernate_after_s = kWeek;
    maxima.lifetime_s = kWeek;
    maxima.exec_timeout_s = 3600;
    maxima.interrupt_grace_s = 600;
    maxima.output_bytes = std::int64_t{64} << 20;
    maxima.sandbox.memory_mb = 16384;
    maxima.sandbox.pids = 4096;
    maxima.sandbox.disk_mb = 16384;
    maxima.sandbox.shm_mb = 4096;
    maxima.sandbox.output_mb = 16384;
    maxima.sandbox.cpus = std::max(1U, std::thread::hardware_concurrency());
    maxima.sandbox.nofile = 65536;
    // No gateway until the operator names what it may reach (--egress-allow).
    maxima.network.max_bytes = std::int64_t{64} << 30;
    maxima.network.max_connections = 256;
    maxima.network.request_timeout_s = 3600;
}

void ServerPolicy::validate() const {
    for_each_limit(
        [](std::string_view name, const auto& def, const auto& max) {
            const std::string field(name);
            if (!(max > 0)) {
                throw invalid("server maximum " + field + " " + format_number(max) +
                              " is not positive");
            }
            if (!(def > 0)) {
                throw invalid("server default " + field + " " + format_number(def) +
                              " is not positive");
            }
            if (def > max) {
                throw invalid("server default " + field + " " + format_number(def) +
                              " is above the server's maximum " + format_number(max));
            }
        },
        defaults, maxima);
    // The defaults' network must be a session the maxima allow.
    SessionLimits checked = maxima;
    checked.network = NetworkLimits{};
    apply_network(defaults.network.to_json(), checked.network, &maxima.network, "server default: ");
    if (!(max_create_wait_s > 0))
        throw invalid("max_create_wait_s " + format_number(max_create_wait_s) + " is not positive");
    if (!(closed_channels_s >= 0))
        throw invalid("closed_channels_s " + format_number(closed_channels_s) + " is negative");
    if (max_sessions <= 0)
        throw invalid("max_sessions " + std::to_string(max_sessions) + " is not positive");
}

SessionLimits ServerPolicy::effective(const json& image_limits, const json& request_limits) const {
    SessionLimits out = defaults;
    apply_layer(image_limits, out, &maxima, "image limits: ");
    apply_layer(request_limits, out, &maxima, "");
    // A default above its maximum is the server's misconfiguration, but the
    // session must still never get it.
    for_each_limit(
        [](std::string_view name, const auto& value, const auto& max) {
            if (value > max) {
                throw PolicyError(ename::LimitAboveMaximum, "server default " + std::string(name) +
                                                                " " + format_number(value) +
                                                                " is above the server's maximum " +
                                                                format_number(max));
            }
        },
        out, maxima);
    return out;
}

json ServerPolicy::to_json() const {
    return {{"defaults", defaults.to_json()},
            {"maxima", maxima.to_json()},
            {"kill_grace_s", kill_grace_s},
            {"closed_channels_s", closed_channels_s},
            {"max_message_bytes", max_message_bytes},
            {"max_file_bytes", max_file_bytes},
            {"max_inline_file_bytes", max_inline_file_bytes},
            {"max_sessions", max_sessions},
            {"max_create_wait_s", max_create_wait_s}};
}

// ---- SessionGovernor ----

SessionGovernor::SessionGovernor(SessionLimits limits, const ServerPolicy& policy,
                                 Clock::time_point now)
    : limits_(std::move(limits)),
      policy_(policy),
      created_(now),
      last_request_(now),
      exec_timeout_s_(limits_.exec_timeout_s) {}

SessionGovernor::ExecuteDecision SessionGovernor::on_execute_request(
    Clock::time_point now, std::optional<double> requested_timeout_s) {
    on_client_request(now);
    ExecuteDecision decision;
    const auto refuse = [&](std::string ename, std::string evalue) {
        decision.forward = false;
        decision.ename = std::move(ename);
        decision.evalue = std::move(evalue);
        return decision;
    };
    if (executions_ >= limits_.max_executions) {
        const std::string n = std::to_string(limits_.max_executions);
        return refuse(ename::ExecutionLimitExceeded,
                      limits_.max_executions == 1
                          ? "this session allows 1 execution; it is used"
                          : "this session allows " + n + " executions; all " + n + " are used");
    }
    double timeout_s = limits_.exec_timeout_s;
    if (requested_timeout_s) {
        const double t = *requested_timeout_s;
        if (!std::isfinite(t) || t <= 0) {
            return refuse(
                ename::InvalidLimits,
                "timeout_s must be a positive number of seconds, got " + format_number(t));
        }
        if (t > policy_.maxima.exec_timeout_s) {
            return refuse(ename::LimitAboveMaximum,
                          "timeout_s " + format_number(t) + " is above the server's maximum " +
                              format_number(policy_.maxima.exec_timeout_s));
        }
        timeout_s = t;
    }
    ++executions_;
    busy_ = true;
    exec_started_ = now;
    exec_timeout_s_ = timeout_s;
    interrupt_deadline_.reset();
    stream_bytes_ = 0;
    dropped_ = 0;
    dropped_at_source_ = 0;
    marker_sent_ = false;
    decision.deadline = now + seconds(timeout_s);
    return decision;
}

double SessionGovernor::age_s(Clock::time_point now) const {
    return std::chrono::duration<double>(now - created_).count();
}

double SessionGovernor::idle_s(Clock::time_point now) const {
    return std::chrono::duration<double>(now - last_request_).count();
}

void SessionGovernor::carry_on(Clock::time_point now, std::int64_t executions, double age_s,
                               double idle_s) {
    const auto ago = [now](double s) {
        return now - std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::max(0.0, s)));
    };
    executions_ = std::max<std::int64_t>(0, executions);
    created_ = ago(age_s);
    last_request_ = ago(std::min(idle_s, age_s));
}

void SessionGovernor::on_client_request(Clock::time_point now) {
    last_request_ = std::max(last_request_, now);
    hibernation_failures_ = 0;
    hibernation_retry_at_.reset();
}

void SessionGovernor::on_interrupt(Clock::time_point now) {
    on_client_request(now);
    if (busy_ && !interrupt_deadline_)
        interrupt_deadline_ = now + seconds(limits_.interrupt_grace_s);
}

json SessionGovernor::on_execute_reply(Clock::time_point now, std::uint64_t cpu_ms,
                                       std::uint64_t memory_peak_bytes) {
    const std::int64_t wall_ms = busy_ ? whole_ms(now - exec_started_) : 0;
    busy_ = false;
    interrupt_deadline_.reset();
    last_request_ = std::max(last_request_, now);
    return {{"executions_used", executions_},
            {"executions_left", executions_left()},
            {"max_executions", limits_.max_executions},
            {"wall_ms", wall_ms},
            {"cpu_ms", cpu_ms},
            {"memory_peak_bytes", memory_peak_bytes},
            {"output_bytes", stream_bytes_},
            {"output_truncated", truncated()},
            {"output_dropped_bytes", dropped_},
            {"output_dropped_in_kernel_bytes", dropped_at_source_},
            {"timeout_s", exec_timeout_s_}};
}

SessionGovernor::StreamDecision SessionGovernor::shape_stream(std::size_t bytes,
                                                              std::size_t room_to_keep) {
    StreamDecision decision;
    // Once anything was dropped, everything after is dropped too, so the text
    // never resumes after the marker.
    decision.keep = dropped_ > 0 ? 0 : std::min(bytes, room_to_keep);
    const std::size_t dropped_now = bytes - decision.keep;
    stream_bytes_ += decision.keep;
    dropped_ += dropped_now;
    if (dropped_now > 0 && !marker_sent_) {
        marker_sent_ = true;
        decision.add_marker = true;
        decision.marker = "\n[cellblock: output truncated at " +
                          std::to_string(limits_.output_bytes) +
                          " bytes; the rest of this execution's output is dropped]\n";
    }
    return decision;
}

SessionGovernor::StreamDecision SessionGovernor::on_stream(std::size_t bytes) {
    const auto limit = static_cast<std::uint64_t>(std::max<std::int64_t>(0, limits_.output_bytes));
    const std::uint64_t room = limit > stream_bytes_ ? limit - stream_bytes_ : 0;
    return shape_stream(bytes, static_cast<std::size_t>(std::min<std::uint64_t>(room, bytes)));
}

SessionGovernor::StreamDecision SessionGovernor::on_stream(std::string_view text) {
    const auto limit = static_cast<std::uint64_t>(std::max<std::int64_t>(0, limits_.output_bytes));
    const std::uint64_t room = limit > stream_bytes_ ? limit - stream_bytes_ : 0;
    const auto max_keep = static_cast<std::size_t>(std::min<std::uint64_t>(room, text.size()));
    return shape_stream(text.size(), utf8_safe_prefix(text, max_keep));
}

SessionGovernor::DisplayDecision SessionGovernor::on_display(std::size_t bytes) {
    const auto limit = static_cast<std::uint64_t>(std::max<std::int64_t>(0, limits_.output_bytes));
    DisplayDecision decision;
    if (dropped_ == 0 && stream_bytes_ + bytes <= limit) {
        stream_bytes_ += bytes;
        decision.keep = true;
        return decision;
    }
    dropped_ += bytes;
    decision.add_notice = !marker_sent_;
    marker_sent_ = true;
    return decision;
}

void SessionGovernor::on_dropped_at_source(std::uint64_t bytes) {
    // The kernel's own figure: bounded so that a lying kernel cannot wrap the sum.
    bytes = std::min<std::uint64_t>(bytes, std::uint64_t{1} << 52);
    dropped_ += bytes;
    dropped_at_source_ += bytes;
}

std::int64_t SessionGovernor::executions_left() const {
    return std::max<std::int64_t>(0, limits_.max_executions - executions_);
}

std::optional<std::string> SessionGovernor::expiry(Clock::time_point now) const {
    if (now - created_ >= seconds(limits_.lifetime_s)) return "lifetime";
    if (!busy_ && now - last_request_ >= seconds(limits_.idle_timeout_s)) return "idle_timeout";
    return std::nullopt;
}

Clock::time_point SessionGovernor::next_expiry_check(Clock::time_point now) const {
    Clock::time_point next = created_ + seconds(limits_.lifetime_s);
    if (!busy_) next = std::min(next, last_request_ + seconds(limits_.idle_timeout_s));
    return std::max(next, now);
}

bool SessionGovernor::hibernation_due(Clock::time_point now) const {
    return !busy_ && (!hibernation_retry_at_ || now >= *hibernation_retry_at_) &&
           now - last_request_ >= seconds(limits_.hibernate_after_s);
}

std::optional<Clock::time_point> SessionGovernor::next_hibernation(Clock::time_point now) const {
    if (busy_) return std::nullopt;
    Clock::time_point due = last_request_ + seconds(limits_.hibernate_after_s);
    if (hibernation_retry_at_) due = std::max(due, *hibernation_retry_at_);
    return std::max(now, due);
}

Clock::duration SessionGovernor::hibernation_declined(Clock::time_point now) {
    Clock::duration wait =
        std::max<Clock::duration>(seconds(limits_.hibernate_after_s), kHibernateRetryMin);
    for (int i = 0; i < hibernation_failures_ && wait < kHibernateRetryMax; ++i) wait *= 2;
    wait = std::min<Clock::duration>(wait, kHibernateRetryMax);
    ++hibernation_failures_;
    hibernation_retry_at_ = now + wait;
    return wait;
}

// ---- UTF-8 ----

std::size_t utf8_safe_prefix(std::string_view text, std::size_t max_bytes) {
    if (max_bytes >= text.size()) return text.size();
    const auto continuation = [&](std::size_t i) {
        return (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80;
    };
    // text[max_bytes] is the first byte cut off: if it continues a character,
    // back up to that character's lead byte (at most 3 bytes back in UTF-8).
    std::size_t cut = max_bytes;
    for (int steps = 0; steps < 3 && cut > 0 && continuation(cut); ++steps) --cut;
    if (continuation(cut)) return max_bytes;  // not UTF-8 here: nothing to protect
    return cut;
}

}  // namespace cellblock
