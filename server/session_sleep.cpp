// Hibernation's part of SessionCore (docs/hibernation.md): the kernel saves
// its snapshot with a silent execute of the relay's own, the sandbox goes,
// the client's channels stay; the next request wakes the session, a fresh
// kernel restores the snapshot and the requests that waited are replayed in
// order. What could not be carried rides on the first execute_reply.
#include "session_core.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "cellblock/session_policy.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

// How often an adopting session looks for its clients (settle_adoption).
constexpr std::chrono::milliseconds kAdoptLook{20};

// The snapshot module's calls, run by the kernel as a silent execute
// (kernel-shim/cellblock_snapshot.py); its report comes back as a user
// expression with a JSON form.
// A restore given `size` reads a snapshot still being written, up to it.
json snapshot_request(const std::string& call, const std::string& path,
                      std::optional<std::uint64_t> size = std::nullopt) {
    const std::string more = size ? ", size=" + std::to_string(*size) : "";
    return {
        {"code", "__import__('cellblock_snapshot')." + call + "(get_ipython(), " +
                     json(path).dump() + more + ")"},
        {"silent", true},
        {"store_history", false},
        {"user_expressions", {{"cellblock_snapshot", "__import__('cellblock_snapshot').report()"}}},
        {"allow_stdin", false},
        {"stop_on_error", false}};
}

// The kernel's report as the server keeps it. The session's own code writes
// it (it can replace cellblock_snapshot.report), so only the known fields,
// of the known types, bounded: a string where a number belonged once ended
// the server (a json type_error out of the history's event).
json report_of(const json& content) {
    json clean = {{"saved", 0}, {"bytes", 0}, {"lost", json::array()}, {"ms", json::object()}};
    const auto expressions = content.find("user_expressions");
    if (expressions == content.end() || !expressions->is_object()) return clean;
    const auto value = expressions->find("cellblock_snapshot");
    if (value == expressions->end() || !value->is_object()) return clean;
    const auto data = value->find("data");
    if (data == value->end() || !data->is_object()) return clean;
    const auto found = data->find("application/json");
    if (found == data->end() || !found->is_object()) return clean;
    const json& report = *found;
    for (const char* count : {"saved", "bytes"}) {
        const auto n = report.find(count);
        if (n != report.end() && n->is_number_unsigned()) clean[count] = n->get<std::uint64_t>();
    }
    constexpr std::size_t kLostNames = 1000, kLostText = 300;
    const auto cut = [](const std::string& text) {
        return text.substr(0, utf8_safe_prefix(text, kLostText));
    };
    const auto lost = report.find("lost");
    if (lost != report.end() && lost->is_array()) {
        for (const auto& item : *lost) {
            if (clean["lost"].size() >= kLostNames) break;
            if (item.is_array() && item.size() == 2 && item[0].is_string() && item[1].is_string()) {
                clean["lost"].push_back(
                    {cut(item[0].get<std::string>()), cut(item[1].get<std::string>())});
            }
        }
    }
    const auto ms = report.find("ms");
    if (ms != report.end() && ms->is_object()) {
        for (const char* step : {"namespace", "write", "read", "waited", "files", "imports"}) {
            const auto v = ms->find(step);
            if (v == ms->end() || !v->is_number()) continue;
            const double m = v->get<double>();
            if (std::isfinite(m)) clean["ms"][step] = std::clamp(m, 0.0, 1e9);
        }
    }
    return clean;
}

// The kernel's own timing of its save or restore (the report's "ms", as
// report_of() kept it), for the history.
std::string kernel_steps(const json& report) {
    const auto ms = report.find("ms");
    if (ms == report.end() || !ms->is_object()) return "";
    std::string text;
    for (const auto& [step, value] : ms->items()) {
        text += fmt::format("{}{} {:.0f} ms", text.empty() ? "" : ", ", step, value.get<double>());
    }
    return text.empty() ? "" : "; in the kernel: " + text;
}

std::string error_of(const json& content) {
    return json_string(content, "ename") + ": " + json_string(content, "evalue");
}

double ms_between(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

bool SessionCore::asleep() const {
    switch (lifecycle_.state()) {
        case SessionState::hibernating:
        case SessionState::hibernated:
        case SessionState::resuming:
        case SessionState::adopting:  // until its clients listen again
            return true;
        default:
            return false;
    }
}

bool SessionCore::requests_open() const {
    return execution_ || !queue_.empty() || held_reply_ || !pending_.empty() || shutdown_request_;
}

bool SessionCore::free_to_sleep() const {
    std::string why;
    return lifecycle_.state() == SessionState::idle && !requests_open() && io_.can_sleep(why);
}

bool SessionCore::hibernate(Clock::time_point now, std::string& why) {
    const SessionState state = lifecycle_.state();
    if (state == SessionState::hibernated || state == SessionState::hibernating) return true;
    if (state != SessionState::idle) {
        why = "the session is " + this->state() + "; only an idle session hibernates";
        return false;
    }
    if (!governor_) {
        why = "this session has no policy to hibernate under";
        return false;
    }
    if (!io_.can_sleep(why)) return false;
    if (requests_open()) {
        why = std::to_string(pending_.size() + queue_.size()) +
              " request(s) are open at the kernel; the session hibernates once they are answered";
        return false;
    }
    move_to(SessionState::hibernating);
    sleep_started_ = now;
    if (io_.exact_level()) {
        keep_usage();  // its sandbox's figures, while it is there
        // Answered at once here (the time is this turn's) or later (then's).
        auto at_once = std::make_shared<bool>(true);
        io_.checkpoint([this, now, at_once](const std::string* failed, bool awake) {
            const Clock::time_point when = *at_once ? now : Clock::now();
            if (lifecycle_.state() != SessionState::hibernating) return;  // closed meanwhile
            if (failed && awake) return hibernation_failed(when, *failed);
            if (failed) return close(when, "hibernate_failed: " + *failed);
            snapshot_kept(when, {{"level", "exact"}}, nullptr);
        });
        *at_once = false;
        return true;
    }
    send_own(now, false);
    return true;
}

bool SessionCore::resume(Clock::time_point now, std::string& why) {
    switch (lifecycle_.state()) {
        case SessionState::hibernated:
            wake(now);
            return true;
        case SessionState::hibernating:
        case SessionState::resuming:
        case SessionState::idle:
        case SessionState::busy:
            return true;  // awake, or on its way
        default:
            why = "the session is " + state();
            return false;
    }
}

void SessionCore::move_away(Clock::time_point now) {
    if (moving_ || handing_over_ || lifecycle_.ending() || asleep()) return;
    if (!governor_) {
        io_.log(
            "its sandbox's node is being drained, and it has no policy to hibernate under: "
            "it ends with the node's grace");
        return;
    }
    moving_ = true;
    event("moving", "its sandbox's node is being drained");
    io_.log(
        "its sandbox's node is being drained: it hibernates once idle and wakes in a new "
        "sandbox");
    on_tick(now);
}

bool SessionCore::due_to_move() const {
    return moving_ && lifecycle_.state() == SessionState::idle && !requests_open();
}

void SessionCore::send_own(Clock::time_point now, bool restore) {
    const std::string& path =
        restore ? options_.snapshot_restore_path : options_.snapshot_save_path;
    OwnRequest own;
    own.restore = restore;
    own.started = now;
    own.deadline = now + options_.snapshot_timeout;
    if (!restore) io_.saving_snapshot();
    own.msg_id = io_.send_to_kernel(Channel::shell, "execute_request",
                                    restore ? snapshot_request("restore", path, placing_bytes_)
                                            : snapshot_request("save", path));
    // Its busy/idle and any output are the relay's own: no client sees them.
    probe_ids_.insert(own.msg_id);
    own_ = std::move(own);
}

void SessionCore::on_own_reply(Clock::time_point now, InboundMessage& msg) {
    const OwnRequest own = std::move(*own_);
    own_.reset();
    const auto content = msg.parsed_content(options_.max_json_depth);
    const bool ok = content && json_string(*content, "status") == "ok";
    if (!own.restore) {
        if (!ok) {
            hibernation_failed(now, "the kernel could not save its snapshot: " +
                                        (content ? error_of(*content) : "no reply content"));
            return;
        }
        const json report = report_of(*content);
        // Answered at once here (the time is this turn's) or later (then's).
        auto at_once = std::make_shared<bool>(true);
        io_.fetch_snapshot([this, report, now, at_once](const std::string* failed) {
            snapshot_fetched(*at_once ? now : Clock::now(), report, failed);
        });
        *at_once = false;
        return;
    }
    if (placing_bytes_) {
        restore_waiting_ = content;  // awake once the opening ended well
        return;
    }
    restored(now, content);
}

void SessionCore::placing_snapshot(std::uint64_t bytes) {
    placing_bytes_ = bytes;
    restore_waiting_.reset();
}

void SessionCore::snapshot_placed(Clock::time_point now, const std::string* failed) {
    if (!placing_bytes_) return;
    placing_bytes_.reset();
    if (lifecycle_.state() != SessionState::resuming) return;  // closed meanwhile
    if (failed) {
        restore_waiting_.reset();
        close(now, "resume_failed: " + *failed);
        return;
    }
    if (!restore_waiting_) return;  // the kernel's reply comes later
    const auto content = std::move(*restore_waiting_);
    restore_waiting_.reset();
    restored(now, content);
}

void SessionCore::restored(Clock::time_point now, const std::optional<json>& content) {
    const bool ok = content && json_string(*content, "status") == "ok";
    if (!ok) {
        close(now, "resume_failed: " + (content ? error_of(*content) : "no reply content"));
        return;
    }
    const json report = report_of(*content);
    const double ms = ms_between(sleep_started_, now);
    resumed_ = json{{"resumed_ms", ms}, {"lost", report.value("lost", json::array())}};
    lost_to_tell_ = (*resumed_)["lost"];
    move_to(SessionState::idle);
    idle_since_ = now;
    if (exact_wake_) {
        event("resumed", fmt::format("{:.0f} ms, the whole sandbox restored (exact level)", ms));
    } else {
        event("resumed", fmt::format("{:.0f} ms, {} value(s) restored, {} lost{}", ms,
                                     report.value("saved", 0), (*resumed_)["lost"].size(),
                                     kernel_steps(report)));
    }
    replay_asleep(now);
}

void SessionCore::snapshot_fetched(Clock::time_point now, const json& report,
                                   const std::string* failed) {
    if (lifecycle_.state() != SessionState::hibernating) return;  // closed meanwhile
    if (failed) {
        hibernation_failed(now, *failed);
        return;
    }
    keep_usage();
    // Answered at once here (the time is this turn's) or later (then's).
    auto at_once = std::make_shared<bool>(true);
    io_.put_to_sleep(report, [this, report, now, at_once](const std::string* failed) {
        snapshot_kept(*at_once ? now : Clock::now(), report, failed);
    });
    *at_once = false;
}

void SessionCore::snapshot_kept(Clock::time_point now, const json& report,
                                const std::string* failed) {
    if (lifecycle_.state() != SessionState::hibernating) return;  // closed meanwhile
    if (failed) {
        hibernation_failed(now, *failed);
        return;
    }
    cpu_ms_earlier_sandboxes_ = cpu_ms_total_;
    move_to(SessionState::hibernated);
    const auto lost = report.value("lost", json::array());
    if (report.value("level", "") == "exact") {
        event("hibernated", fmt::format("{:.0f} ms, the whole sandbox checkpointed (exact level)",
                                        ms_between(sleep_started_, now)));
    } else {
        event("hibernated",
              fmt::format("{:.0f} ms, snapshot {} bytes, {} value(s) kept, {} lost{}",
                          ms_between(sleep_started_, now), report.value("bytes", 0),
                          report.value("saved", 0), lost.size(), kernel_steps(report)));
    }
    // Moving (move_away), or a request came while it was being saved (not
    // while handing over: the next server answers it).
    const bool moving = std::exchange(moving_, false);
    if ((moving || !asleep_.empty()) && !handing_over_) wake(now);
}

void SessionCore::hibernation_failed(Clock::time_point now, const std::string& why) {
    std::string retry;
    if (governor_) {
        const auto wait = governor_->hibernation_declined(now);
        retry = fmt::format("; tried again in {} s unless a client comes first",
                            std::chrono::duration_cast<std::chrono::seconds>(wait).count());
    }
    io_.snapshot_unsaved();
    io_.log("hibernation failed: " + why + retry);
    if (std::exchange(moving_, false)) io_.log("it cannot move off its drained node");
    if (handing_over_) handover_failed_ = true;
    event("hibernate_failed", why);
    move_to(SessionState::idle);
    replay_asleep(now);
}

void SessionCore::wake(Clock::time_point now) {
    move_to(SessionState::resuming);
    sleep_started_ = now;
    exact_wake_ = io_.snapshot_exact();
    placing_bytes_.reset();
    restore_waiting_.reset();
    io_.wake();
}

void SessionCore::replay_asleep(Clock::time_point now) {
    auto waiting = std::move(asleep_);
    asleep_.clear();
    for (auto& request : waiting) {
        if (lifecycle_.ending()) break;
        dispatch_request(now, request.channel, std::move(request.message));
    }
}

void SessionCore::hand_over(Clock::time_point now, bool hibernate) {
    if (handing_over_ || lifecycle_.ending()) return;
    handing_over_ = true;
    handover_hibernates_ = hibernate;
    settle_handover(now);
}

bool SessionCore::nothing_open() const {
    return !execution_ && queue_.empty() && !held_reply_ && pending_.empty() && !shutdown_request_;
}

void SessionCore::settle_handover(Clock::time_point now) {
    if (!handing_over_ || handover_failed_ || lifecycle_.state() != SessionState::idle) return;
    if (!handover_hibernates_) return;  // left running: handover_settled() says when
    std::string why;
    if (!governor_ || !io_.can_sleep(why)) {
        handover_failed_ = true;
        if (!governor_) why = "this session has no policy to hibernate under";
        io_.log("cannot hand over: " + why);
        event("hibernate_failed", why);
        return;
    }
    if (!nothing_open()) {
        settle_at_ = now + std::chrono::milliseconds(50);  // a reply still to come: look again
        return;
    }
    event("hibernating", "the server hands its sessions over");
    hibernate(now, why);
}

bool SessionCore::handover_settled() const {
    if (handing_over_ && !handover_hibernates_) {
        return lifecycle_.ending() || (lifecycle_.state() == SessionState::idle && nothing_open());
    }
    return lifecycle_.ending() || lifecycle_.state() == SessionState::hibernated ||
           handover_failed_;
}

HandoverState SessionCore::handover_state(Clock::time_point now) const {
    HandoverState state;
    if (governor_) {
        state.executions = governor_->executions();
        state.age_s = governor_->age_s(now);
        state.idle_s = governor_->idle_s(now);
    }
    state.cpu_ms = cpu_ms_total_;
    state.memory_peak_bytes = memory_peak_bytes_;
    state.network_bytes = network_bytes_;
    for (const auto& waiting : asleep_) state.requests.push_back(as_frames(waiting));
    return state;
}

HandoverState::Request SessionCore::as_frames(const QueuedRequest& queued) {
    HandoverState::Request request;
    request.channel = queued.channel;
    for (const auto& frame : queued.message.frames) request.frames.emplace_back(frame.view());
    return request;
}

void SessionCore::take_over(Clock::time_point now, const HandoverState& state) {
    if (lifecycle_.state() != SessionState::starting) return;
    move_to(SessionState::hibernated);
    if (governor_) governor_->carry_on(now, state.executions, state.age_s, state.idle_s);
    cpu_ms_total_ = cpu_ms_earlier_sandboxes_ = state.cpu_ms;
    memory_peak_bytes_ = state.memory_peak_bytes;
    network_bytes_ = state.network_bytes;
    idle_since_ = now;
}

void SessionCore::adopt(Clock::time_point now, const HandoverState& state) {
    if (lifecycle_.state() != SessionState::starting) return;
    move_to(SessionState::adopting);
    if (governor_) governor_->carry_on(now, state.executions, state.age_s, state.idle_s);
    network_bytes_ = state.network_bytes;  // CPU and memory: the sandbox's cgroup goes on
    idle_since_ = now;
    for (const auto& open : state.in_kernel) {
        const std::string id = json_string(open.header, "msg_id");
        if (id.empty()) continue;
        carried_[id] = {open.channel, open.identities, open.msg_type, open.header};
        remember_parent(id);  // its outputs pass, the status after its reply too
    }
    answered_before_.insert(state.answered.begin(), state.answered.end());
}

HandoverState SessionCore::in_flight() const {
    HandoverState state;
    for (const auto& [id, request] : pending_) {
        state.in_kernel.push_back(
            {request.channel, request.identities, request.msg_type, request.header});
    }
    for (const auto& [id, request] : carried_) {
        state.in_kernel.push_back(
            {request.channel, request.identities, request.msg_type, request.header});
    }
    for (const auto* waiting : {&queue_, &asleep_}) {
        for (const auto& queued : *waiting) state.requests.push_back(as_frames(queued));
    }
    state.answered.assign(answered_before_.begin(), answered_before_.end());
    state.answered.insert(state.answered.end(), answered_.begin(), answered_.end());
    return state;
}

void SessionCore::settle_adoption(Clock::time_point now) {
    if (lifecycle_.state() != SessionState::adopting || !adopt_settle_until_) return;
    if (now < *adopt_settle_until_) {
        // Its clients back: a subscriber on iopub, and on shell each client
        // a reply is owed to. Else a look again in 20 ms, up to the bound.
        const auto back = [this](const PendingRequest& request) {
            return request.identities.empty() || io_.client_connected(request.identities[0]);
        };
        // The requests that waited (a planned restart's, carried in the row)
        // are answered to their senders too.
        const auto sender_back = [this](const QueuedRequest& queued) {
            const auto identities = queued.message.identities();
            return identities.empty() || io_.client_connected(identities[0]);
        };
        const bool all_back = io_.clients_listening() &&
                              std::all_of(carried_replies_.begin(), carried_replies_.end(),
                                          [&](const auto& r) { return back(r.first); }) &&
                              std::all_of(carried_.begin(), carried_.end(),
                                          [&](const auto& c) { return back(c.second); }) &&
                              std::all_of(asleep_.begin(), asleep_.end(), sender_back);
        if (!all_back) {
            adopt_look_at_ = std::min(*adopt_settle_until_, now + kAdoptLook);
            return;
        }
    }
    adopt_settle_until_.reset();
    move_to(SessionState::idle);
    auto held = std::move(carried_replies_);
    carried_replies_.clear();
    for (auto& [request, reply] : held) {
        const Channel channel = request.channel;
        carried_[reply.parent_id] = std::move(request);
        reply_carried(channel, reply);
    }
    answer_lost_carried();
    publish_owed_idles();
    replay_asleep(now);
}

void SessionCore::mark_resumed(json& metadata) {
    if (!resumed_) return;
    if (!metadata["cellblock"].is_object()) metadata["cellblock"] = json::object();
    metadata["cellblock"]["resumed_ms"] = (*resumed_)["resumed_ms"];
    metadata["cellblock"]["lost"] = (*resumed_)["lost"];
    resumed_.reset();
}

void SessionCore::tell_lost(const json& parent) {
    if (lost_to_tell_.empty()) return;
    // Named on stderr too, in the first cell after the resume, where a
    // person reads it.
    std::string text = "cellblock: the session hibernated; not restored:\n";
    for (const auto& item : lost_to_tell_) {
        if (item.is_array() && item.size() == 2 && item[0].is_string() && item[1].is_string()) {
            text += "  " + item[0].get<std::string>() + ": " + item[1].get<std::string>() + "\n";
        }
    }
    lost_to_tell_ = json::array();
    publish(parent, "stream", {{"name", "stderr"}, {"text", text}});
}

void SessionCore::keep_usage() {
    // The registry keeps the session's figures: each sandbox's whole life
    // since its hand-out, work between executions included, summed over the
    // sandboxes a hibernating session had.
    const SandboxUsage last = io_.kernel_usage();
    memory_peak_bytes_ = std::max(memory_peak_bytes_, last.memory_peak_bytes);
    cpu_ms_total_ = std::max(
        cpu_ms_total_, cpu_ms_earlier_sandboxes_ +
                           (last.cpu_ns - std::min(last.cpu_ns, cpu_ns_at_attach_)) / 1000000);
}

}  // namespace cellblock
