// SessionProxy's side of the core's SessionIo (session_proxy.hpp): what the
// pure core asks (forward, publish, send to the kernel, interrupt, sleep,
// wake), done with the session's sockets, signers and sandbox. Apart from
// session_proxy.cpp, which wires the sockets and feeds the core, so that each
// file reads as one direction: this one is the core's way out.
#include <spdlog/spdlog.h>

#include "multipart.hpp"
#include "session_proxy.hpp"

namespace cellblock {
using nlohmann::json;

namespace {
// How long a shim may take to answer "quiesce" (it closes a few sockets:
// milliseconds); the loop waits on it.
constexpr std::chrono::milliseconds kQuiesceWait{3000};
}  // namespace

// What the core asks, done with the session's sockets and sandbox.
class SessionProxy::Io final : public SessionIo {
  public:
    explicit Io(SessionProxy& proxy) : p_(proxy) {}

    void forward_reply(Channel channel, const std::vector<std::string>& identities,
                       InboundMessage& msg, const std::string* new_metadata) override {
        std::vector<Frame> routing;
        routing.reserve(identities.size());
        for (const auto& id : identities) routing.push_back(Frame::copy_of(id));
        forward(channel, std::move(routing), msg, new_metadata, nullptr);
    }

    void forward_output(InboundMessage& msg, const std::string* new_content) override {
        // Published under the kernel's own topic frames.
        std::vector<Frame> topic;
        topic.reserve(msg.layout.delimiter);
        for (std::size_t i = 0; i < msg.layout.delimiter; ++i) {
            topic.push_back(std::move(msg.frames[i]));
        }
        forward(Channel::iopub, std::move(topic), msg, nullptr, new_content);
    }

    void send_reply(Channel channel, const std::vector<std::string>& identities, const json& parent,
                    const std::string& msg_type, json content) override {
        send_own(channel, identities, parent, msg_type, std::move(content));
    }

    void publish(const json& parent, const std::string& msg_type, json content) override {
        send_own(Channel::iopub, {"kernel." + p_.session_id_ + "." + msg_type}, parent, msg_type,
                 std::move(content));
    }

    bool forward_to_kernel(Channel channel, InboundMessage& msg) override {
        const WireLayout& at = msg.layout;
        std::vector<Frame> out;
        out.reserve(msg.frames.size() - at.delimiter);
        out.push_back(Frame::copy_of(kDelimiter));
        out.emplace_back(p_.inner_signer_.sign(msg.frame(at.header()), msg.frame(at.parent()),
                                               msg.frame(at.metadata()), msg.frame(at.content())));
        for (std::size_t i = at.header(); i < msg.frames.size(); ++i) {
            out.push_back(std::move(msg.frames[i]));
        }
        return p_.send_or_hold(true, channel, out);
    }

    void interrupt_kernel() override {
        if (!p_.sandbox_ || p_.sandbox_->interrupt()) return;
        // A backend that cannot signal the kernel (a Swarm service on another
        // node): ask the kernel itself, on its control channel (the
        // messaging spec's interrupt_mode "message"). Its reply has no
        // pending request and is dropped.
        auto frames = p_.own_message("interrupt_request", json::object());
        if (RelaySocket* control = p_.inner_socket(Channel::control)) control->send(frames);
    }
    void kill_kernel() override {
        if (!p_.sandbox_) return;
        p_.ask_kernel_to_exit();
        p_.sandbox_->kill();
    }
    SandboxUsage kernel_usage() override {
        return p_.sandbox_ ? p_.sandbox_->usage() : SandboxUsage{};
    }
    bool kernel_reported_usage(const SandboxUsage& usage) override {
        return p_.sandbox_ && p_.sandbox_->take_reported_usage(usage);
    }
    KernelExit kernel_exit() override {
        if (!p_.sandbox_) return {};
        return {p_.sandbox_->memory_limit_hit(), p_.sandbox_->exit_description(),
                p_.sandbox_->node_lost()};
    }

    void release_kernel() override {
        // Said before the sandbox is destroyed, which can take a while: a
        // frontend that ends its terminal once the kernel answered its
        // shutdown must still see why the session ended.
        spdlog::info("session {}: closed ({})", p_.session_id_, p_.core_->close_reason());
        p_.detach_kernel();
        // A closed session keeps only what answers SessionClosed (shell,
        // control) and the iopub its busy/idle statuses go out on; no
        // heartbeat answers.
        for (auto* s : {&p_.outer_stdin_, &p_.outer_hb_}) {
            if (*s) (*s)->close();
        }
    }

    std::string send_to_kernel(Channel channel, const std::string& msg_type,
                               json content) override {
        std::string msg_id;
        auto frames = p_.own_message(msg_type, std::move(content), {}, &msg_id);
        p_.send_or_hold(true, channel, frames);
        return msg_id;
    }

    void saving_snapshot() override {
        if (p_.sandbox_ && p_.options_.saving_snapshot) p_.options_.saving_snapshot(*p_.sandbox_);
    }
    void snapshot_unsaved() override {
        if (p_.options_.snapshot_unsaved) p_.options_.snapshot_unsaved();
    }

    void put_to_sleep(const json& report, Moved done) override {
        std::string why;
        if (!can_sleep(why)) return done(&why);
        p_.options_.keep_snapshot(*p_.sandbox_, report,
                                  [this, done = std::move(done)](const std::string* failed) {
                                      if (!failed) p_.detach_kernel();
                                      done(failed);
                                  });
    }

    bool exact_level() const override {
        return p_.options_.checkpoint && p_.sandbox_ && p_.sandbox_->checkpointable();
    }
    void checkpoint(Checkpointed done) override {
        if (!exact_level()) return SessionIo::checkpoint(std::move(done));
        // Its shim answers on the lifeline, read here: not by the watch.
        p_.unwatch_lifeline();
        std::string why;
        if (!p_.sandbox_->checkpointable()->quiesce(kQuiesceWait, why)) {
            if (!p_.sandbox_->exited()) {
                p_.lifeline_watch_ =
                    p_.loop_.watch_fd(p_.sandbox_->lifeline_fd(), [this] { p_.on_lifeline(); });
            }
            return done(&why, true);
        }
        // The shim closed its ends of the kernel's channels: the relay's
        // go too; the sandbox is the server's to checkpoint.
        std::unique_ptr<Sandbox> box = std::move(p_.sandbox_);
        p_.detach_kernel();
        p_.options_.checkpoint(std::move(box), std::move(done));
    }
    bool snapshot_exact() const override {
        return p_.options_.snapshot_exact && p_.options_.snapshot_exact();
    }

    bool client_connected(const std::string& identity) const override {
        const auto known = p_.outer_shell_ ? p_.outer_shell_->has_peer(identity) : std::nullopt;
        return !known || *known;
    }
    bool clients_listening() const override {
        // libzmq's PUB does not say: the adoption waits its bound then.
        const auto n = p_.outer_iopub_ ? p_.outer_iopub_->subscribers() : std::nullopt;
        return n && *n > 0;
    }
    void hold_outputs_for_listener(std::chrono::milliseconds for_at_most) override {
        if (p_.outer_iopub_) p_.outer_iopub_->hold_until_subscribed(for_at_most);
    }
    bool can_sleep(std::string& why) const override {
        if (!p_.options_.keep_snapshot || !p_.options_.wake) {
            why = "this server keeps no snapshots";
            return false;
        }
        if (!p_.sandbox_) {
            why = "the session has no sandbox";
            return false;
        }
        if (!p_.sandbox_->files() && !(p_.options_.fetch_snapshot && p_.options_.place_snapshot)) {
            why = "the " + p_.sandbox_->runtime() +
                  " backend's sandboxes keep no files on this host: no snapshot can be kept";
            return false;
        }
        return true;
    }

    void fetch_snapshot(Moved done) override {
        if (p_.sandbox_ && !p_.sandbox_->files() && p_.options_.fetch_snapshot) {
            return p_.options_.fetch_snapshot(std::move(done));
        }
        done(nullptr);
    }
    void place_snapshot(Moved done) override {
        if (p_.sandbox_ && !p_.sandbox_->files() && p_.options_.place_snapshot) {
            return p_.options_.place_snapshot(std::move(done));
        }
        done(nullptr);
    }

    void wake() override {
        spdlog::info("session {}: waking", p_.session_id_);
        if (p_.options_.wake) p_.options_.wake();
    }

    void rejected(std::string_view where, std::string_view identity,
                  const std::string& why) override {
        if (p_.options_.observer) p_.options_.observer->on_rejected(where, why);
        spdlog::warn("session {} {}: rejected message from {}: {}", p_.session_id_, where,
                     identity_text(identity), why);
    }
    void log(const std::string& what) override {
        spdlog::warn("session {}: {}", p_.session_id_, what);
    }

  private:
    // A kernel message re-signed with the client's key, after `routing`
    // (the client's identities, or iopub's topic), without copying its frames.
    void forward(Channel channel, std::vector<Frame> routing, InboundMessage& msg,
                 const std::string* new_metadata, const std::string* new_content) {
        auto& frames = msg.frames;
        const WireLayout& at = msg.layout;
        const std::string_view metadata =
            new_metadata ? std::string_view(*new_metadata) : msg.frame(at.metadata());
        const std::string_view content =
            new_content ? std::string_view(*new_content) : msg.frame(at.content());
        std::vector<Frame> out = std::move(routing);
        out.reserve(out.size() + frames.size() - at.delimiter);
        out.push_back(Frame::copy_of(kDelimiter));
        std::string signature;
        if (!new_metadata && !new_content && p_.early_ && p_.early_->signature.valid() &&
            p_.early_->content == msg.frames[at.content()].data()) {
            // Signed on the second core while the kernel's signature was
            // checked: the same bytes, unchanged, with the client's key.
            signature = p_.early_->signature.get();
            p_.early_.reset();
        } else {
            signature = p_.outer_signer_.sign(msg.frame(at.header()), msg.frame(at.parent()),
                                              metadata, content);
        }
        out.emplace_back(std::move(signature));
        out.push_back(std::move(frames[at.header()]));
        out.push_back(std::move(frames[at.parent()]));
        out.push_back(new_metadata ? Frame::copy_of(*new_metadata)
                                   : std::move(frames[at.metadata()]));
        out.push_back(new_content ? Frame::copy_of(*new_content) : std::move(frames[at.content()]));
        for (std::size_t i = at.first_buffer(); i < frames.size(); ++i) {
            out.push_back(std::move(frames[i]));
        }
        p_.send_or_hold(false, channel, out);
    }

    // A message the server writes itself, signed with the client's key.
    void send_own(Channel channel, std::vector<std::string> identities, const json& parent,
                  const std::string& msg_type, json content) {
        WireMessage msg;
        msg.identities = std::move(identities);
        msg.header = make_header(msg_type, p_.server_session_);
        msg.parent_header = parent;
        msg.content = std::move(content);
        auto frames = to_frames(encode(msg, p_.outer_signer_));
        p_.send_or_hold(false, channel, frames);
    }

    SessionProxy& p_;
};

std::unique_ptr<SessionIo> SessionProxy::make_io(SessionProxy& proxy) {
    return std::make_unique<Io>(proxy);
}

}  // namespace cellblock
