#include "session_proxy.hpp"

#include <spdlog/spdlog.h>

#include "multipart.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

constexpr std::size_t kMaxHeartbeatFrames = 4;
constexpr std::size_t kMaxHeartbeatBytes = 4096;

double unix_minus_steady() {
    using namespace std::chrono;
    return duration<double>(system_clock::now().time_since_epoch()).count() -
           duration<double>(Clock::now().time_since_epoch()).count();
}

}  // namespace

SessionProxy::SessionProxy(zmq::context_t& context, EventLoop& loop, std::string session_id,
                           const ConnectionInfo& outer, ProxyOptions options)
    : session_id_(std::move(session_id)),
      server_session_(make_uuid()),
      options_(std::move(options)),
      outer_(outer),
      outer_signer_(outer.key, outer.signature_scheme),
      loop_(loop) {
    // A kernel's single large output (a 50 MB print) must reach output shaping
    // to be cut with a marker, not be dropped whole: the JSON frame cap for the
    // kernel's side is the socket's frame cap.
    options_.inner_limits.max_json_frame_bytes = static_cast<std::size_t>(options_.max_frame_bytes);
    // A client's JSON frame (code, comm data) is refused and logged above 8 MB,
    // under the client socket's frame cap, so the refusal is cellblock's own.
    options_.outer_limits.max_json_frame_bytes =
        std::min<std::size_t>(options_.outer_limits.max_json_frame_bytes,
                              static_cast<std::size_t>(options_.max_client_frame_bytes) / 2);
    // A whole message is held only once all its frames arrived, and frames
    // are capped, not messages: a small frame cap on the client's side bounds
    // what one frame from a peer without the key can make the server hold.
    const auto bind = [&](Channel channel, bool pub, int max_frame_bytes, int linger_ms) {
        ClientSocketOptions socket_options;
        socket_options.transport = options_.client_transport;
        socket_options.max_frame_bytes = max_frame_bytes;
        socket_options.max_frames = options_.outer_limits.max_frames + 1;
        socket_options.linger_ms = linger_ms;
        socket_options.label = "session " + session_id_ + " client " + channel_name(channel);
        BoundSocket bound = bind_client_socket(context, pub, outer_, channel, socket_options);
        outer_.set_port(channel, bound.port);
        return std::move(bound.socket);
    };
    outer_shell_ = bind(Channel::shell, false, options_.max_client_frame_bytes, 1000);
    outer_control_ = bind(Channel::control, false, options_.max_client_frame_bytes, 1000);
    outer_stdin_ = bind(Channel::stdin_, false, options_.max_client_frame_bytes, 1000);
    outer_iopub_ = bind(Channel::iopub, true, options_.max_client_frame_bytes, 1000);
    outer_hb_ = bind(Channel::hb, false, 1024, 0);
    client_rules_ = {&outer_signer_, &replay_, options_.outer_limits, true};
    kernel_rules_ = {&inner_signer_, nullptr, options_.inner_limits, false};
    CoreOptions core;
    core.session_id = session_id_;
    core.policy = options_.policy;
    core.limits = options_.limits;
    core.observer = options_.observer;
    core.audit_code_hash_only = options_.audit_code_hash_only;
    core.shutdown_grace = options_.shutdown_grace;
    core.max_json_depth = options_.inner_limits.max_json_depth;
    core.unix_minus_steady_s = unix_minus_steady();
    io_ = make_io(*this);
    core_ = std::make_unique<SessionCore>(std::move(core), *io_, Clock::now());
    outer_shell_->watch(loop_, [this] { on_client(Channel::shell); });
    outer_control_->watch(loop_, [this] { on_client(Channel::control); });
    outer_stdin_->watch(loop_, [this] { on_client(Channel::stdin_); });
    outer_hb_->watch(loop_, [this] { on_client_heartbeat(); });
    // Nothing to read on a PUB, but a ZMTP one accepts its subscribers and
    // reads their subscriptions in the loop.
    outer_iopub_->watch(loop_, [] {});
    calls_deadline_ = loop_.add_deadline(
        [this]() -> std::optional<Clock::time_point> {
            std::optional<Clock::time_point> first;
            for (const auto& [id, call] : kernel_calls_) {
                if (!first || call.deadline < *first) first = call.deadline;
            }
            return first;
        },
        [this](Clock::time_point now) {
            std::vector<KernelAnswered> late;
            std::erase_if(kernel_calls_, [&](auto& entry) {
                if (entry.second.deadline > now) return false;
                late.push_back(std::move(entry.second.answered));
                return true;
            });
            for (auto& answered : late) answered(nullptr);
        });
    deadline_ = loop_.add_deadline([this] { return core_->next_deadline(Clock::now()); },
                                   [this](Clock::time_point now) {
                                       core_->on_tick(now);
                                       if (core_->expired(now) && options_.on_expired) {
                                           options_.on_expired();
                                       }
                                   });
}

SessionProxy::~SessionProxy() {
    loop_.remove_deadline(deadline_);
    loop_.remove_deadline(calls_deadline_);
    end_kernel_calls();
    if (lifeline_watch_) loop_.unwatch(*lifeline_watch_);
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
    // A kernel's sockets before its lifeline: its last replies are read
    // before its exit is seen.
    inner_shell_->watch(loop_, [this] { on_kernel(Channel::shell); });
    inner_control_->watch(loop_, [this] { on_kernel(Channel::control); });
    inner_stdin_->watch(loop_, [this] { on_kernel(Channel::stdin_); });
    inner_iopub_->watch(loop_, [this] { on_kernel(Channel::iopub); });
    inner_hb_->watch(loop_, [this] { on_kernel_heartbeat(); });
    if (!sandbox_->exited()) {
        lifeline_watch_ = loop_.watch_fd(sandbox_->lifeline_fd(), [this] { on_lifeline(); });
    }
    core_->on_kernel_attached(Clock::now(), channels.probe_msg_ids);
}

void SessionProxy::unwatch_lifeline() {
    if (lifeline_watch_) {
        loop_.unwatch(*lifeline_watch_);
        lifeline_watch_.reset();
    }
}

std::unique_ptr<Sandbox> SessionProxy::leave_running() {
    unwatch_lifeline();
    return std::move(sandbox_);
}

void SessionProxy::ask_kernel_to_exit() {
    if (!sandbox_ || !sandbox_->kill_is_slow() || sandbox_->exited() || !inner_control_) return;
    auto frames = own_message("cellblock_exit_request", json::object());
    inner_control_->send(frames);
}

void SessionProxy::detach_kernel() {
    unwatch_lifeline();
    if (sandbox_) {
        ask_kernel_to_exit();
        sandbox_->kill();
        if (options_.dispose) {
            options_.dispose(std::move(sandbox_));
        } else {
            sandbox_->destroy();
        }
        sandbox_.reset();
    }
    for (auto* s : {&inner_shell_, &inner_control_, &inner_stdin_, &inner_iopub_, &inner_hb_}) {
        if (*s) (*s)->close();
    }
    end_kernel_calls();
}

bool SessionProxy::ask_kernel(const std::string& msg_type, json content,
                              std::vector<std::string> buffers, KernelAnswered answered,
                              std::chrono::milliseconds timeout) {
    if (!sandbox_ || !inner_control_ || core_->closed()) return false;
    std::string msg_id;
    auto frames = own_message(msg_type, std::move(content), std::move(buffers), &msg_id);
    // Not held for the record (hold_for_record): a restart fails the move,
    // which the client is told, and nothing in the record waits for it.
    if (!inner_control_->send(frames)) return false;
    kernel_calls_.emplace(msg_id, KernelCall{std::move(answered), Clock::now() + timeout});
    return true;
}

std::vector<Frame> SessionProxy::own_message(const std::string& msg_type, json content,
                                             std::vector<std::string> buffers,
                                             std::string* msg_id) const {
    WireMessage msg;
    msg.header = make_header(msg_type, server_session_);
    msg.content = std::move(content);
    msg.buffers = std::move(buffers);
    if (msg_id) *msg_id = json_string(msg.header, "msg_id");
    return to_frames(encode(msg, inner_signer_));
}

void SessionProxy::end_kernel_calls() {
    auto calls = std::move(kernel_calls_);
    kernel_calls_.clear();
    for (auto& [id, call] : calls) call.answered(nullptr);
}

bool SessionProxy::answer_kernel_call(const InboundMessage& msg) {
    const auto it = kernel_calls_.find(msg.parent_id);
    if (it == kernel_calls_.end()) return false;
    KernelAnswered answered = std::move(it->second.answered);
    kernel_calls_.erase(it);
    KernelAnswer answer;
    answer.content =
        msg.parsed_content(kernel_rules_.limits.max_json_depth).value_or(json::object());
    for (std::size_t i = msg.layout.first_buffer(); i < msg.frames.size(); ++i) {
        answer.buffers.emplace_back(msg.frame(i));
    }
    answered(&answer);
    return true;
}

void SessionProxy::close(const std::string& reason, const char* ename, const std::string& why) {
    core_->close(Clock::now(), reason, ename, why);
}

bool SessionProxy::send_or_hold(bool to_kernel, Channel channel, std::vector<Frame>& frames) {
    if (options_.hold_for_record && (channel == Channel::shell || channel == Channel::control)) {
        held_.push_back({to_kernel, channel, std::move(frames)});
        if (held_.size() == 1 && options_.observer) {
            options_.observer->on_requests_changed(session_id_);
        }
        return true;
    }
    RelaySocket* socket = to_kernel ? inner_socket(channel) : outer_socket(channel);
    return socket && socket->send(frames);
}

void SessionProxy::release_held() {
    auto held = std::move(held_);
    held_.clear();
    for (auto& h : held) {
        RelaySocket* socket = h.to_kernel ? inner_socket(h.channel) : outer_socket(h.channel);
        if (socket && !socket->send(h.frames) && h.to_kernel) {
            spdlog::warn("session {}: {}: kernel queue full; a request dropped", session_id_,
                         channel_name(h.channel));
        }
    }
}

bool SessionProxy::unsent() const {
    if (!held_.empty()) return true;
    for (const auto* s : {&outer_shell_, &outer_control_, &outer_stdin_, &outer_iopub_}) {
        if (*s && (*s)->unsent()) return true;
    }
    return false;
}

RelaySocket* SessionProxy::outer_socket(Channel channel) {
    RelaySocket* socket = nullptr;
    switch (channel) {
        case Channel::shell:
            socket = outer_shell_.get();
            break;
        case Channel::control:
            socket = outer_control_.get();
            break;
        case Channel::stdin_:
            socket = outer_stdin_.get();
            break;
        case Channel::iopub:
            socket = outer_iopub_.get();
            break;
        case Channel::hb:
            socket = outer_hb_.get();
            break;
    }
    return socket && socket->is_open() ? socket : nullptr;
}

RelaySocket* SessionProxy::inner_socket(Channel channel) {
    switch (channel) {
        case Channel::shell:
            return inner_shell_.get();
        case Channel::control:
            return inner_control_.get();
        case Channel::stdin_:
            return inner_stdin_.get();
        case Channel::iopub:
            return inner_iopub_.get();
        case Channel::hb:
            return inner_hb_.get();
    }
    return nullptr;
}

bool SessionProxy::on_client(Channel channel) {
    RelaySocket* socket = outer_socket(channel);
    if (!socket) return false;  // closed with the session in this same turn
    InboundMessage msg;
    std::string why, sender;
    switch (receive_verified(*socket, scratch_, client_rules_, msg, why, sender)) {
        case Received::nothing:
            return false;
        case Received::rejected:
            io_->rejected(channel_name(channel), sender, why);
            return true;
        case Received::message:
            break;
    }
    if (channel == Channel::stdin_) {
        core_->on_client_input(Clock::now(), std::move(msg));
    } else {
        core_->on_client_request(Clock::now(), channel, std::move(msg));
    }
    return true;
}

void SessionProxy::read_waiting_requests() {
    for (Channel channel : {Channel::control, Channel::shell}) {
        if (RelaySocket* socket = outer_socket(channel)) socket->read_waiting();
        while (on_client(channel)) {
        }
    }
}

void SessionProxy::half_close_clients() {
    for (auto* s : {&outer_shell_, &outer_control_, &outer_stdin_}) {
        if (*s) (*s)->half_close();
    }
}

bool SessionProxy::clients_sending() const {
    for (const auto* s : {&outer_shell_, &outer_control_, &outer_stdin_}) {
        if (*s && (*s)->peers_sending()) return true;
    }
    return false;
}

HandoverState SessionProxy::handover_state() {
    read_waiting_requests();
    return core_->handover_state(Clock::now());
}

void SessionProxy::take_over(const HandoverState& state) { core_->take_over(Clock::now(), state); }

void SessionProxy::replay(const std::vector<HandoverState::Request>& requests) {
    for (const auto& request : requests) {
        Multipart frames;
        for (const auto& frame : request.frames) {
            frames.total_bytes += frame.size();
            frames.frames.emplace_back(frame);
        }
        InboundMessage msg;
        std::string why;
        if (!verify_frames(frames, client_rules_, msg, why)) {
            io_->rejected(channel_name(request.channel), "", "carried over a restart: " + why);
            continue;
        }
        core_->on_client_request(Clock::now(), request.channel, std::move(msg));
    }
}

void SessionProxy::sign_early() {
    // Only large messages (a plot): a thread costs ~50 µs, a 1 MB HMAC ~0.7 ms.
    if (scratch_.total_bytes < kEarlySignBytes) return;
    const auto views = scratch_.views();
    const auto delimiter = std::find(views.begin(), views.end(), kDelimiter);
    if (delimiter == views.end()) return;
    const WireLayout at{static_cast<std::size_t>(delimiter - views.begin())};
    if (views.size() < at.first_buffer()) return;
    // Built in place: the worker reads early_'s own strings, which must not
    // move (a short string's bytes live inside it) until it is joined.
    EarlySignature& early = early_.emplace();
    early.content = scratch_.frames[at.content()].data();
    early.keep.reserve(4);
    // The worker reads these bytes while this thread verifies and the frames
    // move: small frames (held inline, so a move may change their address)
    // are copied; large ones are shared (a reference, the bytes stay put)
    // until the worker is joined.
    std::array<std::string_view, 4> parts;
    for (std::size_t i = 0; i < 4; ++i) {
        const Frame& frame = scratch_.frames[at.header() + i];
        if (!frame.is_shared()) {
            early.small[i] = std::string(frame.view());
            parts[i] = early.small[i];
        } else {
            early.keep.push_back(frame.share());
            parts[i] = early.keep.back().view();
        }
    }
    try {
        early.signature = std::async(std::launch::async, [signer = &outer_signer_, parts] {
            return signer->sign(parts[0], parts[1], parts[2], parts[3]);
        });
    } catch (const std::system_error&) {
        early_.reset();  // no thread to spare: signed in line, as any other message
    }
}

void SessionProxy::on_kernel(Channel channel) {
    RelaySocket* socket = inner_socket(channel);
    if (!socket || !socket->receive(scratch_, kernel_rules_.limits.max_frames)) return;
    // Not once the execution's output is cut: then a large message is most
    // likely stream output to drop, and a thread per message would be spent
    // for nothing (a flood of 1 MiB writes is a thousand of them).
    const SessionGovernor* governor = core_->governor();
    if (channel == Channel::iopub && !(governor && governor->truncated())) sign_early();
    // Whatever the core does, the worker is joined before this returns.
    struct Join {
        std::optional<EarlySignature>& early;
        ~Join() {
            if (early && early->signature.valid()) early->signature.wait();
            early.reset();
        }
    } join{early_};
    deliver_kernel(channel, scratch_);
}

void SessionProxy::deliver_kernel(Channel channel, Multipart& frames) {
    InboundMessage msg;
    std::string why;
    const std::string where = std::string("kernel ") + channel_name(channel);
    if (!verify_frames(frames, kernel_rules_, msg, why)) {
        io_->rejected(where, "", why);
        return;
    }
    const auto now = Clock::now();
    switch (channel) {
        case Channel::shell:
        case Channel::control:
            if (channel == Channel::control && answer_kernel_call(msg)) break;
            core_->on_kernel_reply(now, channel, std::move(msg));
            break;
        case Channel::iopub:
            core_->on_kernel_iopub(now, std::move(msg));
            break;
        case Channel::stdin_:
            core_->on_kernel_input_request(now, std::move(msg));
            break;
        case Channel::hb:
            break;
    }
}

void SessionProxy::on_client_heartbeat() {
    // Closed with the session in this same turn, or not.
    if (!outer_hb_ || !outer_hb_->receive(scratch_, kMaxHeartbeatFrames)) return;
    if (scratch_.dropped_frames > 0 || scratch_.total_bytes > kMaxHeartbeatBytes) return;
    if (core_->asleep()) {
        // A frontend pings every few seconds: answered here, a ping would
        // otherwise wake every session an open Notebook holds.
        outer_hb_->send(scratch_.frames);
        return;
    }
    if (!core_->kernel_live() || !inner_hb_) return;  // no kernel, no heartbeat
    inner_hb_->send(scratch_.frames);
}

void SessionProxy::on_kernel_heartbeat() {
    if (!inner_hb_ || !inner_hb_->receive(scratch_, kMaxHeartbeatFrames)) return;
    if (scratch_.dropped_frames > 0 || scratch_.total_bytes > kMaxHeartbeatBytes ||
        scratch_.frames.size() < 2) {
        return;
    }
    outer_hb_->send(scratch_.frames);
}

void SessionProxy::on_lifeline() {
    if (!sandbox_) return;
    if (sandbox_->read_lifeline()) {
        if (sandbox_->moving()) core_->move_away(Clock::now());
        return;
    }
    // End of file stays readable: watch it no longer.
    loop_.unwatch(*lifeline_watch_);
    lifeline_watch_.reset();
    core_->on_kernel_exit(Clock::now());
}

}  // namespace cellblock
