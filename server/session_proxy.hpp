// One session's relay between the client's five channels (outer key) and
// the sandboxed kernel's five channels (inner key): the adapter that does the
// I/O for a SessionCore, which holds the rules (session_core.hpp). It binds
// and reads the sockets, verifies every message once (wire_receive.hpp),
// hands it to the core with the time, and does what the core asks: re-sign
// and send, interrupt, kill, dispose of the sandbox. Heartbeats, which carry
// no JSON, it relays itself while the kernel lives.
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/sandbox.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/session_store.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "client_socket.hpp"
#include "event_loop.hpp"
#include "inner_channels.hpp"
#include "kernel_files.hpp"
#include "session_core.hpp"
#include "wire_receive.hpp"

namespace cellblock {

// How long a stopping server (either mode) turns its loop to write the
// answers it owes its clients; one that stopped reading is not waited for.
inline constexpr auto kShutdownFlush = std::chrono::seconds(2);
// How long a stopping server waits for the cgroups of sandboxes whose last
// processes are slow to die (see await_cgroup_removals).
inline constexpr std::chrono::milliseconds kShutdownCgroupWait = std::chrono::seconds(30);

struct ProxyOptions {
    WireLimits outer_limits;
    WireLimits inner_limits;
    std::chrono::milliseconds shutdown_grace{3000};
    int max_frame_bytes = 64 << 20;         // ZMQ_MAXMSGSIZE on the kernel's sockets
    int max_client_frame_bytes = 16 << 20;  // and on the client's: code and comms are small
    // How the client's sockets are spoken (relay_socket.hpp).
    RelayTransport client_transport = RelayTransport::zmtp;
    // Server mode: the policy to enforce (none in kernel mode).
    const ServerPolicy* policy = nullptr;
    std::optional<SessionLimits> limits;
    SessionObserver* observer = nullptr;
    bool audit_code_hash_only = false;
    // How a closed session's sandbox is destroyed (default: here and now).
    std::function<void(std::unique_ptr<Sandbox>)> dispose;
    // Called (from the loop's deadline) once a closed session has answered
    // SessionClosed long enough: its owner may destroy it after this turn.
    std::function<void()> on_expired;
    // Hibernation (docs/hibernation.md); null: the session does not
    // hibernate. keep_snapshot takes the snapshot the kernel wrote, before
    // the sandbox goes, and says so to its last argument (null, or why not:
    // the session stays awake), now or in a later turn, and never once the
    // session is closed; wake asks for a sandbox to resume in, handed over
    // later with attach() (or the session is closed).
    std::function<void(Sandbox& sandbox, const nlohmann::json& report, SessionIo::Moved done)>
        keep_snapshot;
    std::function<void()> wake;
    // The kernel is about to write its snapshot in `sandbox`
    // (SessionIo::saving_snapshot), or that save will not be kept after all.
    std::function<void(Sandbox& sandbox)> saving_snapshot;
    std::function<void()> snapshot_unsaved;
    // For a sandbox with no directory on this host: the server moves the
    // snapshot through its kernel (SessionIo::fetch_snapshot, place_snapshot).
    std::function<void(SessionIo::Moved)> fetch_snapshot, place_snapshot;
    // The exact level (SessionIo::checkpoint): the server takes the
    // quiesced sandbox, checkpoints it, keeps its image and lets it go;
    // null: this session hibernates at the namespace level. snapshot_exact
    // says whether the snapshot it sleeps on is the runtime's.
    std::function<void(std::unique_ptr<Sandbox>, SessionIo::Checkpointed)> checkpoint;
    std::function<bool()> snapshot_exact;
    // Adoption after a crash (docs/restarts.md): what goes to the kernel and
    // to the clients on shell and control waits in the proxy until
    // release_held(), which the server calls once the session's record says
    // so (Server::flush_live). A crash then never leaves a request at the
    // kernel that the record does not name, nor a reply delivered that the
    // record still counts open (answered twice after the adoption).
    bool hold_for_record = false;
};

class SessionProxy {
  public:
    // Binds the outer channels of `outer`; a port of 0 binds a free port
    // (see outer_connection()), and watches them on `loop`, with a deadline
    // for the session's clock. Throws zmq::error_t or std::runtime_error.
    SessionProxy(zmq::context_t& context, EventLoop& loop, std::string session_id,
                 const ConnectionInfo& outer, ProxyOptions options = {});
    ~SessionProxy();
    SessionProxy(const SessionProxy&) = delete;
    SessionProxy& operator=(const SessionProxy&) = delete;

    // Takes a started sandbox and the channels probe_kernel() connected to
    // its kernel, and starts relaying (a resuming session: restores first).
    void attach(std::unique_ptr<Sandbox> sandbox, InnerChannels channels);
    // Hibernation: see SessionCore::hibernate and resume.
    bool hibernate(std::string& why) { return core_->hibernate(Clock::now(), why); }
    bool resume(std::string& why) { return core_->resume(Clock::now(), why); }
    // A wake's snapshot opened while its kernel reads it: see
    // SessionCore::placing_snapshot (before attach) and snapshot_placed
    // (`failed`: empty when it ended well).
    void placing_snapshot(std::uint64_t bytes) { core_->placing_snapshot(bytes); }
    void snapshot_placed(const std::string& failed) {
        core_->snapshot_placed(Clock::now(), failed.empty() ? nullptr : &failed);
    }
    SessionState lifecycle_state() const { return core_->lifecycle_state(); }
    // Handing over to the next server (docs/restarts.md, SessionCore::hand_over).
    void hand_over(bool hibernate = true) { core_->hand_over(Clock::now(), hibernate); }
    bool handover_settled() const { return core_->handover_settled(); }
    // Reads every request already waiting on the client's channels (they
    // wait for the next server too), then says what the session carries.
    HandoverState handover_state();
    // Reads (and hands to the core) every request already waiting on the
    // client's shell and control channels.
    void read_waiting_requests();
    // Its clients' shell, control and stdin connections half-closed
    // (RelaySocket::half_close), and whether any of them may still send.
    void half_close_clients();
    bool clients_sending() const;
    // The next server: the session as it was handed over, hibernated; then
    // the requests it carried, verified again, in their order (they wake it).
    void take_over(const HandoverState& state);
    void replay(const std::vector<HandoverState::Request>& requests);
    // After a crash: the session whose sandbox ran on, adopting; attach()
    // its sandbox next (docs/restarts.md, phase 2).
    void adopt(const HandoverState& state) { core_->adopt(Clock::now(), state); }
    HandoverState in_flight() const { return core_->in_flight(); }
    // A planned restart that leaves the sandbox running for the next start
    // to adopt (SIGHUP, docs/restarts.md): the relay lets go of it without
    // ending it, as a crash would; the kernel's channels close with the relay.
    std::unique_ptr<Sandbox> leave_running();
    bool handing_over() const { return core_->handing_over(); }

    // Ends the session: answers what is pending, kills and disposes of the
    // sandbox. The outer shell, control and iopub stay bound, answering
    // SessionClosed, until expired() (policy closed_channels_s).
    void close(const std::string& reason, const char* ename = ename::SessionClosed,
               const std::string& why = "the session closed");
    bool closed() const { return core_->closed(); }
    // Replies and statuses still queued for this session's clients.
    bool unsent() const;
    // Sends what hold_for_record kept back this turn, in order.
    void release_held();
    // True once a closed session has answered SessionClosed long enough.
    bool expired(Clock::time_point now) const { return core_->expired(now); }
    const std::string& close_reason() const { return core_->close_reason(); }
    const std::string& session_id() const { return session_id_; }
    const ConnectionInfo& outer_connection() const { return outer_; }
    Sandbox* sandbox() { return sandbox_.get(); }
    // A request of the server's own on the kernel's control channel, signed
    // with the inner key (a remote session's file bytes, kernel_files.hpp):
    // its reply goes to `answered`, never to a client; null when `timeout`
    // passes first or the kernel goes. False when no kernel is attached.
    bool ask_kernel(const std::string& msg_type, nlohmann::json content,
                    std::vector<std::string> buffers, KernelAnswered answered,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));
    const Sandbox* sandbox() const { return sandbox_.get(); }
    const SessionGovernor* governor() const { return core_->governor(); }
    std::string state() const { return core_->state(); }
    // Over the session's executions so far; at close, over its whole life
    // (the registry keeps them).
    std::uint64_t memory_peak_bytes() const { return core_->memory_peak_bytes(); }
    std::uint64_t cpu_ms() const { return core_->cpu_ms(); }
    void add_network_bytes(std::uint64_t bytes) { core_->add_network_bytes(bytes); }
    std::uint64_t network_bytes() const { return core_->network_bytes(); }
    // When the running execution started (none: the kernel is idle), and
    // when the last one ended: what CPU fairness needs to tell a long
    // computation (or work left running in the background) from short cells.
    std::optional<Clock::time_point> running_since() const { return core_->running_since(); }
    Clock::time_point idle_since() const { return core_->idle_since(); }

  private:
    // The core's way out (session_proxy_io.cpp).
    class Io;
    static std::unique_ptr<SessionIo> make_io(SessionProxy& proxy);
    // Reads and hands on one client message; false when none waited.
    bool on_client(Channel channel);
    void on_client_heartbeat();
    void on_kernel(Channel channel);
    // Verifies one message of the kernel and hands it to the core.
    void deliver_kernel(Channel channel, Multipart& frames);
    void on_kernel_heartbeat();
    void on_lifeline();
    // Before a kill that takes a while (Sandbox::kill_is_slow): the kernel
    // is asked to exit at once (cellblock_exit_request, unanswered).
    void ask_kernel_to_exit();
    // The sandbox goes and the kernel's channels with it; the client's stay.
    void detach_kernel();
    void unwatch_lifeline();
    // Sends `frames` on the kernel's (to_kernel) or the client's socket of
    // `channel`, or holds them for release_held(); false: refused now.
    bool send_or_hold(bool to_kernel, Channel channel, std::vector<Frame>& frames);
    struct Held {
        bool to_kernel;
        Channel channel;
        std::vector<Frame> frames;
    };
    std::vector<Held> held_;
    struct KernelCall {
        KernelAnswered answered;
        Clock::time_point deadline;
    };
    std::unordered_map<std::string, KernelCall> kernel_calls_;  // by msg_id
    EventLoop::WatchId calls_deadline_ = 0;
    // Answers every open call with null (the kernel is gone).
    void end_kernel_calls();
    // The reply to one, taken out of the relay's way; false: not one.
    bool answer_kernel_call(const InboundMessage& msg);
    // A message of the server's own to the kernel (its requests, an
    // interrupt), signed with the inner key; its msg_id in `msg_id`.
    std::vector<Frame> own_message(const std::string& msg_type, nlohmann::json content,
                                   std::vector<std::string> buffers = {},
                                   std::string* msg_id = nullptr) const;
    // Starts the client's signature of a large kernel message (scratch_) on
    // another thread; Io uses it if the core forwards the message unchanged.
    void sign_early();
    // Null once closed.
    RelaySocket* outer_socket(Channel channel);
    // Null before attach().
    RelaySocket* inner_socket(Channel channel);

    std::string session_id_;
    std::string server_session_;  // the "session" field of headers the server writes
    ProxyOptions options_;
    ConnectionInfo outer_;
    Signer outer_signer_;
    Signer inner_signer_{""};
    ReplayGuard replay_;
    ReceiveRules client_rules_, kernel_rules_;

    std::unique_ptr<RelaySocket> outer_shell_, outer_control_, outer_stdin_, outer_iopub_,
        outer_hb_;
    std::unique_ptr<RelaySocket> inner_shell_, inner_control_, inner_stdin_, inner_iopub_,
        inner_hb_;
    std::unique_ptr<Sandbox> sandbox_;
    std::unique_ptr<SessionIo> io_;
    std::unique_ptr<SessionCore> core_;
    Multipart scratch_;
    struct EarlySignature {
        std::future<std::string> signature;
        const void* content = nullptr;     // which message it signs
        std::vector<Frame> keep;           // the large frames it reads, shared
        std::array<std::string, 4> small;  // the small ones, copied
    };
    static constexpr std::size_t kEarlySignBytes = 256 << 10;
    std::optional<EarlySignature> early_;
    EventLoop& loop_;
    std::optional<EventLoop::WatchId> lifeline_watch_;
    EventLoop::WatchId deadline_ = 0;
};

}  // namespace cellblock
