#include "session_proxy.hpp"

#include <spdlog/spdlog.h>

namespace cellblock {
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kRecentParents = 256;
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

}  // namespace

SessionProxy::SessionProxy(zmq::context_t& context, std::string session_id,
                           const ConnectionInfo& outer, ProxyOptions options)
    : session_id_(std::move(session_id)),
      server_session_(make_uuid()),
      options_(options),
      outer_signer_(outer.key, outer.signature_scheme),
      outer_shell_(make_socket(context, zmq::socket_type::router, options.max_frame_bytes, 1000)),
      outer_control_(make_socket(context, zmq::socket_type::router, options.max_frame_bytes, 1000)),
      outer_stdin_(make_socket(context, zmq::socket_type::router, options.max_frame_bytes, 1000)),
      outer_iopub_(make_socket(context, zmq::socket_type::pub, options.max_frame_bytes, 1000)),
      outer_hb_(make_socket(context, zmq::socket_type::router, 1024, 0)),
      inner_shell_(make_socket(context, zmq::socket_type::dealer, options.max_frame_bytes, 0)),
      inner_control_(make_socket(context, zmq::socket_type::dealer, options.max_frame_bytes, 0)),
      inner_stdin_(make_socket(context, zmq::socket_type::dealer, options.max_frame_bytes, 0)),
      inner_iopub_(make_socket(context, zmq::socket_type::sub, options.max_frame_bytes, 0)),
      inner_hb_(make_socket(context, zmq::socket_type::dealer, 1024, 0)) {
    for (auto* s : {&outer_shell_, &outer_control_, &outer_stdin_, &outer_hb_}) {
        s->set(zmq::sockopt::router_handover, 1);
    }
    outer_shell_.bind(outer.endpoint(Channel::shell));
    outer_control_.bind(outer.endpoint(Channel::control));
    outer_stdin_.bind(outer.endpoint(Channel::stdin_));
    outer_iopub_.bind(outer.endpoint(Channel::iopub));
    outer_hb_.bind(outer.endpoint(Channel::hb));
}

SessionProxy::~SessionProxy() {
    if (sandbox_) sandbox_->destroy();
}

void SessionProxy::attach(std::unique_ptr<Sandbox> sandbox) {
    sandbox_ = std::move(sandbox);
    const ConnectionInfo& inner = sandbox_->inner_connection();
    inner_signer_ = Signer(inner.key, inner.signature_scheme);
    // The kernel routes input_request to the identity of the shell request's
    // sender, so the inner stdin socket shares the inner shell socket's identity.
    const std::string identity = "cellblock-" + session_id_;
    inner_shell_.set(zmq::sockopt::routing_id, identity);
    inner_stdin_.set(zmq::sockopt::routing_id, identity);
    for (auto* s : {&inner_shell_, &inner_control_, &inner_stdin_, &inner_iopub_, &inner_hb_}) {
        s->set(zmq::sockopt::reconnect_ivl, 10);
    }
    inner_iopub_.set(zmq::sockopt::subscribe, "");
    inner_shell_.connect(inner.endpoint(Channel::shell));
    inner_control_.connect(inner.endpoint(Channel::control));
    inner_stdin_.connect(inner.endpoint(Channel::stdin_));
    inner_iopub_.connect(inner.endpoint(Channel::iopub));
    inner_hb_.connect(inner.endpoint(Channel::hb));
}

void SessionProxy::add_poll_items(std::vector<zmq::pollitem_t>& items) {
    auto add = [&](zmq::socket_t& s) { items.push_back({s.handle(), 0, ZMQ_POLLIN, 0}); };
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
    const int fd = sandbox_ && !finished_ && !sandbox_->exited() ? sandbox_->lifeline_fd() : -1;
    items.push_back({nullptr, fd, static_cast<short>(fd >= 0 ? ZMQ_POLLIN : 0), 0});
}

void SessionProxy::handle(const zmq::pollitem_t* items) {
    auto ready = [&](std::size_t i) { return (items[i].revents & ZMQ_POLLIN) != 0; };
    if (finished_) return;
    if (sandbox_) {
        if (ready(0)) on_inner_reply(Channel::shell);
        if (ready(1)) on_inner_reply(Channel::control);
        if (ready(2)) on_inner_stdin();
        if (ready(3)) on_inner_iopub();
        if (ready(4)) on_inner_heartbeat();
    }
    if (ready(5)) on_outer_request(Channel::shell);
    if (ready(6)) on_outer_request(Channel::control);
    if (ready(7)) on_outer_stdin();
    if (ready(8)) on_outer_heartbeat();
    if (items[9].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) on_lifeline();
}

zmq::socket_t& SessionProxy::outer_socket(Channel channel) {
    switch (channel) {
        case Channel::shell: return outer_shell_;
        case Channel::control: return outer_control_;
        case Channel::stdin_: return outer_stdin_;
        case Channel::iopub: return outer_iopub_;
        case Channel::hb: return outer_hb_;
    }
    return outer_shell_;
}

zmq::socket_t& SessionProxy::inner_socket(Channel channel) {
    switch (channel) {
        case Channel::shell: return inner_shell_;
        case Channel::control: return inner_control_;
        case Channel::stdin_: return inner_stdin_;
        case Channel::iopub: return inner_iopub_;
        case Channel::hb: return inner_hb_;
    }
    return inner_shell_;
}

void SessionProxy::reject(const char* channel, std::string_view identity, const std::string& why) {
    spdlog::warn("session {} {}: rejected message from {}: {}", session_id_, channel,
                 identity_text(identity), why);
}

void SessionProxy::remember_parent(const std::string& msg_id) {
    if (recent_.insert(msg_id).second) {
        recent_order_.push_back(msg_id);
        if (recent_order_.size() > kRecentParents) {
            recent_.erase(recent_order_.front());
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
    std::optional<json> header;
    for (std::size_t i = at.header(); i <= at.content(); ++i) {
        auto parsed = parse_json_frame(views[i], options_.outer_limits.max_json_depth);
        if (!parsed || !parsed->is_object()) {
            reject(name, sender, "frame " + std::to_string(i - at.delimiter) + " is not a JSON object");
            return;
        }
        if (i == at.header()) header = std::move(parsed);
    }
    const std::string msg_id = json_string(*header, "msg_id");
    const std::string msg_type = json_string(*header, "msg_type");
    if (msg_id.empty() || msg_type.empty()) {
        reject(name, sender, "header lacks msg_id or msg_type");
        return;
    }
    if (!ends_with(msg_type, "_request")) {
        reject(name, sender, "'" + msg_type + "' is not a request");
        return;
    }
    PendingRequest request{channel, {}, msg_type, std::string(views[at.header()])};
    for (std::size_t i = 0; i < at.delimiter; ++i) request.identities.emplace_back(views[i]);

    if (!sandbox_ || finished_) {
        send_reply(request, msg_type.substr(0, msg_type.size() - 8) + "_reply",
                   {{"status", "error"},
                    {"ename", "SessionClosed"},
                    {"evalue", "this session is closed: " + close_reason_},
                    {"traceback", json::array()}});
        return;
    }
    if (channel == Channel::control && msg_type == "interrupt_request") {
        answer_interrupt(request);
        return;
    }
    if (msg_type == "shutdown_request") {
        shutdown_deadline_ = Clock::now() + options_.shutdown_grace;
        shutdown_request_ = request;
    }
    remember_parent(msg_id);
    pending_[msg_id] = std::move(request);

    std::vector<zmq::message_t> out;
    out.reserve(scratch_.frames.size() - at.delimiter);
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(inner_signer_.sign(views[at.header()], views[at.parent()],
                                              views[at.metadata()], views[at.content()])));
    for (std::size_t i = at.header(); i < scratch_.frames.size(); ++i) {
        out.push_back(std::move(scratch_.frames[i]));
    }
    if (!send_multipart(inner_socket(channel), out)) {
        spdlog::warn("session {} {}: kernel queue full; request {} dropped", session_id_, name,
                     msg_id);
    }
}

void SessionProxy::on_outer_stdin() {
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
            reject("stdin", sender, "frame " + std::to_string(i - at.delimiter) + " is not a JSON object");
            return;
        }
    }
    if (!sandbox_ || finished_) return;
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
    if (!recv_multipart(outer_hb_, scratch_, kMaxHeartbeatFrames)) return;
    if (scratch_.dropped_frames > 0 || scratch_.total_bytes > kMaxHeartbeatBytes) return;
    if (!sandbox_ || finished_) return;  // no kernel, no heartbeat
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
    if (!ends_with(msg_type, "_reply")) {
        reject(where.c_str(), "", "'" + msg_type + "' is not a reply");
        return;
    }
    PendingRequest request = std::move(it->second);
    pending_.erase(it);

    std::vector<zmq::message_t> out;
    out.reserve(request.identities.size() + scratch_.frames.size() - at.delimiter);
    for (const auto& id : request.identities) out.push_back(to_frame(id));
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(outer_signer_.sign(views[at.header()], views[at.parent()],
                                              views[at.metadata()], views[at.content()])));
    for (std::size_t i = at.header(); i < scratch_.frames.size(); ++i) {
        out.push_back(std::move(scratch_.frames[i]));
    }
    send_multipart(outer_socket(channel), out);

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
    if (parent_id.empty()) return;  // the kernel's own "starting" status: no client asked
    if (!known_parent(parent_id)) {
        reject("kernel iopub", "", "parent is not a request of this session: '" + parent_id + "'");
        return;
    }
    std::vector<zmq::message_t> out;
    out.reserve(scratch_.frames.size());
    for (std::size_t i = 0; i < at.delimiter; ++i) out.push_back(std::move(scratch_.frames[i]));
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(outer_signer_.sign(views[at.header()], views[at.parent()],
                                              views[at.metadata()], views[at.content()])));
    for (std::size_t i = at.header(); i < scratch_.frames.size(); ++i) {
        out.push_back(std::move(scratch_.frames[i]));
    }
    send_multipart(outer_iopub_, out);
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
    const std::string parent_id = parent && parent->is_object() ? json_string(*parent, "msg_id") : "";
    auto it = pending_.find(parent_id);
    if (it == pending_.end() || it->second.msg_type != "execute_request") {
        reject("kernel stdin", "", "input_request for a request that is not open");
        return;
    }
    // The client's stdin socket shares the identity of its shell socket.
    std::vector<zmq::message_t> out;
    for (const auto& id : it->second.identities) out.push_back(to_frame(id));
    out.push_back(to_frame(kDelimiter));
    out.push_back(to_frame(outer_signer_.sign(views[at.header()], views[at.parent()],
                                              views[at.metadata()], views[at.content()])));
    for (std::size_t i = at.header(); i < scratch_.frames.size(); ++i) {
        out.push_back(std::move(scratch_.frames[i]));
    }
    send_multipart(outer_stdin_, out);
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
    if (finished_) return std::nullopt;
    return shutdown_deadline_;
}

void SessionProxy::on_timer(Clock::time_point now) {
    if (finished_ || !shutdown_deadline_ || now < *shutdown_deadline_) return;
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
        const bool oom = sandbox_->memory_limit_hit();
        const std::string description = sandbox_->exit_description();
        spdlog::warn("session {}: {}", session_id_, description);
        fail_pending(oom ? "MemoryLimitExceeded" : "KernelDied", description);
        close(description);
    }
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

void SessionProxy::answer_interrupt(const PendingRequest& request) {
    const auto parent = parse_json_frame(request.header, 64).value_or(json::object());
    publish_status(parent, "busy");
    sandbox_->interrupt();
    send_reply(request, "interrupt_reply", {{"status", "ok"}});
    publish_status(parent, "idle");
}

void SessionProxy::fail_pending(const std::string& ename, const std::string& evalue) {
    for (auto& [msg_id, request] : pending_) {
        const auto parent = parse_json_frame(request.header, 64).value_or(json::object());
        std::string reply_type = request.msg_type.substr(0, request.msg_type.size() - 8) + "_reply";
        json content = {{"status", "error"},
                        {"ename", ename},
                        {"evalue", evalue},
                        {"traceback", json::array({ename + ": " + evalue})}};
        if (request.msg_type == "execute_request") {
            publish(parent, "error", {{"ename", ename}, {"evalue", evalue},
                                      {"traceback", content["traceback"]}});
            content["execution_count"] = nullptr;
            content["user_expressions"] = json::object();
            content["payload"] = json::array();
        }
        send_reply(request, reply_type, content);
        publish_status(parent, "idle");
    }
    pending_.clear();
}

void SessionProxy::close(const std::string& reason) {
    if (finished_) return;
    close_reason_ = reason;
    if (!pending_.empty()) fail_pending("SessionClosed", "the session closed: " + reason);
    if (sandbox_) sandbox_->destroy();
    finished_ = true;
    spdlog::info("session {}: closed ({})", session_id_, reason);
}

}  // namespace cellblock
