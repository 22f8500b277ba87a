// One session's relay between the client's five channels (outer key) and
// the sandboxed kernel's five channels (inner key). Everything the kernel
// sends is treated as hostile: a message whose parent is not a request of
// this session is dropped, and each request gets at most one reply. With a
// SessionGovernor, the session's policy is enforced on the stream: execution
// cap, per-execution timeout, idle timeout and lifetime, output shaping.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
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
#include "inner_channels.hpp"
#include "multipart.hpp"

namespace cellblock {

// What the server records about a session (the audit trail); called on the
// server's loop thread.
class SessionObserver {
  public:
    virtual ~SessionObserver() = default;
    virtual void on_execution(const ExecutionRecord& record) = 0;
    virtual void on_state(const std::string& session_id, const std::string& state) = 0;
    virtual void on_event(const std::string& session_id, const std::string& kind,
                          const std::string& detail) = 0;
    virtual void on_closed(const std::string& session_id, const std::string& reason) = 0;
};

struct ProxyOptions {
    WireLimits outer_limits;
    WireLimits inner_limits;
    std::chrono::milliseconds shutdown_grace{3000};
    int max_frame_bytes = 64 << 20;         // ZMQ_MAXMSGSIZE on the kernel's sockets
    int max_client_frame_bytes = 16 << 20;  // and on the client's: code and comms are small
    // Server mode: the policy to enforce (none in kernel mode).
    const ServerPolicy* policy = nullptr;
    std::optional<SessionLimits> limits;
    SessionObserver* observer = nullptr;
    bool audit_code_hash_only = false;
    // How a closed session's sandbox is destroyed (default: here and now).
    std::function<void(std::unique_ptr<Sandbox>)> dispose;
};

class SessionProxy {
  public:
    static constexpr std::size_t kPollItems = 10;

    // Binds the outer channels of `outer`; a port of 0 binds a free port
    // (see outer_connection()). Throws zmq::error_t.
    SessionProxy(zmq::context_t& context, std::string session_id, const ConnectionInfo& outer,
                 ProxyOptions options = {});
    ~SessionProxy();
    SessionProxy(const SessionProxy&) = delete;
    SessionProxy& operator=(const SessionProxy&) = delete;

    // Takes a started sandbox and the channels probe_kernel() connected to
    // its kernel, and starts relaying.
    void attach(std::unique_ptr<Sandbox> sandbox, InnerChannels channels);

    // Appends exactly kPollItems entries; handle() receives a pointer to them.
    void add_poll_items(std::vector<zmq::pollitem_t>& items);
    void handle(const zmq::pollitem_t* items);
    // Earliest time on_timer() must run, if any.
    std::optional<Clock::time_point> next_deadline() const;
    void on_timer(Clock::time_point now);

    // Ends the session: answers what is pending, kills and disposes of the
    // sandbox. The outer shell, control and iopub stay bound, answering
    // SessionClosed, until expired() (policy closed_channels_s).
    void close(const std::string& reason);
    bool closed() const { return closed_; }
    // True once a closed session has answered SessionClosed long enough.
    bool expired(Clock::time_point now) const;
    const std::string& close_reason() const { return close_reason_; }
    const std::string& session_id() const { return session_id_; }
    const ConnectionInfo& outer_connection() const { return outer_; }
    Sandbox* sandbox() { return sandbox_.get(); }
    const SessionGovernor* governor() const { return governor_ ? &*governor_ : nullptr; }
    std::string state() const;
    // Over the session's executions so far; at close, over its whole life
    // (the registry keeps them).
    std::uint64_t memory_peak_bytes() const { return memory_peak_bytes_; }
    std::uint64_t cpu_ms() const { return cpu_ms_total_; }
    // When the running execution started (none: the kernel is idle), and
    // when the last one ended: what CPU fairness needs to tell a long
    // computation (or work left running in the background) from short cells.
    std::optional<Clock::time_point> running_since() const {
        return execution_ ? std::optional(execution_->started) : std::nullopt;
    }
    Clock::time_point idle_since() const { return idle_since_; }

  private:
    struct PendingRequest {
        Channel channel;
        std::vector<std::string> identities;
        std::string msg_type;
        std::string header;  // raw bytes, to parent replies the server writes itself
    };
    struct Execution {
        std::string msg_id;
        std::string code;
        std::int64_t count = 0;
        double started_at = 0;
        Clock::time_point started{};
        std::uint64_t cpu_ns_at_start = 0;
        std::uint64_t output_bytes = 0;
        Clock::time_point deadline{};
        std::optional<Clock::time_point> kill_at;  // set once interrupted
        double timeout_s = 0;
        bool idle_seen = false;  // the kernel's idle for it came before its reply
    };

    void on_outer_request(Channel channel);
    // A verified, parsed client request: policy, then forward to the kernel.
    void dispatch_request(Channel channel, std::vector<zmq::message_t>& frames,
                          const WireLayout& at, const nlohmann::json& header,
                          const nlohmann::json& metadata, const nlohmann::json& content);
    // Starts the next queued execute once the running one has finished.
    void drain_queue(bool previous_failed);
    void on_outer_stdin();
    void on_outer_heartbeat();
    void on_inner_reply(Channel channel);
    void on_inner_iopub();
    void on_inner_stdin();
    void on_inner_heartbeat();
    void on_lifeline();

    void answer_interrupt(const PendingRequest& request);
    // Busy, an error on iopub (for execute), the error reply, idle.
    void refuse(const PendingRequest& request, const std::string& ename, const std::string& evalue);
    void fail_pending(const std::string& ename, const std::string& evalue);
    // Kills the kernel under a running execution (audited with
    // `execution_status`), answers what is pending with `ename`, and closes
    // the session for `close_reason`.
    void kill_for(const std::string& ename, const std::string& evalue,
                  const std::string& execution_status, const std::string& close_reason);
    void finish_execution(const std::string& status, const std::string& ename);
    // The audit record of the running execution, up to its resource figures.
    ExecutionRecord execution_record(const std::string& status, const std::string& ename) const;
    void remember_parent(const std::string& msg_id);
    bool known_parent(std::string_view msg_id) const;
    void publish_status(const nlohmann::json& parent, const char* state);
    void send_reply(const PendingRequest& request, const std::string& msg_type,
                    nlohmann::json content);
    void publish(const nlohmann::json& parent, const std::string& msg_type, nlohmann::json content);
    void forward_to_outer(zmq::socket_t& socket, const std::vector<std::string>* identities,
                          std::vector<zmq::message_t>& frames, const WireLayout& at,
                          const std::string* new_metadata, const std::string* new_content);
    void release_held_reply();
    zmq::socket_t& outer_socket(Channel channel);
    zmq::socket_t& inner_socket(Channel channel);
    void reject(const char* channel, std::string_view identity, const std::string& why);
    void notify_state(const char* state);

    std::string session_id_;
    std::string server_session_;  // the "session" field of headers the server writes
    ProxyOptions options_;
    ConnectionInfo outer_;
    Signer outer_signer_;
    Signer inner_signer_{""};
    ReplayGuard replay_;
    std::optional<SessionGovernor> governor_;

    zmq::socket_t outer_shell_, outer_control_, outer_stdin_, outer_iopub_, outer_hb_;
    zmq::socket_t inner_shell_, inner_control_, inner_stdin_, inner_iopub_, inner_hb_;
    std::unique_ptr<Sandbox> sandbox_;

    std::unordered_map<std::string, PendingRequest> pending_;
    std::deque<std::string> recent_order_;
    std::unordered_set<std::string> recent_;
    std::unordered_set<std::string> probe_ids_;
    // Output outside the running execution (a thread an earlier cell started
    // keeps printing under that cell's parent): capped like an execution's.
    std::uint64_t background_bytes_ = 0;
    // Bookkeeping messages (status, execute_input, clear_output) pass outside
    // the budget only while small and few per request.
    std::unordered_map<std::string, int> free_passes_;
    bool background_marker_sent_ = false;
    static constexpr std::size_t kMaxPendingRequests = 4096;
    std::uint64_t memory_peak_bytes_ = 0;
    std::uint64_t cpu_ms_total_ = 0;
    std::uint64_t cpu_ns_at_attach_ = 0;  // the kernel's start is not the session's
    std::optional<Execution> execution_;
    Clock::time_point idle_since_ = Clock::now();
    // The running execution's reply, held until the kernel's idle status for
    // it has arrived on iopub, so all its output is shaped and counted first.
    struct HeldReply {
        PendingRequest request;
        std::vector<zmq::message_t> frames;
        WireLayout layout;
        Clock::time_point release_by;
    };
    std::optional<HeldReply> held_reply_;
    // The last finished execution: its late output (past a held reply's
    // deadline on a loaded machine) is still shaped as that execution's.
    std::string last_execution_id_;
    // Executes sent while one runs (a notebook's "Run All"), in order.
    struct QueuedRequest {
        Channel channel;
        std::vector<zmq::message_t> frames;
        WireLayout layout;
        nlohmann::json header, metadata, content;
    };
    std::deque<QueuedRequest> queue_;
    static constexpr std::size_t kMaxQueuedExecutes = 256;

    std::optional<Clock::time_point> shutdown_deadline_;
    std::optional<PendingRequest> shutdown_request_;
    bool closed_ = false;
    Clock::time_point closed_at_{};
    std::string close_reason_;
    Multipart scratch_;
};

}  // namespace cellblock
