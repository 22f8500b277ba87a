// The relay's rules for one session (session_core.hpp). Over 500 lines with a
// reason: it is one state machine over one state (the open requests, the
// running execution and its held reply, the queue, the shutdown), and every
// handler reads and changes all of it; tests/unit/session_core_test.cpp
// drives it as one. Cut into files, each part would need every field.
#include "session_core.hpp"

#include "cellblock/error_names.hpp"
#include "version.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace cellblock {

namespace {
// The msg_type prefix of the server's own requests to the kernel.
constexpr std::string_view kServersOwnPrefix = "cellblock_";
}  // namespace
using nlohmann::json;

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// An error reply's content. A kernel_info_reply also carries the fields
// clients read unconditionally (jupyter_client's wait_for_ready does).
json error_content(const std::string& request_type, const std::string& ename,
                   const std::string& evalue) {
    json content = {{"status", "error"},
                    {"ename", ename},
                    {"evalue", evalue},
                    {"traceback", json::array({ename + ": " + evalue})}};
    if (request_type == "kernel_info_request") {
        content["protocol_version"] = std::string(kProtocolVersion);
        content["implementation"] = "cellblock";
        content["implementation_version"] = kVersion;
        content["language_info"] = {{"name", "python"}};
        content["banner"] = "cellblock: " + evalue;
    }
    return content;
}

// 5, 0.5, 2.25: as a person writes seconds.
std::string format_seconds(double s) {
    std::string text = fmt::format("{:.3f}", s);
    text.erase(text.find_last_not_of('0') + 1);
    if (text.back() == '.') text.pop_back();
    return text;
}

Clock::duration seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string_view sender(const InboundMessage& msg) {
    return msg.layout.delimiter > 0 ? msg.frame(0) : std::string_view();
}

// A kernel message's metadata as an object (empty when it is not one).
json metadata_of(const InboundMessage& msg, int max_depth) {
    auto metadata = parse_json_frame(msg.frame(msg.layout.metadata()), max_depth);
    return metadata && metadata->is_object() ? std::move(*metadata) : json::object();
}

// What cellblock's kernel reports on a reply (cellblock_ipykernel: the bytes
// it dropped at its source, what it published to no one), taken out of the
// metadata: the relay's to read, never the client's. Empty when absent.
json take_kernel_report(json& md) {
    json report = json::object();
    if (const auto source = md.find("cellblock_source"); source != md.end()) {
        if (source->is_object()) report = std::move(*source);
        md.erase(source);
    }
    return report;
}

std::optional<std::uint64_t> count_in(const json& report, const char* key) {
    const auto it = report.find(key);
    if (it == report.end() || !it->is_number_unsigned()) return std::nullopt;
    return it->get<std::uint64_t>();
}

// The kernel's reading of its own cgroup at the end of an execution, and its
// CPU time when the execution began (cellblock_ipykernel.CgroupUsage).
struct ReportedUsage {
    SandboxUsage usage;
    std::uint64_t cpu_ns_at_start = 0;
};

std::optional<ReportedUsage> usage_in(const json& report) {
    const auto it = report.find("usage");
    if (it == report.end() || !it->is_object()) return std::nullopt;
    const auto cpu = count_in(*it, "cpu_ns"), start = count_in(*it, "cpu_ns_at_start");
    if (!cpu || !start || *start > *cpu) return std::nullopt;
    ReportedUsage out;
    out.usage.cpu_ns = *cpu;
    out.usage.memory_bytes = count_in(*it, "memory_bytes").value_or(0);
    out.usage.memory_peak_bytes = count_in(*it, "memory_peak_bytes").value_or(0);
    out.cpu_ns_at_start = *start;
    return out;
}

}  // namespace

SessionCore::SessionCore(CoreOptions options, SessionIo& io, Clock::time_point now)
    : options_(std::move(options)), io_(io), idle_since_(now) {
    if (options_.policy && options_.limits)
        governor_.emplace(*options_.limits, *options_.policy, now);
}

void SessionCore::on_kernel_attached(Clock::time_point now,
                                     const std::vector<std::string>& probe_ids) {
    probe_ids_.insert(probe_ids.begin(), probe_ids.end());
    cpu_ns_at_attach_ = io_.kernel_usage().cpu_ns;
    if (lifecycle_.state() == SessionState::resuming && exact_wake_) {
        // Restored whole by its runtime: nothing to place, nothing to run.
        restored(now, json{{"status", "ok"}});
        return;
    }
    if (lifecycle_.state() == SessionState::resuming) {
        // The snapshot first; the requests that woke it after.
        // Answered at once here (the time is this turn's) or later (then's).
        auto at_once = std::make_shared<bool>(true);
        io_.place_snapshot([this, now, at_once](const std::string* failed) {
            const Clock::time_point when = *at_once ? now : Clock::now();
            if (lifecycle_.state() != SessionState::resuming) return;  // closed meanwhile
            if (failed) return close(when, "resume_failed: " + *failed);
            send_own(when, true);
        });
        *at_once = false;
        return;
    }
    if (lifecycle_.state() == SessionState::adopting) {
        // Its clients' SUB sockets connect again by themselves, about 0.2 s
        // after the port is bound: requests wait for them (settle_adoption).
        adopt_settle_until_ = now + options_.adopt_settle;
        if (!io_.clients_listening()) io_.hold_outputs_for_listener(options_.adopt_output_hold);
        if (!answered_before_.empty() ||
            std::any_of(carried_.begin(), carried_.end(),
                        [](const auto& c) { return c.second.channel == Channel::shell; })) {
            // cellblock's kernel sends its last replies again first: one it
            // sent may have been lost in the dead server's socket buffer.
            carried_fence_ = io_.send_to_kernel(Channel::shell, "kernel_info_request",
                                                {{"cellblock", {{"resend_replies", true}}}});
            probe_ids_.insert(carried_fence_);  // its statuses are no client's
            fence_status_id_ = carried_fence_;
            for (const auto& [id, request] : carried_) {
                if (request.channel == Channel::shell) idle_owed_[id] = request.header;
            }
        }
        if (governor_) governor_->on_client_request(now);
        settle_adoption(now);
        return;
    }
    if (lifecycle_.state() == SessionState::starting) move_to(SessionState::idle);
    if (governor_) governor_->on_client_request(now);
}

std::string SessionCore::state() const {
    // closing lasts only inside close(): seen from outside it is closed.
    if (lifecycle_.ending()) return "closed";
    return std::string(state_name(lifecycle_.state()));
}

void SessionCore::move_to(SessionState to) {
    if (!lifecycle_.go(to)) return;
    if (options_.observer) {
        options_.observer->on_state(options_.session_id, std::string(state_name(to)));
    }
}

void SessionCore::execution_ended() {
    if (lifecycle_.state() == SessionState::busy) move_to(SessionState::idle);
}

void SessionCore::event(const std::string& kind, const std::string& detail) {
    if (options_.observer) options_.observer->on_event(options_.session_id, kind, detail);
}

void SessionCore::remember_parent(const std::string& msg_id) {
    if (recent_.insert(msg_id).second) {
        recent_order_.push_back(msg_id);
        if (recent_order_.size() > options_.recent_parents) {
            recent_.erase(recent_order_.front());
            free_passes_.erase(recent_order_.front());
            recent_order_.pop_front();
        }
    }
}

bool SessionCore::known_parent(const std::string& msg_id) const {
    return !msg_id.empty() && recent_.count(msg_id) > 0;
}

void SessionCore::requests_changed() {
    if (options_.observer) options_.observer->on_requests_changed(options_.session_id);
}

// --- the client's side ---

void SessionCore::on_client_request(Clock::time_point now, Channel channel, InboundMessage msg) {
    if (!ends_with(msg.msg_type, "_request")) {
        io_.rejected(channel_name(channel), sender(msg), "'" + msg.msg_type + "' is not a request");
        return;
    }
    if (sent_again(msg, channel)) return;
    dispatch_request(now, channel, std::move(msg));
}

// What tells a request sent again from another one: its msg_id, type and
// header date. msg_ids alone repeat: jupyter_client's KernelManager and the
// client it makes have a Session each, with the same session id and their
// own counters (KernelManager.client clones it), so an interrupt_request of
// the manager and a kernel_info_request of the client can share an id. A
// request sent again is the same header, date and all.
std::string SessionCore::request_key(const json& header) {
    const auto date = header.find("date");
    std::string key = json_string(header, "msg_id") + '\x1f' + json_string(header, "msg_type");
    key += '\x1f';
    if (date != header.end()) key += date->is_string() ? date->get<std::string>() : date->dump();
    return key;
}

bool SessionCore::sent_again(const InboundMessage& msg, Channel channel) {
    const std::string& id = msg.msg_id;
    if (id.empty()) return false;
    const std::string key = request_key(msg.header);
    const auto same = [&key](const json& header) { return request_key(header) == key; };
    const auto in_map = [&](const auto& requests) {
        auto it = requests.find(id);
        return it != requests.end() && same(it->second.header);
    };
    const auto has = [&](const auto& queue) {
        return std::any_of(queue.begin(), queue.end(),
                           [&](const QueuedRequest& q) { return same(q.message.header); });
    };
    const bool open = in_map(pending_) || in_map(carried_) || has(queue_) || has(asleep_) ||
                      std::any_of(carried_replies_.begin(), carried_replies_.end(),
                                  [&](const auto& r) { return same(r.first.header); });
    if (open || std::find(answered_.begin(), answered_.end(), key) != answered_.end()) {
        // Its reply is coming, or went to this connection already.
        io_.log(std::string(channel_name(channel)) + ": " + msg.msg_type + " " + id +
                " sent again (" + (open ? "still open" : "answered") + "): not run twice");
        return true;
    }
    if (!answered_before_.count(key)) return false;
    answered_before_.erase(key);
    // Answered by the last server, which may have died with the reply: the
    // kernel's copy (sent again at the fence) if it came or is still to come.
    PendingRequest request{channel, msg.identities(), msg.msg_type, msg.header};
    if (channel == Channel::shell && !carried_.count(id)) {
        // The kernel's copy, by its parent's msg_id (the kernel writes the
        // parent header back as it parsed it): of the same kind of request.
        auto resent = resent_.find(id);
        if (resent != resent_.end() && resent->second.msg_type != reply_type(msg.msg_type)) {
            resent = resent_.end();
        }
        if (resent != resent_.end() || !carried_fence_.empty()) {
            carried_[id] = std::move(request);
            idle_owed_[id] = msg.header;
            requests_changed();
            if (resent != resent_.end() && lifecycle_.state() != SessionState::adopting) {
                InboundMessage reply = std::move(resent->second);
                resent_.erase(resent);
                reply_carried(Channel::shell, reply);
            } else if (resent != resent_.end()) {
                carried_replies_.emplace_back(std::move(carried_[id]), std::move(resent->second));
                carried_.erase(id);
                resent_.erase(resent);
            }
            return true;
        }
    }
    refuse(request, ename::ServerRestarting,
           "the server restarted after answering this request; the reply was lost with it "
           "(what the request did to the kernel's state is kept): it is not run again");
    event("reply_lost", msg.msg_type + " " + id + ", sent again after the restart");
    return true;
}

void SessionCore::note_answered(const json& header) {
    if (json_string(header, "msg_id").empty()) return;
    answered_.push_back(request_key(header));
    if (answered_.size() > kAnsweredKept) answered_.pop_front();
}

void SessionCore::dispatch_request(Clock::time_point now, Channel channel, InboundMessage msg) {
    PendingRequest request{channel, msg.identities(), msg.msg_type, msg.header};
    // Handing over: only an interrupt of the running execution goes to this
    // kernel; the rest wait for the next server (handover_state).
    const bool interrupt = channel == Channel::control && msg.msg_type == "interrupt_request";
    if ((asleep() || handing_over_) && msg.msg_type == "is_complete_request") {
        // A console asks this as the user presses Enter, and gives up after
        // a second (then stops asking for the rest of its life): a wake takes
        // longer. "unknown" is the spec's answer for a kernel that cannot
        // tell; the line runs as typed, and the session starts waking.
        if (governor_) governor_->on_client_request(now);
        reply(request, "is_complete_reply", {{"status", "unknown"}});
        if (lifecycle_.state() == SessionState::hibernated && !handing_over_) wake(now);
        return;
    }
    if (asleep() || (handing_over_ && !(interrupt && execution_))) {
        // Answered once the session is awake, in the order they came.
        if (asleep_.size() >= options_.max_queued) {
            refuse(request, ename::SessionBusy,
                   "more than " + std::to_string(options_.max_queued) +
                       " requests are waiting for the session to wake");
            return;
        }
        if (governor_) governor_->on_client_request(now);
        asleep_.push_back({channel, std::move(msg)});
        // A crash while it waits for the next start still finds it (the live row).
        if (handing_over_) requests_changed();
        if (lifecycle_.state() == SessionState::hibernated && !handing_over_) wake(now);
        return;
    }
    if (!lifecycle_.kernel_live()) {
        refuse(request, ename::SessionClosed,
               lifecycle_.ending() ? "this session is closed: " + close_reason_
                                   : "this session is starting");
        return;
    }
    if (msg.msg_type.starts_with(kServersOwnPrefix)) {
        // The server's own requests to the kernel (a remote session's file
        // bytes, kernel_files.hpp): files go through the manager's caps.
        refuse(request, ename::UnknownRequest,
               "'" + msg.msg_type +
                   "' is a message of the server's own to the kernel; use the manager's file "
                   "requests");
        return;
    }
    if (governor_) governor_->on_client_request(now);
    static const std::unordered_map<std::string_view, RequestHandler> handlers = {
        {"interrupt_request", &SessionCore::on_interrupt_request},
        {"execute_request", &SessionCore::on_execute_request},
    };
    if (auto h = handlers.find(msg.msg_type); h != handlers.end()) {
        if (!(this->*(h->second))(now, channel, msg, request)) return;
    }
    if (pending_.size() >= options_.max_pending) {
        refuse(
            request, ename::SessionBusy,
            std::to_string(options_.max_pending) + " requests are waiting for the kernel already");
        return;
    }
    if (msg.msg_type == "shutdown_request") {
        // Its grace starts once it is open at the kernel: answered for it after.
        shutdown_deadline_ = now + options_.shutdown_grace;
        shutdown_request_ = request;
    }
    remember_parent(msg.msg_id);
    pending_[msg.msg_id] = std::move(request);
    requests_changed();
    if (!io_.forward_to_kernel(channel, msg)) {
        io_.log(std::string(channel_name(channel)) + ": kernel queue full; request " + msg.msg_id +
                " dropped");
    }
}

bool SessionCore::on_interrupt_request(Clock::time_point now, Channel channel, InboundMessage&,
                                       PendingRequest& request) {
    if (channel != Channel::control) return true;  // on shell, the kernel's to answer
    publish_status(request.header, "busy");
    io_.interrupt_kernel();
    // Code that ignores SIGINT must not keep the sandbox: on_tick escalates.
    if (governor_ && execution_) {
        governor_->on_interrupt(now);
        event("interrupted", "interrupt_request from a client");
    }
    reply(request, "interrupt_reply", {{"status", "ok"}});
    publish_status(request.header, "idle");
    return false;
}

bool SessionCore::on_execute_request(Clock::time_point now, Channel channel, InboundMessage& msg,
                                     PendingRequest& request) {
    if (!governor_) return true;
    if (execution_) {
        // The kernel runs one execution at a time anyway; queueing here keeps
        // the policy's clock per execution.
        if (queue_.size() >= options_.max_queued) {
            refuse(request, ename::SessionBusy,
                   "more than " + std::to_string(options_.max_queued) + " executions are queued");
            return false;
        }
        queue_.push_back({channel, std::move(msg)});
        requests_changed();
        return false;
    }
    std::optional<double> timeout;
    if (auto cb = msg.metadata.find("cellblock"); cb != msg.metadata.end() && cb->is_object()) {
        if (auto t = cb->find("timeout_s"); t != cb->end()) {
            if (!t->is_number()) {
                refuse(request, ename::InvalidLimits,
                       "metadata.cellblock.timeout_s must be a number");
                return false;
            }
            timeout = t->get<double>();
        }
    }
    const auto decision = governor_->on_execute_request(now, timeout);
    if (!decision.forward) {
        refuse(request, decision.ename, decision.evalue);
        // Refused executions use no count; the audit keeps them as events.
        event("refused", msg.msg_id + " " + decision.ename + ": " + decision.evalue);
        return false;
    }
    Execution e;
    e.msg_id = msg.msg_id;
    e.code = json_string(msg.content, "code");
    e.count = governor_->executions();
    e.started = now;
    e.cpu_ns_at_start = io_.kernel_usage().cpu_ns;
    e.deadline = decision.deadline;
    e.timeout_s = std::chrono::duration<double>(decision.deadline - now).count();
    execution_ = std::move(e);
    // The kernel cuts output at its source past the same budget
    // (kernel-shim/cellblock_ipykernel.py), so a flood costs the relay next
    // to nothing; the relay's own cut stays the guarantee.
    if (msg.metadata.is_object()) {
        json& budget = msg.metadata["cellblock"];
        if (!budget.is_object()) budget = json::object();
        budget["output_bytes"] = governor_->limits().output_bytes;
        msg.frames[msg.layout.metadata()] = Frame(msg.metadata.dump());
    }
    background_bytes_ = 0;
    background_marker_sent_ = false;
    move_to(SessionState::busy);
    return true;
}

void SessionCore::drain_queue(Clock::time_point now, bool previous_failed) {
    while (!queue_.empty() && !execution_ && !lifecycle_.ending()) {
        QueuedRequest next = std::move(queue_.front());
        queue_.pop_front();
        requests_changed();
        const json& content = next.message.content;
        const bool stop_on_error =
            !content.contains("stop_on_error") || content["stop_on_error"] != false;
        if (previous_failed && stop_on_error) {
            // As the kernel does with requests queued behind an error.
            PendingRequest request{next.channel, next.message.identities(), "execute_request",
                                   next.message.header};
            publish_status(request.header, "busy");
            reply(request, "execute_reply",
                  {{"status", "aborted"},
                   {"execution_count", governor_ ? governor_->executions() : 0}});
            publish_status(request.header, "idle");
            continue;
        }
        dispatch_request(now, next.channel, std::move(next.message));
    }
}

void SessionCore::on_client_input(Clock::time_point, InboundMessage msg) {
    if (!kernel_live()) return;
    io_.forward_to_kernel(Channel::stdin_, msg);
}

// --- the kernel's side ---

void SessionCore::on_kernel_reply(Clock::time_point now, Channel channel, InboundMessage msg) {
    if (!kernel_live()) return;
    if (own_ && msg.parent_id == own_->msg_id && channel == Channel::shell &&
        msg.msg_type == "execute_reply") {
        on_own_reply(now, msg);
        return;
    }
    const std::string where = std::string("kernel ") + channel_name(channel);
    if (!carried_fence_.empty() && msg.parent_id == carried_fence_) {
        carried_fence_.clear();
        fence_passed_ = true;
        if (lifecycle_.state() != SessionState::adopting) answer_lost_carried();
        return;
    }
    auto it = pending_.find(msg.parent_id);
    if (it == pending_.end() && reply_carried(channel, msg)) return;
    if (it == pending_.end() && !carried_fence_.empty() && channel == Channel::shell) {
        // Sent again at the fence's asking, and answered already; kept if the
        // last server answered it: its client may ask again (sent_again).
        const std::string prefix = msg.parent_id + '\x1f';
        if (std::any_of(answered_before_.begin(), answered_before_.end(),
                        [&prefix](const std::string& k) { return k.rfind(prefix, 0) == 0; })) {
            resent_.emplace(msg.parent_id, std::move(msg));
        }
        return;
    }
    if (it == pending_.end() || it->second.channel != channel) {
        io_.rejected(where, "", "reply to a request that is not open: '" + msg.parent_id + "'");
        return;
    }
    if (msg.msg_type != reply_type(it->second.msg_type)) {
        io_.rejected(where, "", "'" + msg.msg_type + "' does not answer " + it->second.msg_type);
        return;
    }
    note_answered(it->second.header);
    PendingRequest request = std::move(it->second);
    pending_.erase(it);
    requests_changed();

    if (execution_ && execution_->msg_id == msg.parent_id && governor_) {
        held_reply_ =
            HeldReply{std::move(request), std::move(msg), now + options_.reply_hold_limit};
        if (execution_->idle_seen) release_held_reply(now);
        return;
    }
    if (resumed_) {
        // The first reply after a resume, of whatever kind, says so.
        json md = metadata_of(msg, options_.max_json_depth);
        mark_resumed(md);
        const std::string new_metadata = md.dump();
        io_.forward_reply(channel, request.identities, msg, &new_metadata);
    } else {
        io_.forward_reply(channel, request.identities, msg, nullptr);
    }
    if (request.msg_type == "shutdown_request") {
        shutdown_request_.reset();
        close(now, "shutdown requested by the client");
    }
}

bool SessionCore::reply_carried(Channel channel, InboundMessage& msg) {
    auto it = carried_.find(msg.parent_id);
    if (it == carried_.end() || it->second.channel != channel ||
        msg.msg_type != reply_type(it->second.msg_type)) {
        return false;
    }
    note_answered(it->second.header);
    PendingRequest request = std::move(it->second);
    carried_.erase(it);
    requests_changed();
    if (lifecycle_.state() == SessionState::adopting) {
        carried_replies_.emplace_back(std::move(request),
                                      std::move(msg));  // its client is not back yet
        return true;
    }
    // Whole, but what it published while no server ran reached no one.
    json md = metadata_of(msg, options_.max_json_depth);
    if (!md["cellblock"].is_object()) md["cellblock"] = json::object();
    // What the kernel published while no relay listened, as cellblock's
    // kernel counted it (cellblock_unrelayed.Unheard: a lower bound);
    // another kernel's is not known.
    const json report = take_kernel_report(md);
    const auto messages = count_in(report, "unheard_messages");
    const auto bytes = count_in(report, "unheard_bytes");
    md["cellblock"]["server_restarted"] = {
        {"outputs_lost", messages && bytes
                             ? json{{"messages", *messages}, {"bytes", *bytes}, {"at_least", true}}
                             : json("uncounted: what the kernel published while no server ran")}};
    const std::string new_metadata = md.dump();
    io_.forward_reply(channel, request.identities, msg, &new_metadata);
    publish_owed_idles();
    return true;
}

void SessionCore::answer_lost_carried() {
    for (auto it = carried_.begin(); it != carried_.end();) {
        // Control is served by a thread of its own: no fence orders it, and
        // its requests (interrupts, shutdowns) are answered at the settle.
        if (it->second.channel == Channel::shell && !fence_passed_) {
            ++it;
            continue;
        }
        idle_owed_.erase(it->first);  // refuse publishes its statuses
        refuse(it->second, ename::ServerRestarting,
               "the server restarted while this request ran; the kernel's reply was lost with "
               "it (what the request did to the kernel's state is kept): send it again if it "
               "is needed");
        event("reply_lost", it->second.msg_type + " " + it->first + ", answered at the adoption");
        it = carried_.erase(it);
        requests_changed();
    }
}

void SessionCore::note_owed_idle(const InboundMessage& msg) {
    if (msg.msg_type != "status") return;
    const bool fence = !fence_status_id_.empty() && msg.parent_id == fence_status_id_;
    if (!fence && !idle_owed_.count(msg.parent_id)) return;
    const auto content = msg.parsed_content(8);
    if (!content || json_string(*content, "execution_state") != "idle") return;
    if (fence) {
        fence_idle_seen_ = true;
        fence_status_id_.clear();
        publish_owed_idles();
    } else {
        idle_owed_.erase(msg.parent_id);
    }
}

void SessionCore::publish_owed_idles() {
    // After the fence's idle, and once the clients are back (not adopting):
    // those answered by now had their idle published to no one.
    if (!fence_idle_seen_ || lifecycle_.state() == SessionState::adopting) return;
    for (auto it = idle_owed_.begin(); it != idle_owed_.end();) {
        if (carried_.count(it->first)) {
            ++it;
            continue;
        }
        publish_status(it->second, "idle");
        it = idle_owed_.erase(it);
    }
}

void SessionCore::release_held_reply(Clock::time_point now) {
    if (!held_reply_) return;
    HeldReply held = std::move(*held_reply_);
    held_reply_.reset();
    InboundMessage& msg = held.message;
    // The budget an agent needs rides on the reply: metadata.cellblock.
    const auto content = msg.parsed_content(options_.max_json_depth);
    json md = metadata_of(msg, options_.max_json_depth);
    const json report = take_kernel_report(md);
    // A sandbox the server cannot read (Swarm) takes the kernel's own
    // reading of its cgroup, and the execution's CPU time is the kernel's too.
    std::uint64_t cpu_ns_at_start = execution_->cpu_ns_at_start;
    if (const auto reported = usage_in(report);
        reported && lifecycle_.attached() && io_.kernel_reported_usage(reported->usage)) {
        cpu_ns_at_start = reported->cpu_ns_at_start;
    }
    const SandboxUsage usage = lifecycle_.attached() ? io_.kernel_usage() : SandboxUsage{};
    const std::uint64_t cpu_ms = (usage.cpu_ns - std::min(usage.cpu_ns, cpu_ns_at_start)) / 1000000;
    // What the kernel dropped at its source: counted, and not shown as is.
    if (const auto dropped = count_in(report, "dropped_bytes")) {
        governor_->on_dropped_at_source(*dropped);
    }
    md["cellblock"] = governor_->on_execute_reply(now, cpu_ms, usage.memory_peak_bytes);
    mark_resumed(md);
    tell_lost(held.request.header);  // if the kernel's busy did not come first
    if (const NetworkLimits& network = governor_->limits().network; network.gateway()) {
        md["cellblock"]["network_bytes_used"] = network_bytes_;
        md["cellblock"]["network_max_bytes"] = network.max_bytes;
    }
    memory_peak_bytes_ = std::max(memory_peak_bytes_, usage.memory_peak_bytes);
    cpu_ms_total_ += cpu_ms;
    const std::string new_metadata = md.dump();
    const std::string status = content ? json_string(*content, "status") : "";
    const std::string ename = content ? json_string(*content, "ename") : "";
    io_.forward_reply(held.request.channel, held.request.identities, msg, &new_metadata);
    if (options_.observer) {
        ExecutionRecord record = execution_record(now, status.empty() ? "unknown" : status, ename);
        record.cpu_ms = cpu_ms;
        record.memory_peak_bytes = usage.memory_peak_bytes;
        options_.observer->on_execution(record);
    }
    last_execution_id_ = execution_->msg_id;
    execution_.reset();
    idle_since_ = now;
    execution_ended();
    drain_queue(now, status == "error");
}

void SessionCore::on_kernel_input_request(Clock::time_point, InboundMessage msg) {
    if (!kernel_live()) return;
    auto it = pending_.find(msg.parent_id);
    if (it == pending_.end() || it->second.msg_type != "execute_request") {
        io_.rejected("kernel stdin", "", "input_request for a request that is not open");
        return;
    }
    // The client's stdin socket shares the identity of its shell socket.
    io_.forward_reply(Channel::stdin_, it->second.identities, msg, nullptr);
}

void SessionCore::on_kernel_exit(Clock::time_point now) {
    if (!kernel_live()) return;
    // Replies it sent just before may still be in flight: drain them for a
    // moment before answering what is left.
    if (!shutdown_deadline_ || *shutdown_deadline_ > now + options_.kernel_exit_drain) {
        shutdown_deadline_ = now + options_.kernel_exit_drain;
    }
    kernel_exited_ = true;
}

// --- time ---

std::optional<Clock::time_point> SessionCore::next_deadline(Clock::time_point now) const {
    if (lifecycle_.ending()) {
        if (!options_.policy) return std::nullopt;
        return closed_at_ + seconds(options_.policy->closed_channels_s);
    }
    std::optional<Clock::time_point> next = shutdown_deadline_;
    auto consider = [&](Clock::time_point t) {
        if (!next || t < *next) next = t;
    };
    if (held_reply_) consider(held_reply_->release_by);
    if (own_) consider(own_->deadline);
    if (execution_ && !held_reply_) {
        consider(execution_->kill_at ? *execution_->kill_at : execution_->deadline);
        if (auto grace_end = governor_->interrupt_deadline()) consider(*grace_end);
    }
    if (adopt_settle_until_) consider(adopt_look_at_);
    if (handing_over_ && handover_hibernates_ && lifecycle_.state() == SessionState::idle &&
        !handover_failed_) {
        consider(settle_at_);  // settle_handover: free yet? (due at once after a reply)
    }
    if (due_to_move()) consider(now);
    if (governor_) {
        consider(governor_->next_expiry_check(now));
        if (free_to_sleep()) {
            if (auto due = governor_->next_hibernation(now)) consider(*due);
        }
    }
    return next;
}

bool SessionCore::expired(Clock::time_point now) const {
    if (!lifecycle_.ending()) return false;
    if (!options_.policy) return true;
    return now - closed_at_ >= seconds(options_.policy->closed_channels_s);
}

void SessionCore::on_tick(Clock::time_point now) {
    if (lifecycle_.ending()) return;
    settle_adoption(now);
    if (shutdown_deadline_ && now >= *shutdown_deadline_) {
        shutdown_deadline_.reset();
        if (shutdown_request_) {
            // The kernel did not answer in time (or died): answer for it.
            PendingRequest request = std::move(*shutdown_request_);
            shutdown_request_.reset();
            pending_.erase(json_string(request.header, "msg_id"));
            reply(request, "shutdown_reply", {{"status", "ok"}, {"restart", false}});
            close(now, "shutdown requested by the client");
            return;
        }
        if (kernel_exited_) {
            release_held_reply(now);
            const KernelExit exit = io_.kernel_exit();
            io_.log(exit.description);
            // A lost node took the session's state with it: the client is
            // told the session closed, never handed a new kernel.
            const std::string ename = exit.node_lost ? ename::SessionClosed
                                      : exit.oom     ? ename::MemoryLimitExceeded
                                                     : ename::KernelDied;
            const std::string reason = lifecycle_.state() == SessionState::resuming
                                           ? "resume_failed: the kernel exited: "
                                       : exit.node_lost ? "node_lost: "
                                       : exit.oom       ? "memory_limit: "
                                                        : "kernel_died: ";
            if (execution_) finish_execution(now, "error", ename);
            fail_pending(ename, exit.node_lost ? reason + exit.description : exit.description);
            close(now, reason + exit.description);
            return;
        }
    }
    if (held_reply_ && now >= held_reply_->release_by) release_held_reply(now);
    if (own_ && now >= own_->deadline) {
        const bool restore = own_->restore;
        own_.reset();
        const std::string why =
            fmt::format("the snapshot's {} did not finish within {} s",
                        restore ? "restore" : "save", options_.snapshot_timeout.count() / 1000);
        if (!restore) {
            hibernation_failed(now, why);
        } else {
            close(now, "resume_failed: " + why);
            return;
        }
    }
    if (execution_ && !held_reply_ && governor_->interrupt_ignored(now)) {
        const std::string evalue =
            "the execution did not stop within " +
            format_seconds(governor_->limits().interrupt_grace_s) +
            " s of the client's interrupt_request (interrupt_grace_s); the kernel was killed";
        kill_for(now, ename::InterruptIgnored, evalue, "error", "interrupt_ignored");
        return;
    }
    if (execution_ && !held_reply_) {
        if (!execution_->kill_at && now >= execution_->deadline) {
            io_.log(fmt::format("execution {} passed its {:.0f} s timeout; interrupting",
                                execution_->count, execution_->timeout_s));
            event("interrupted", "execution timeout");
            io_.interrupt_kernel();
            execution_->kill_at = now + seconds(options_.policy->kill_grace_s);
        } else if (execution_->kill_at && now >= *execution_->kill_at) {
            const std::string evalue =
                "the execution ran past its timeout of " +
                std::to_string(static_cast<int>(execution_->timeout_s)) +
                " s and did not stop when interrupted; the session was killed";
            kill_for(now, ename::ExecutionTimeout, evalue, "timeout", "exec_timeout");
            return;
        }
    }
    if (governor_) {
        if (auto reason = governor_->expiry(now)) {
            close(now, *reason);
            return;
        }
        if (handing_over_) {
            settle_handover(now);
        } else if (due_to_move()) {
            if (std::string why; !hibernate(now, why)) {
                io_.log("it cannot move off its drained node: " + why);
                event("hibernate_failed", why);
                moving_ = false;
            }
        } else if (free_to_sleep() && governor_->hibernation_due(now)) {
            event("hibernating", "idle for hibernate_after_s " +
                                     format_seconds(governor_->limits().hibernate_after_s) + " s");
            if (std::string why; !hibernate(now, why)) {
                io_.log("not hibernating: " + why);
                governor_->hibernation_declined(now);
            }
        }
    }
}

// --- ending things ---

void SessionCore::kill_for(Clock::time_point now, const std::string& ename,
                           const std::string& evalue, const std::string& execution_status,
                           const std::string& close_reason) {
    io_.log(evalue);
    event("killed", ename + ": " + evalue);
    io_.kill_kernel();
    finish_execution(now, execution_status, ename);
    fail_pending(ename, evalue);
    close(now, close_reason);
}

ExecutionRecord SessionCore::execution_record(Clock::time_point now, const std::string& status,
                                              const std::string& ename) const {
    ExecutionRecord record;
    record.session_id = options_.session_id;
    record.count = execution_->count;
    record.msg_id = execution_->msg_id;
    record.code = options_.audit_code_hash_only ? code_digest(execution_->code) : execution_->code;
    record.status = status;
    record.ename = ename;
    record.started_at =
        std::chrono::duration<double>(execution_->started.time_since_epoch()).count() +
        options_.unix_minus_steady_s;
    record.wall_ms = std::chrono::duration<double, std::milli>(now - execution_->started).count();
    record.output_bytes = execution_->output_bytes;
    record.truncated = governor_ && governor_->truncated();
    return record;
}

void SessionCore::finish_execution(Clock::time_point now, const std::string& status,
                                   const std::string& ename) {
    if (!execution_) return;
    if (options_.observer) {
        ExecutionRecord record = execution_record(now, status, ename);
        if (lifecycle_.attached()) record.memory_peak_bytes = io_.kernel_usage().memory_peak_bytes;
        options_.observer->on_execution(record);
    }
    execution_.reset();
    idle_since_ = now;
    execution_ended();
}

void SessionCore::publish(const json& parent, const std::string& msg_type, json content) {
    io_.publish(parent, msg_type, std::move(content));
}

void SessionCore::publish_status(const json& parent, const char* state) {
    publish(parent, "status", {{"execution_state", state}});
}

void SessionCore::reply(const PendingRequest& request, const std::string& msg_type, json content) {
    note_answered(request.header);
    io_.send_reply(request.channel, request.identities, request.header, msg_type,
                   std::move(content));
}

void SessionCore::refuse(const PendingRequest& request, const std::string& ename,
                         const std::string& evalue) {
    json content = error_content(request.msg_type, ename, evalue);
    publish_status(request.header, "busy");
    if (request.msg_type == "execute_request") {
        publish(request.header, "error",
                {{"ename", ename}, {"evalue", evalue}, {"traceback", content["traceback"]}});
        content["execution_count"] = governor_ ? governor_->executions() : 0;
        content["user_expressions"] = json::object();
        content["payload"] = json::array();
        if (governor_) content["cellblock"] = {{"executions_left", governor_->executions_left()}};
    }
    reply(request, reply_type(request.msg_type), content);
    publish_status(request.header, "idle");
}

void SessionCore::fail_pending(const std::string& ename, const std::string& evalue) {
    auto pending = std::move(pending_);
    pending_.clear();
    for (auto& [msg_id, request] : pending) {
        json content = error_content(request.msg_type, ename, evalue);
        if (request.msg_type == "execute_request") {
            publish(request.header, "error",
                    {{"ename", ename}, {"evalue", evalue}, {"traceback", content["traceback"]}});
            content["execution_count"] = nullptr;
            content["user_expressions"] = json::object();
            content["payload"] = json::array();
        } else if (request.msg_type == "shutdown_request") {
            content = {{"status", "ok"}, {"restart", false}};
        }
        reply(request, reply_type(request.msg_type), content);
        publish_status(request.header, "idle");
    }
}

void SessionCore::close(Clock::time_point now, const std::string& reason, const char* ename,
                        const std::string& why) {
    if (lifecycle_.ending()) return;
    const std::string evalue = why + ": " + reason;
    for (auto& queued : queue_) {
        PendingRequest request{queued.channel, queued.message.identities(), "execute_request",
                               queued.message.header};
        refuse(request, ename, evalue);
    }
    queue_.clear();
    for (auto& waiting : asleep_) {
        PendingRequest request{waiting.channel, waiting.message.identities(),
                               waiting.message.msg_type, waiting.message.header};
        refuse(request, ename, evalue);
    }
    asleep_.clear();
    for (const auto& [id, request] : carried_) refuse(request, ename, evalue);
    carried_.clear();
    own_.reset();
    close_reason_ = reason;
    move_to(SessionState::closing);
    closed_at_ = now;
    if (held_reply_ && lifecycle_.attached()) release_held_reply(now);
    held_reply_.reset();
    if (execution_) finish_execution(now, "error", ename);
    if (!pending_.empty()) fail_pending(ename, evalue);
    if (lifecycle_.attached()) keep_usage();
    io_.release_kernel();
    move_to(SessionState::closed);
    if (options_.observer) options_.observer->on_closed(options_.session_id, reason);
}

}  // namespace cellblock
