#include "session_proxy.hpp"

#include <spdlog/spdlog.h>

namespace cellblock {
using nlohmann::json;

namespace {

constexpr std::size_t kRecentParents = 256;
// How long an execute_reply waits for its idle status. Only a kernel that
// never sends idle (a hostile one) waits this long, and only for its own reply.
constexpr auto kReplyHoldLimit = std::chrono::seconds(30);
constexpr auto kKernelExitDrain = std::chrono::milliseconds(200);
constexpr std::size_t kMaxHeartbeatFrames = 4;
constexpr std::size_t kMaxHeartbeatBytes = 4096;

zmq::socket_t make_socket(zmq::context_t& ctx, zmq::socket_type type, int max_frame_bytes,
                          int linger_ms) {
    zmq::socket_t s(ctx, type);
    s.set(zmq::sockopt::linger, linger_ms);
    s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_frame_bytes));
    return s;
}

std::string json_string(const json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string reply_type_for(const std::string& request_type) {
    return request_type.substr(0, request_type.size() - std::string_view("_request").size()) +
           "_reply";
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
        content["implementation_version"] = "0.1.0";
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

double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// Binds a channel; port 0 means any free port, read back from the socket.
int bind_channel(zmq::socket_t& socket, const ConnectionInfo& info, Channel channel) {
    if (info.transport == "tcp" && info.port(channel) == 0) {
        socket.bind("tcp://" + info.ip + ":*");
        const std::string endpoint = socket.get(zmq::sockopt::last_endpoint);
        return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
    }
    socket.bind(info.endpoint(channel));
    return info.port(channel);
}

}  // namespace

SessionProxy::SessionProxy(zmq::context_t& context, std::string session_id,
                           const ConnectionInfo& outer, ProxyOptions options)
    : session_id_(std::move(session_id)),
      server_session_(make_uuid()),
      options_(std::move(options)),
      outer_(outer),
      outer_signer_(outer.key, outer.signature_scheme),
      // libzmq hands over a multipart only once all its frames arrived and caps
      // frames, not messages: a small frame cap on the client's side bounds
      // what one frame from a peer without the key can make the server hold.
      outer_shell_(
          make_socket(context, zmq::socket_type::router, options_.max_client_frame_bytes, 1000)),
      outer_control_(
          make_socket(context, zmq::socket_type::router, options_.max_client_frame_bytes, 1000)),
      outer_stdin_(
          make_socket(context, zmq::socket_type::router, options_.max_client_frame_bytes, 1000)),
      outer_iopub_(
          make_socket(context, zmq::socket_type::pub, options_.max_client_frame_bytes, 1000)),
      outer_hb_(make_socket(context, zmq::socket_type::router, 1024, 0)) {
    // A kernel's single large output (a 50 MB print) must reach output shaping
    // to be cut with a marker, not be dropped whole: the JSON frame cap for the
    // kernel's side is the socket's frame cap.
    options_.inner_limits.max_json_frame_bytes = static_cast<std::size_t>(options_.max_frame_bytes);
    // A client's JSON frame (code, comm data) is refused and logged above 8 MB,
    // under the client socket's frame cap, so the refusal is cellblock's own.
    options_.outer_limits.max_json_frame_bytes =
        std::min<std::size_t>(options_.outer_limits.max_json_frame_bytes,
                              static_cast<std::size_t>(options_.max_client_frame_bytes) / 2);
    for (auto* s : {&outer_shell_, &outer_control_, &outer_stdin_, &outer_hb_}) {
        s->set(zmq::sockopt::router_handover, 1);
    }
    outer_.shell_port = bind_channel(outer_shell_, outer_, Channel::shell);
    outer_.control_port = bind_channel(outer_control_, outer_, Channel::control);
    outer_.stdin_port = bind_channel(outer_stdin_, outer_, Channel::stdin_);
    outer_.iopub_port = bind_channel(outer_iopub_, outer_, Channel::iopub);
    outer_.hb_port = bind_channel(outer_hb_, outer_, Channel::hb);
    if (options_.policy && options_.limits) {
        governor_.emplace(*options_.limits, *options_.policy, Clock::now());
    }
}

SessionProxy::~SessionProxy() {
    if (sandbox_) sandbox_->destroy();
}

void SessionProxy::attach(std::unique_ptr<Sandbox> sandbox, InnerChannels channels) {
    sandbox_ = std::move(sandbox);
    const ConnectionInfo& inner = sandbox_->inner_connection();
    inner_signer_ = Signer(inner.key, inner.signature_scheme);
    inner_shell_ = std::move(channels.shell);
    inner_control_ = std::move(channels.control);
    inner_stdin_ = std::move(channels.stdin_);
    inner_iopub_ = std::move(channels.iopub);
    inner_hb_ = std::move(channels.hb);
    probe_ids_.insert(channels.probe_msg_ids.begin(), channels.probe_msg_ids.end());
    cpu_ns_at_attach_ = sandbox_->usage().cpu_ns;
    if (governor_) governor_->on_client_request(Clock::now());
}

std::string SessionProxy::state() const {
    if (closed_) return "closed";
    if (!sandbox_) return "starting";
    return execution_ ? "busy" : "idle";
}

void SessionProxy::add_poll_items(std::vector<zmq::pollitem_t>& items) {
    auto add = [&](zmq::socket_t& s) {
        if (s) {
            items.push_back({s.handle(), 0, ZMQ_POLLIN, 0});
        } else {
            items.push_back({nullptr, -1, 0, 0});  // closed with the session
        }
    };
    // Inner sockets first so that a kernel's last replies are read before its exit is seen.
    add(inner_shell_);
    add(inner_control_);
    add(inner_stdin_);
    add(inner_iopub_);
    add(inner_hb_);
    add(outer_shell_);
    add(outer_control_);
    add(outer_stdin_);
    add(outer_hb_);
    const int fd = sandbox_ && !closed_ && !sandbox_->exited() ? sandbox_->lifeline_fd() : -1;
    items.push_back({nullptr, fd, static_cast<short>(fd >= 0 ? ZMQ_POLLIN : 0), 0});
}

void SessionProxy::handle(const zmq::pollitem_t* items) {
    // Any handler may close the session (and its sockets): check before each.
    auto ready = [&](std::size_t i) { return (items[i].revents & ZMQ_POLLIN) != 0; };
    auto live = [&] { return sandbox_ && !closed_; };
    if (ready(0) && live()) on_inner_reply(Channel::shell);
    if (ready(1) && live()) on_inner_reply(Channel::control);
    if (ready(2) && live()) on_inner_stdin();
    if (ready(3) && live()) on_inner_iopub();
    if (ready(4) && live()) on_inner_heartbeat();
    if (ready(5)) on_outer_request(Channel::shell);
    if (ready(6)) on_outer_request(Channel::control);
    if (ready(7)) on_outer_stdin();
    if (ready(8)) on_outer_heartbeat();
    if ((items[9].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) && live()) on_lifeline();
}

zmq::socket_t& SessionProxy::outer_socket(Channel channel) {
    switch (channel) {
        case Channel::shell:
            return outer_shell_;
        case Channel::control:
            return outer_control_;
        case Channel::stdin_:
            return outer_stdin_;
        case Channel::iopub:
            return outer_iopub_;
        case Channel::hb:
            return outer_hb_;
    }
    return outer_shell_;
}

zmq::socket_t& SessionProxy::inner_socket(Channel channel) {
    switch (channel) {
        case Channel::shell:
            return inner_shell_;
        case Channel::control:
            return inner_control_;
        case Channel::stdin_:
            return inner_stdin_;
        case Channel::iopub:
            return inner_iopub_;
        case Channel::hb:
            return inner_hb_;
    }
    return inner_shell_;
}

void SessionProxy::reject(const char* channel, std::string_view identity, const std::string& why) {
    spdlog::warn("session {} {}: rejected message from {}: {}", session_id_, channel,
                 identity_text(identity), why);
}

void SessionProxy::notify_state(const char* state) {
    if (options_.observer) options_.observer->on_state(session_id_, state);
}

void SessionProxy::remember_parent(const std::string& msg_id) {
    if (recent_.insert(msg_id).second) {
        recent_order_.push_back(msg_id);
        if (recent_order_.size() > kRecentParents) {
            recent_.erase(recent_order_.front());
            free_passes_.erase(recent_order_.front());
            recent_order_.pop_front();
        }
    }
}

bool SessionProxy::known_parent(std::string_view msg_id) const {
    return !msg_id.empty() && recent_.count(std::string(msg_id)) > 0;
}

void SessionProxy::on_outer_request(Channel channel) {
    const char* name = channel_name(channel);
    if (!recv_multipart(outer_socket(channel), scratch_, options_.outer_limits.max_frames)) return;
    const auto views = scratch_.views();
    const std::string_view sender = views.empty() ? std::string_view() : views[0];
    if (scratch_.dropped_frames > 0) {
        reject(name, sender, "too many frames");
        return;
    }
    const WireCheck check = check_wire(views, outer_signer_, &replay_, options_.outer_limits);
    if (!check.ok) {
        reject(name, sender, check.error);
        return;
    }
    const WireLayout& at = check.layout;
    json header, metadata, content;
    for (std::size_t i = at.header(); i <= at.content(); ++i) {
        auto parsed = parse_json_frame(views[i], options_.outer_limits.max_json_depth);
        if (!parsed || !parsed->is_object()) {
            reject(name, sender,
                   "frame " + std::to_string(i - at.delimiter) + " is not a JSON object");
            return;
        }
        if (i == at.header()) header = std::move(*parsed);
        if (i == at.metadata()) metadata = std::move(*parsed);
        if (i == at.content()) content = std::move(*parsed);
    }
    const std::string msg_id = json_string(header, "msg_id");
    const std::string msg_type = json_string(header, "msg_type");
    if (msg_id.empty() || msg_type.empty()) {
        reject(name, sender, "header lacks msg_id or msg_type");
        return;
    }
    if (!ends_with(msg_type, "_request")) {
        reject(name, sender, "'" + msg_type + "' is not a request");
        return;
    }
    dispatch_request(channel, scratch_.frames, at, header, metadata, content);
}

void SessionProxy::dispatch_request(Channel channel, std::vector<zmq::message_t>& frames,
                                    const WireLayout& at, const json& header, const json& metadata,
                                    const json& content) {
    const char* name = channel_name(channel);
    auto view = [&](std::size_t i) {
        return std::string_view(static_cast<const char*>(frames[i].data()), frames[i].size());
    };
    const std::string msg_id = json_string(header, "msg_id");
    const std::string msg_type = json_string(header, "msg_type");
    PendingRequest request{channel, {}, msg_type, std::string(view(at.header()))};
    for (std::size_t i = 0; i < at.delimiter; ++i) request.identities.emplace_back(view(i));

    if (closed_ || !sandbox_) {
        refuse(request, "SessionClosed",
               closed_ ? "this session is closed: " + close_reason_ : "this session is starting");
        return;
    }
    const auto now = Clock::now();
    if (governor_) governor_->on_client_request(now);
    if (channel == Channel::control && msg_type == "interrupt_request") {
        answer_interrupt(request);
        return;
    }
    if (msg_type == "execute_request" && governor_) {
        if (execution_) {
            // The kernel runs one execution at a time anyway; queueing here
            // keeps the policy's clock per execution.
            if (queue_.size() >= kMaxQueuedExecutes) {
                refuse(
                    request, "SessionBusy",
                    "more than " + std::to_string(kMaxQueuedExecutes) + " executions are queued");
                return;
            }
            queue_.push_back({channel, std::move(frames), at, header, metadata, content});
            return;
        }
        std::optional<double> timeout;
        if (auto cb = metadata.find("cellblock"); cb != metadata.end() && cb->is_object()) {
            if (auto t = cb->find("timeout_s"); t != cb->end()) {
                if (!t->is_number()) {
                    refuse(request, "InvalidLimits",
                           "metadata.cellblock.timeout_s must be a number");
                    return;
                }
                timeout = t->get<double>();
            }
        }
        const auto decision = governor_->on_execute_request(now, timeout);
        if (!decision.forward) {
            refuse(request, decision.ename, decision.evalue);
            if (options_.observer) {
                // Refused executions use no count; the audit keeps them as events.
                options_.observer->on_event(session_id_, "refused",
                                            msg_id + " " + decision.ename + ": " + decision.evalue);
            }
            return;
        }
        Execution e;
        e.msg_id = msg_id;
        e.code = json_string(content, "code");
        e.count = governor_->executions();
        e.started_at = unix_now();
        e.started = now;
        e.cpu_ns_at_start = sandbox_->usage().cpu_ns;
        e.deadline = decision.deadline;
        e.timeout_s = std::chrono::duration<double>(decision.deadline - now).count();
        execution_ = std::move(e);
        background_bytes_ = 0;
        background_marker_sent_ = false;
        notify_state("busy");
    }
    if (pending_.size() >= kMaxPendingRequests) {
        refuse(
            request, "SessionBusy",
            std::to_string(kMaxPendingRequests) + " requests are waiting for the kernel already");
        return;
    }
    if (msg_type == "shutdown_request") {
        shutdown_deadline_ = now + options_.shutdown_grace;
        shutdown_request_ = request;
    }
    remember_parent(msg_id);
    pending_[msg_id] = std::move(request);

    std::vector<zmq::message_t> out;
    out.reserve(frames.size() - at.delimiter);
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(inner_signer_.sign(view(at.header()), view(at.parent()),
                                              view(at.metadata()), view(at.content()))));
    for (std::size_t i = at.header(); i < frames.size(); ++i) out.push_back(std::move(frames[i]));
    if (!send_multipart(inner_socket(channel), out)) {
        spdlog::warn("session {} {}: kernel queue full; request {} dropped", session_id_, name,
                     msg_id);
    }
}

void SessionProxy::on_outer_stdin() {
    if (!outer_stdin_) return;  // closed with the session in this same turn
    if (!recv_multipart(outer_stdin_, scratch_, options_.outer_limits.max_frames)) return;
    const auto views = scratch_.views();
    const std::string_view sender = views.empty() ? std::string_view() : views[0];
    if (scratch_.dropped_frames > 0) {
        reject("stdin", sender, "too many frames");
        return;
    }
    const WireCheck check = check_wire(views, outer_signer_, &replay_, options_.outer_limits);
    if (!check.ok) {
        reject("stdin", sender, check.error);
        return;
    }
    const WireLayout& at = check.layout;
    for (std::size_t i = at.header(); i <= at.content(); ++i) {
        auto parsed = parse_json_frame(views[i], options_.outer_limits.max_json_depth);
        if (!parsed || !parsed->is_object()) {
            reject("stdin", sender,
                   "frame " + std::to_string(i - at.delimiter) + " is not a JSON object");
            return;
        }
    }
    if (!sandbox_ || closed_) return;
    std::vector<zmq::message_t> out;
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(inner_signer_.sign(views[at.header()], views[at.parent()],
                                              views[at.metadata()], views[at.content()])));
    for (std::size_t i = at.header(); i < scratch_.frames.size(); ++i) {
        out.push_back(std::move(scratch_.frames[i]));
    }
    send_multipart(inner_stdin_, out);
}

void SessionProxy::on_outer_heartbeat() {
    if (!outer_hb_) return;  // closed with the session in this same turn
    if (!recv_multipart(outer_hb_, scratch_, kMaxHeartbeatFrames)) return;
    if (scratch_.dropped_frames > 0 || scratch_.total_bytes > kMaxHeartbeatBytes) return;
    if (!sandbox_ || closed_) return;  // no kernel, no heartbeat
    send_multipart(inner_hb_, scratch_.frames);
}

void SessionProxy::on_inner_heartbeat() {
    if (!recv_multipart(inner_hb_, scratch_, kMaxHeartbeatFrames)) return;
    if (scratch_.dropped_frames > 0 || scratch_.total_bytes > kMaxHeartbeatBytes ||
        scratch_.frames.size() < 2) {
        return;
    }
    send_multipart(outer_hb_, scratch_.frames);
}

void SessionProxy::forward_to_outer(zmq::socket_t& socket,
                                    const std::vector<std::string>* identities,
                                    std::vector<zmq::message_t>& frames, const WireLayout& at,
                                    const std::string* new_metadata,
                                    const std::string* new_content) {
    auto view = [&](std::size_t i) {
        return std::string_view(static_cast<const char*>(frames[i].data()), frames[i].size());
    };
    const std::string_view metadata =
        new_metadata ? std::string_view(*new_metadata) : view(at.metadata());
    const std::string_view content =
        new_content ? std::string_view(*new_content) : view(at.content());
    std::vector<zmq::message_t> out;
    out.reserve(frames.size() + (identities ? identities->size() : 0));
    if (identities) {
        for (const auto& id : *identities) out.push_back(to_frame(id));
    } else {
        for (std::size_t i = 0; i < at.delimiter; ++i) out.push_back(std::move(frames[i]));
    }
    out.push_back(to_frame(kDelimiter));
    out.push_back(
        to_frame(outer_signer_.sign(view(at.header()), view(at.parent()), metadata, content)));
    out.push_back(std::move(frames[at.header()]));
    out.push_back(std::move(frames[at.parent()]));
    out.push_back(new_metadata ? to_frame(*new_metadata) : std::move(frames[at.metadata()]));
    out.push_back(new_content ? to_frame(*new_content) : std::move(frames[at.content()]));
    for (std::size_t i = at.first_buffer(); i < frames.size(); ++i)
        out.push_back(std::move(frames[i]));
    send_multipart(socket, out);
}

void SessionProxy::release_held_reply() {
    if (!held_reply_) return;
    HeldReply held = std::move(*held_reply_);
    held_reply_.reset();
    auto view = [&](std::size_t i) {
        return std::string_view(static_cast<const char*>(held.frames[i].data()),
                                held.frames[i].size());
    };
    const WireLayout& at = held.layout;
    // The budget an agent needs rides on the reply: metadata.cellblock.
    auto metadata = parse_json_frame(view(at.metadata()), options_.inner_limits.max_json_depth);
    const auto content = parse_json_frame(view(at.content()), options_.inner_limits.max_json_depth);
    json md = metadata && metadata->is_object() ? std::move(*metadata) : json::object();
    SandboxUsage usage;
    if (sandbox_) usage = sandbox_->usage();
    const std::uint64_t cpu_ms =
        (usage.cpu_ns - std::min(usage.cpu_ns, execution_->cpu_ns_at_start)) / 1000000;
    md["cellblock"] = governor_->on_execute_reply(Clock::now(), cpu_ms, usage.memory_peak_bytes);
    memory_peak_bytes_ = std::max(memory_peak_bytes_, usage.memory_peak_bytes);
    cpu_ms_total_ += cpu_ms;
    const std::string new_metadata = md.dump();
    const bool content_ok = content && content->is_object();
    const std::string status = content_ok ? json_string(*content, "status") : "";
    const std::string ename = content_ok ? json_string(*content, "ename") : "";
    forward_to_outer(outer_socket(held.request.channel), &held.request.identities, held.frames, at,
                     &new_metadata, nullptr);
    if (options_.observer) {
        ExecutionRecord record = execution_record(status.empty() ? "unknown" : status, ename);
        record.cpu_ms = cpu_ms;
        record.memory_peak_bytes = usage.memory_peak_bytes;
        options_.observer->on_execution(record);
    }
    last_execution_id_ = execution_->msg_id;
    execution_.reset();
    idle_since_ = Clock::now();
    notify_state("idle");
    drain_queue(status == "error");
}

void SessionProxy::drain_queue(bool previous_failed) {
    while (!queue_.empty() && !execution_ && !closed_) {
        QueuedRequest next = std::move(queue_.front());
        queue_.pop_front();
        const bool stop_on_error =
            !next.content.contains("stop_on_error") || next.content["stop_on_error"] != false;
        if (previous_failed && stop_on_error) {
            // As the kernel does with requests queued behind an error.
            PendingRequest request{next.channel, {}, "execute_request", next.header.dump()};
            for (std::size_t i = 0; i < next.layout.delimiter; ++i) {
                request.identities.emplace_back(static_cast<const char*>(next.frames[i].data()),
                                                next.frames[i].size());
            }
            const json parent = next.header;
            publish_status(parent, "busy");
            send_reply(request, "execute_reply",
                       {{"status", "aborted"},
                        {"execution_count", governor_ ? governor_->executions() : 0}});
            publish_status(parent, "idle");
            continue;
        }
        dispatch_request(next.channel, next.frames, next.layout, next.header, next.metadata,
                         next.content);
    }
}

void SessionProxy::on_inner_reply(Channel channel) {
    const std::string where = std::string("kernel ") + channel_name(channel);
    if (!recv_multipart(inner_socket(channel), scratch_, options_.inner_limits.max_frames)) return;
    const auto views = scratch_.views();
    if (scratch_.dropped_frames > 0) {
        reject(where.c_str(), "", "too many frames");
        return;
    }
    const WireCheck check = check_wire(views, inner_signer_, nullptr, options_.inner_limits);
    if (!check.ok) {
        reject(where.c_str(), "", check.error);
        return;
    }
    const WireLayout& at = check.layout;
    const auto parent = parse_json_frame(views[at.parent()], options_.inner_limits.max_json_depth);
    const auto header = parse_json_frame(views[at.header()], options_.inner_limits.max_json_depth);
    if (!parent || !header || !parent->is_object() || !header->is_object()) {
        reject(where.c_str(), "", "header or parent is not a JSON object");
        return;
    }
    const std::string parent_id = json_string(*parent, "msg_id");
    auto it = pending_.find(parent_id);
    if (it == pending_.end() || it->second.channel != channel) {
        reject(where.c_str(), "", "reply to a request that is not open: '" + parent_id + "'");
        return;
    }
    const std::string msg_type = json_string(*header, "msg_type");
    if (msg_type != reply_type_for(it->second.msg_type)) {
        reject(where.c_str(), "", "'" + msg_type + "' does not answer " + it->second.msg_type);
        return;
    }
    PendingRequest request = std::move(it->second);
    pending_.erase(it);

    if (execution_ && execution_->msg_id == parent_id && governor_) {
        held_reply_ = HeldReply{std::move(request), std::move(scratch_.frames), at,
                                Clock::now() + kReplyHoldLimit};
        scratch_.frames.clear();
        if (execution_->idle_seen) release_held_reply();
        return;
    }
    forward_to_outer(outer_socket(channel), &request.identities, scratch_.frames, at, nullptr,
                     nullptr);

    if (request.msg_type == "shutdown_request") {
        shutdown_request_.reset();
        close("shutdown requested by the client");
    }
}

void SessionProxy::on_inner_iopub() {
    if (!recv_multipart(inner_iopub_, scratch_, options_.inner_limits.max_frames)) return;
    const auto views = scratch_.views();
    if (scratch_.dropped_frames > 0) {
        reject("kernel iopub", "", "too many frames");
        return;
    }
    const WireCheck check = check_wire(views, inner_signer_, nullptr, options_.inner_limits);
    if (!check.ok) {
        reject("kernel iopub", "", check.error);
        return;
    }
    const WireLayout& at = check.layout;
    const auto parent = parse_json_frame(views[at.parent()], options_.inner_limits.max_json_depth);
    if (!parent || !parent->is_object()) {
        reject("kernel iopub", "", "parent is not a JSON object");
        return;
    }
    const std::string parent_id = json_string(*parent, "msg_id");
    // The kernel's own "starting" status, and the readiness probe's late
    // statuses: no client asked for them.
    if (parent_id.empty() || probe_ids_.count(parent_id)) return;
    if (!known_parent(parent_id)) {
        reject("kernel iopub", "", "parent is not a request of this session: '" + parent_id + "'");
        return;
    }
    if (!governor_) {
        forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
        return;
    }
    const bool late_output_of_last = !execution_ && parent_id == last_execution_id_;
    if ((!execution_ || execution_->msg_id != parent_id) && !late_output_of_last) {
        // Output no running execution accounts for: status and other
        // bookkeeping pass, everything else shares one capped budget.
        const auto header =
            parse_json_frame(views[at.header()], options_.inner_limits.max_json_depth);
        const std::string type =
            header && header->is_object() ? json_string(*header, "msg_type") : "";
        constexpr std::size_t kFreePassBytes = 2048;
        constexpr int kFreePassesPerRequest = 4;  // busy, idle, execute_input, a clear_output
        if ((type == "status" || type == "execute_input" || type == "clear_output") &&
            scratch_.total_bytes <= kFreePassBytes &&
            free_passes_[parent_id] < kFreePassesPerRequest) {
            ++free_passes_[parent_id];
            forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
            return;
        }
        const auto cap = static_cast<std::uint64_t>(governor_->limits().output_bytes);
        if (background_bytes_ + scratch_.total_bytes <= cap) {
            background_bytes_ += scratch_.total_bytes;
            forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
            return;
        }
        if (!background_marker_sent_) {
            background_marker_sent_ = true;
            spdlog::info(
                "session {}: background output past {} bytes; dropping until the next execution",
                session_id_, cap);
            const auto parent_json =
                parse_json_frame(views[at.parent()], 64).value_or(json::object());
            publish(parent_json, "stream",
                    {{"name", "stderr"},
                     {"text", "\n[cellblock: output outside a running execution passed " +
                                  std::to_string(cap) +
                                  " bytes; more is dropped until the next execution]\n"}});
        }
        return;
    }
    // Output shaping for the running (or, late, the last) execution.
    if (execution_) execution_->output_bytes += scratch_.total_bytes;
    const auto header = parse_json_frame(views[at.header()], options_.inner_limits.max_json_depth);
    const std::string msg_type =
        header && header->is_object() ? json_string(*header, "msg_type") : "";
    if (msg_type == "status") {
        const auto content = parse_json_frame(views[at.content()], 8);
        if (content && content->is_object() && json_string(*content, "execution_state") == "idle") {
            if (held_reply_) {
                release_held_reply();
            } else if (execution_) {
                execution_->idle_seen = true;  // iopub outran shell: the reply goes out on arrival
            }
        }
        forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
        return;
    }
    if (msg_type == "stream") {
        auto content = parse_json_frame(views[at.content()], options_.inner_limits.max_json_depth);
        if (!content || !content->is_object() || !(*content)["text"].is_string()) {
            reject("kernel iopub", "", "stream without text");
            return;
        }
        const std::string& text = (*content)["text"].get_ref<const std::string&>();
        const auto decision = governor_->on_stream(text.size());
        if (decision.keep >= text.size() && !decision.add_marker) {
            forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
            return;
        }
        if (decision.keep == 0 && !decision.add_marker) return;  // dropped, marker already sent
        std::string kept = text.substr(0, utf8_safe_prefix(text, decision.keep));
        if (decision.add_marker) kept += decision.marker;
        (*content)["text"] = kept;
        const std::string new_content = content->dump();
        forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, &new_content);
        return;
    }
    if (options_.policy &&
        scratch_.total_bytes > static_cast<std::size_t>(options_.policy->max_message_bytes) &&
        (msg_type == "display_data" || msg_type == "execute_result" ||
         msg_type == "update_display_data")) {
        json notice = {
            {"data",
             {{"text/plain", "[cellblock: a " + msg_type + " message of " +
                                 std::to_string(scratch_.total_bytes) +
                                 " bytes was replaced: the limit is " +
                                 std::to_string(options_.policy->max_message_bytes) + " bytes]"}}},
            {"metadata", json::object()}};
        if (msg_type == "execute_result") {
            notice["execution_count"] = execution_ ? execution_->count : governor_->executions();
        }
        const std::string new_content = notice.dump();
        // Buffers go too: the notice replaces the whole message.
        scratch_.frames.resize(at.first_buffer());
        forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, &new_content);
        return;
    }
    forward_to_outer(outer_iopub_, nullptr, scratch_.frames, at, nullptr, nullptr);
}

void SessionProxy::on_inner_stdin() {
    if (!recv_multipart(inner_stdin_, scratch_, options_.inner_limits.max_frames)) return;
    const auto views = scratch_.views();
    if (scratch_.dropped_frames > 0) {
        reject("kernel stdin", "", "too many frames");
        return;
    }
    const WireCheck check = check_wire(views, inner_signer_, nullptr, options_.inner_limits);
    if (!check.ok) {
        reject("kernel stdin", "", check.error);
        return;
    }
    const WireLayout& at = check.layout;
    const auto parent = parse_json_frame(views[at.parent()], options_.inner_limits.max_json_depth);
    const std::string parent_id =
        parent && parent->is_object() ? json_string(*parent, "msg_id") : "";
    auto it = pending_.find(parent_id);
    if (it == pending_.end() || it->second.msg_type != "execute_request") {
        reject("kernel stdin", "", "input_request for a request that is not open");
        return;
    }
    // The client's stdin socket shares the identity of its shell socket.
    forward_to_outer(outer_stdin_, &it->second.identities, scratch_.frames, at, nullptr, nullptr);
}

void SessionProxy::on_lifeline() {
    if (!sandbox_ || sandbox_->read_lifeline()) return;
    // The kernel is gone. Replies it sent just before may still be in flight:
    // drain them for a moment before answering what is left.
    if (!shutdown_deadline_ || *shutdown_deadline_ > Clock::now() + kKernelExitDrain) {
        shutdown_deadline_ = Clock::now() + kKernelExitDrain;
    }
}

std::optional<Clock::time_point> SessionProxy::next_deadline() const {
    if (closed_) {
        if (!options_.policy) return std::nullopt;
        return closed_at_ + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(options_.policy->closed_channels_s));
    }
    std::optional<Clock::time_point> next = shutdown_deadline_;
    auto consider = [&](Clock::time_point t) {
        if (!next || t < *next) next = t;
    };
    if (held_reply_) consider(held_reply_->release_by);
    if (execution_ && !held_reply_) {
        consider(execution_->kill_at ? *execution_->kill_at : execution_->deadline);
        if (auto grace_end = governor_->interrupt_deadline()) consider(*grace_end);
    }
    if (governor_) consider(governor_->next_expiry_check(Clock::now()));
    return next;
}

bool SessionProxy::expired(Clock::time_point now) const {
    if (!closed_) return false;
    if (!options_.policy) return true;
    return now - closed_at_ >= std::chrono::duration<double>(options_.policy->closed_channels_s);
}

void SessionProxy::on_timer(Clock::time_point now) {
    if (closed_) return;
    if (shutdown_deadline_ && now >= *shutdown_deadline_) {
        shutdown_deadline_.reset();
        if (shutdown_request_) {
            // The kernel did not answer in time (or died): answer for it.
            PendingRequest request = *shutdown_request_;
            shutdown_request_.reset();
            const auto parsed = parse_json_frame(request.header, 64);
            if (parsed) pending_.erase(json_string(*parsed, "msg_id"));
            send_reply(request, "shutdown_reply", {{"status", "ok"}, {"restart", false}});
            close("shutdown requested by the client");
            return;
        }
        if (sandbox_ && sandbox_->exited()) {
            release_held_reply();
            const bool oom = sandbox_->memory_limit_hit();
            const std::string description = sandbox_->exit_description();
            spdlog::warn("session {}: {}", session_id_, description);
            if (execution_) finish_execution("error", oom ? "MemoryLimitExceeded" : "KernelDied");
            fail_pending(oom ? "MemoryLimitExceeded" : "KernelDied", description);
            close(oom ? "memory_limit: " + description : "kernel_died: " + description);
            return;
        }
    }
    if (held_reply_ && now >= held_reply_->release_by) release_held_reply();
    if (execution_ && !held_reply_ && governor_->interrupt_ignored(now)) {
        const std::string evalue =
            "the execution did not stop within " +
            format_seconds(governor_->limits().interrupt_grace_s) +
            " s of the client's interrupt_request (interrupt_grace_s); the kernel was killed";
        kill_for("InterruptIgnored", evalue, "error", "interrupt_ignored");
        return;
    }
    if (execution_ && !held_reply_) {
        if (!execution_->kill_at && now >= execution_->deadline) {
            spdlog::info("session {}: execution {} passed its {:.0f} s timeout; interrupting",
                         session_id_, execution_->count, execution_->timeout_s);
            if (options_.observer)
                options_.observer->on_event(session_id_, "interrupted", "execution timeout");
            sandbox_->interrupt();
            execution_->kill_at =
                now + std::chrono::duration_cast<Clock::duration>(
                          std::chrono::duration<double>(options_.policy->kill_grace_s));
        } else if (execution_->kill_at && now >= *execution_->kill_at) {
            const std::string evalue =
                "the execution ran past its timeout of " +
                std::to_string(static_cast<int>(execution_->timeout_s)) +
                " s and did not stop when interrupted; the session was killed";
            kill_for("ExecutionTimeout", evalue, "timeout", "exec_timeout");
            return;
        }
    }
    if (governor_) {
        if (auto reason = governor_->expiry(now)) close(*reason);
    }
}

void SessionProxy::kill_for(const std::string& ename, const std::string& evalue,
                            const std::string& execution_status, const std::string& close_reason) {
    spdlog::warn("session {}: {}", session_id_, evalue);
    if (options_.observer)
        options_.observer->on_event(session_id_, "killed", ename + ": " + evalue);
    sandbox_->kill();
    finish_execution(execution_status, ename);
    fail_pending(ename, evalue);
    close(close_reason);
}

ExecutionRecord SessionProxy::execution_record(const std::string& status,
                                               const std::string& ename) const {
    ExecutionRecord record;
    record.session_id = session_id_;
    record.count = execution_->count;
    record.msg_id = execution_->msg_id;
    record.code = options_.audit_code_hash_only ? code_digest(execution_->code) : execution_->code;
    record.status = status;
    record.ename = ename;
    record.started_at = execution_->started_at;
    record.wall_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - execution_->started).count();
    record.output_bytes = execution_->output_bytes;
    record.truncated = governor_ && governor_->truncated();
    return record;
}

void SessionProxy::finish_execution(const std::string& status, const std::string& ename) {
    if (!execution_) return;
    if (options_.observer) {
        ExecutionRecord record = execution_record(status, ename);
        if (sandbox_) record.memory_peak_bytes = sandbox_->usage().memory_peak_bytes;
        options_.observer->on_execution(record);
    }
    execution_.reset();
    idle_since_ = Clock::now();
}

void SessionProxy::publish(const json& parent, const std::string& msg_type, json content) {
    WireMessage msg;
    msg.header = make_header(msg_type, server_session_);
    msg.parent_header = parent;
    msg.content = std::move(content);
    msg.identities.push_back("kernel." + session_id_ + "." + msg_type);
    auto frames = encode(msg, outer_signer_);
    std::vector<zmq::message_t> out;
    for (auto& f : frames) out.push_back(to_frame(f));
    send_multipart(outer_iopub_, out);
}

void SessionProxy::publish_status(const json& parent, const char* state) {
    publish(parent, "status", {{"execution_state", state}});
}

void SessionProxy::send_reply(const PendingRequest& request, const std::string& msg_type,
                              json content) {
    WireMessage msg;
    msg.identities = request.identities;
    msg.header = make_header(msg_type, server_session_);
    auto parent = parse_json_frame(request.header, 64);
    msg.parent_header = parent ? *parent : json::object();
    msg.content = std::move(content);
    auto frames = encode(msg, outer_signer_);
    std::vector<zmq::message_t> out;
    for (auto& f : frames) out.push_back(to_frame(f));
    send_multipart(outer_socket(request.channel), out);
}

void SessionProxy::refuse(const PendingRequest& request, const std::string& ename,
                          const std::string& evalue) {
    const auto parent = parse_json_frame(request.header, 64).value_or(json::object());
    json content = error_content(request.msg_type, ename, evalue);
    publish_status(parent, "busy");
    if (request.msg_type == "execute_request") {
        publish(parent, "error",
                {{"ename", ename}, {"evalue", evalue}, {"traceback", content["traceback"]}});
        content["execution_count"] = governor_ ? governor_->executions() : 0;
        content["user_expressions"] = json::object();
        content["payload"] = json::array();
        if (governor_) {
            content["cellblock"] = {{"executions_left", governor_->executions_left()}};
        }
    }
    send_reply(request, reply_type_for(request.msg_type), content);
    publish_status(parent, "idle");
}

void SessionProxy::answer_interrupt(const PendingRequest& request) {
    const auto parent = parse_json_frame(request.header, 64).value_or(json::object());
    publish_status(parent, "busy");
    sandbox_->interrupt();
    // Code that ignores SIGINT must not keep the sandbox: on_timer escalates.
    if (governor_ && execution_) {
        governor_->on_interrupt(Clock::now());
        if (options_.observer)
            options_.observer->on_event(session_id_, "interrupted",
                                        "interrupt_request from a client");
    }
    send_reply(request, "interrupt_reply", {{"status", "ok"}});
    publish_status(parent, "idle");
}

void SessionProxy::fail_pending(const std::string& ename, const std::string& evalue) {
    auto pending = std::move(pending_);
    pending_.clear();
    for (auto& [msg_id, request] : pending) {
        const auto parent = parse_json_frame(request.header, 64).value_or(json::object());
        json content = error_content(request.msg_type, ename, evalue);
        if (request.msg_type == "execute_request") {
            publish(parent, "error",
                    {{"ename", ename}, {"evalue", evalue}, {"traceback", content["traceback"]}});
            content["execution_count"] = nullptr;
            content["user_expressions"] = json::object();
            content["payload"] = json::array();
        } else if (request.msg_type == "shutdown_request") {
            content = {{"status", "ok"}, {"restart", false}};
        }
        send_reply(request, reply_type_for(request.msg_type), content);
        publish_status(parent, "idle");
    }
}

void SessionProxy::close(const std::string& reason) {
    if (closed_) return;
    for (auto& queued : queue_) {
        PendingRequest request{queued.channel, {}, "execute_request", queued.header.dump()};
        for (std::size_t i = 0; i < queued.layout.delimiter; ++i) {
            request.identities.emplace_back(static_cast<const char*>(queued.frames[i].data()),
                                            queued.frames[i].size());
        }
        refuse(request, "SessionClosed", "the session closed: " + reason);
    }
    queue_.clear();
    close_reason_ = reason;
    closed_ = true;
    closed_at_ = Clock::now();
    if (held_reply_ && sandbox_) release_held_reply();
    held_reply_.reset();
    if (execution_) finish_execution("error", "SessionClosed");
    if (!pending_.empty()) fail_pending("SessionClosed", "the session closed: " + reason);
    if (sandbox_) {
        // The registry keeps the session's figures: its sandbox's whole
        // life since the hand-out, work between executions included.
        const SandboxUsage last = sandbox_->usage();
        memory_peak_bytes_ = std::max(memory_peak_bytes_, last.memory_peak_bytes);
        cpu_ms_total_ = std::max(
            cpu_ms_total_, (last.cpu_ns - std::min(last.cpu_ns, cpu_ns_at_attach_)) / 1000000);
        sandbox_->kill();
        if (options_.dispose) {
            options_.dispose(std::move(sandbox_));
        } else {
            sandbox_->destroy();
        }
    }
    inner_shell_.close();
    inner_control_.close();
    inner_stdin_.close();
    inner_iopub_.close();
    inner_hb_.close();
    // A closed session keeps only what answers SessionClosed (shell, control)
    // and the iopub its busy/idle statuses go out on; no heartbeat answers.
    outer_stdin_.close();
    outer_hb_.close();
    spdlog::info("session {}: closed ({})", session_id_, reason);
    if (options_.observer) options_.observer->on_closed(session_id_, reason);
}

}  // namespace cellblock
