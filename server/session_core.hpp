// One session's relay rules, with no I/O: the pure core behind SessionProxy.
//
// The core takes events (a verified request from the client, a verified
// message from the kernel, the kernel's exit, a tick of the clock) with the
// time they happen, and acts through a SessionIo: send this to the client or
// the kernel, interrupt, kill, release the kernel. It holds the ledger of
// open requests, the execution state machine (one execution at a time, the
// rest queued; the reply held until the kernel's idle), the policy
// (SessionGovernor) and output shaping. Everything the kernel sends is
// hostile: a message whose parent is not a request of this session is
// dropped and each request gets at most one reply.
//
// No sockets, no clock reads, no syscalls: tests/unit/session_core_test.cpp
// drives it with a recording SessionIo and a clock of its own.
//
// Over 500 lines with a reason: this is the core's whole contract, in both
// directions (the events it takes, SessionIo's verbs it calls, the observer
// it tells, and the state the server reads back for hibernation, handover and
// fairness), each commented; the state itself is in session_core.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/sandbox.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/session_store.hpp"
#include "session_snapshots.hpp"
#include "session_state.hpp"
#include "wire_receive.hpp"

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
    // A message the relay dropped (SessionIo::rejected), for the metrics.
    virtual void on_rejected(std::string_view /*where*/, std::string_view /*why*/) {}
    // The requests open at the kernel or queued for it changed (what a
    // restart after a crash must know: in_flight()).
    virtual void on_requests_changed(const std::string& /*session_id*/) {}
};

// How the kernel ended, read once its process is gone.
struct KernelExit {
    bool oom = false;
    std::string description;
    // The machine it ran on was lost (a Swarm node down): its state is gone.
    bool node_lost = false;
};

// What the core asks of the world. SessionProxy does it with sockets and
// the sandbox; the unit tests record it.
class SessionIo {
  public:
    virtual ~SessionIo() = default;
    // The client's side has two kinds of destination: a reply routed to the
    // client that asked (shell, control, stdin: `identities`, the request's
    // routing frames), and output published on iopub to every subscriber.
    //
    // A kernel's reply (or input_request), re-signed with the client's key,
    // routed to `identities` on `channel`, its metadata replaced if given.
    virtual void forward_reply(Channel channel, const std::vector<std::string>& identities,
                               InboundMessage& msg, const std::string* new_metadata) = 0;
    // A kernel's iopub message, re-signed, published under its own topic
    // frames, its content replaced if given (buffers beyond `msg.frames`
    // were cut by the core).
    virtual void forward_output(InboundMessage& msg, const std::string* new_content) = 0;
    // A reply the server writes itself (a refusal), parented on `parent`.
    virtual void send_reply(Channel channel, const std::vector<std::string>& identities,
                            const nlohmann::json& parent, const std::string& msg_type,
                            nlohmann::json content) = 0;
    // An iopub message the server writes itself (a status, an error, a marker).
    virtual void publish(const nlohmann::json& parent, const std::string& msg_type,
                         nlohmann::json content) = 0;
    // A client message, re-signed with the kernel's key. False: the kernel's
    // queue is full and the message was dropped.
    virtual bool forward_to_kernel(Channel channel, InboundMessage& msg) = 0;
    virtual void interrupt_kernel() = 0;
    virtual void kill_kernel() = 0;
    virtual SandboxUsage kernel_usage() = 0;
    // The kernel's own report of its cgroup (Sandbox::take_reported_usage):
    // true if the sandbox took it as its usage.
    virtual bool kernel_reported_usage(const SandboxUsage& usage) = 0;
    virtual KernelExit kernel_exit() = 0;
    // The session closed: kill and dispose of the sandbox and close the
    // channels a closed session does not answer on.
    virtual void release_kernel() = 0;
    // A request of the relay's own to the kernel (a snapshot's save or
    // restore), signed with the kernel's key; returns its msg_id.
    virtual std::string send_to_kernel(Channel channel, const std::string& msg_type,
                                       nlohmann::json content) = 0;
    using Moved = std::function<void(const std::string* why_not)>;
    // Hibernation: the kernel is about to write its snapshot (the server
    // may begin keeping it while it is written), or a save begun will not
    // reach put_to_sleep() (it failed, or timed out).
    virtual void saving_snapshot() {}
    virtual void snapshot_unsaved() {}
    // Hibernation, once the kernel saved its snapshot (`report`: what
    // cellblock_snapshot said of it): keep the snapshot and let the sandbox
    // go, the client's channels staying bound. `done` gets null once it is
    // asleep, or why the snapshot could not be kept (the session stays as it
    // was); now or in a later turn (the server seals it on another thread),
    // and not at all once the session is closed meanwhile.
    virtual void put_to_sleep(const nlohmann::json& report, Moved done) = 0;
    // The exact level (docs/hibernation.md): whether this session's sandbox
    // is checkpointed whole instead (a bridged runsc sandbox), and doing
    // so: the shim quiesced, the runtime's image kept sealed, the sandbox
    // gone. `done` gets null once it is asleep, or why not with `awake`:
    // true when nothing had changed yet (the session stays as it was),
    // false when the sandbox was already quiesced (the session cannot go on).
    using Checkpointed = std::function<void(const std::string* why_not, bool awake)>;
    virtual bool exact_level() const { return false; }
    virtual void checkpoint(Checkpointed done) {
        const std::string why = "this session's sandbox cannot be checkpointed";
        done(&why, true);
    }
    // Whether the snapshot the session sleeps on is exact (its wake is the
    // runtime's restore, with no kernel restore to run).
    virtual bool snapshot_exact() const { return false; }
    // A sandbox with no directory on this host (a Swarm task) moves its
    // snapshot through its kernel: out of it once the kernel saved it,
    // before put_to_sleep(), and into the next one (with the session's
    // inputs) before it restores. `done` gets null, or why not; here at
    // once, where the files are on this host.
    virtual void fetch_snapshot(Moved done) { done(nullptr); }
    virtual void place_snapshot(Moved done) { done(nullptr); }
    // Whether put_to_sleep() could keep a snapshot of this sandbox at all;
    // false with `why` (no snapshot store, a backend with no files here).
    virtual bool can_sleep(std::string& why) const = 0;
    // A hibernated session was asked something: get it a sandbox with its
    // snapshot in reach; on_kernel_attached() follows, or close().
    virtual void wake() = 0;
    // Whether the session's clients listen on iopub (a subscription came):
    // an adopted session holds requests until then, so that the outputs of
    // the first are not published to nobody (docs/restarts.md).
    virtual bool clients_listening() const { return true; }
    // An adopted session's iopub keeps what is published while no client has
    // subscribed, for its first subscriber, for at most `for_at_most`: a
    // client slower to subscribe again than adopt_settle still gets the
    // outputs and statuses of what ran meanwhile.
    virtual void hold_outputs_for_listener(std::chrono::milliseconds /*for_at_most*/) {}
    // Whether a client with this routing identity is connected on shell
    // (true where the transport cannot tell).
    virtual bool client_connected(const std::string& /*identity*/) const { return true; }
    // A message dropped by the relay's rules, for the log; `identity` is the
    // client's routing identity (empty for the kernel's messages).
    virtual void rejected(std::string_view where, std::string_view identity,
                          const std::string& why) = 0;
    // Something the operator should see in the log (a kill, a timeout).
    virtual void log(const std::string& what) = 0;
};

// The core's numbers; defaults are what serve and kernel mode use.
struct CoreOptions {
    std::string session_id;
    // Server mode: the policy to enforce (none in kernel mode).
    const ServerPolicy* policy = nullptr;
    std::optional<SessionLimits> limits;
    SessionObserver* observer = nullptr;
    bool audit_code_hash_only = false;
    std::chrono::milliseconds shutdown_grace{3000};
    std::size_t max_json_depth = 64;
    // How long an execute_reply waits for its idle status. Only a kernel that
    // never sends idle (a hostile one) waits this long, for its own reply.
    std::chrono::milliseconds reply_hold_limit{30000};
    // After the kernel's exit, how long replies it sent just before may still arrive.
    std::chrono::milliseconds kernel_exit_drain{200};
    std::size_t max_pending = 4096;    // requests open at the kernel
    std::size_t max_queued = 256;      // executes waiting behind the running one
    std::size_t recent_parents = 256;  // requests whose late output is still known
    // Bookkeeping output (status, execute_input, clear_output) outside any
    // execution passes outside the budget only while small and few.
    std::size_t free_pass_bytes = 2048;
    int free_passes = 4;  // busy, idle, execute_input, a clear_output
    // Wall-clock seconds minus steady-clock seconds: the audit's timestamps.
    double unix_minus_steady_s = 0;
    // Hibernation (docs/hibernation.md): where the kernel writes its
    // snapshot (its output dir, which the server reads from the host) and
    // where the next kernel finds it (its input dir, which the server
    // writes), and how long either may take.
    std::string snapshot_save_path = std::string("/data/output/") + kSnapshotFile;
    std::string snapshot_restore_path = std::string("/data/input/") + kSnapshotFile;
    std::chrono::milliseconds snapshot_timeout{300000};
    // After an adoption, the longest requests wait for a subscriber on
    // iopub (clients_listening): a client that never subscribes is served then.
    std::chrono::milliseconds adopt_settle{2000};
    // From the adoption, what is published while no client has subscribed
    // is kept this long for the first subscriber (hold_outputs_for_listener).
    std::chrono::milliseconds adopt_output_hold{30000};
};

// What a session carries from its server to the next (docs/restarts.md),
// beside its snapshot: the policy's counters and the requests that came
// once the handover began, verified, as their frames.
struct HandoverState {
    std::int64_t executions = 0;
    double age_s = 0;   // since the session was created
    double idle_s = 0;  // since its last client request
    std::uint64_t cpu_ms = 0, memory_peak_bytes = 0, network_bytes = 0;
    struct Request {
        Channel channel = Channel::shell;
        std::vector<std::string> frames;
    };
    std::vector<Request> requests;
    // After a crash (phase 2): the requests the kernel had been sent and not
    // yet answered. Its replies, if it sends them once the next server is
    // attached, reach their clients; a reply sent while no server ran is
    // lost, and answered ServerRestarting instead.
    struct InKernel {
        Channel channel = Channel::shell;
        std::vector<std::string> identities;
        std::string msg_type;
        nlohmann::json header;
    };
    std::vector<InKernel> in_kernel;
    // The requests answered last (SessionCore::kAnsweredKept; their msg_id
    // and header date, SessionCore::request_key):
    // one a client sends again after the restart had its reply, maybe lost
    // with the server, and is not run again.
    std::vector<std::string> answered;
};

class SessionCore {
  public:
    SessionCore(CoreOptions options, SessionIo& io, Clock::time_point now);

    // The kernel is up: `probe_ids` are the readiness probe's requests, whose
    // late output no client asked for.
    void on_kernel_attached(Clock::time_point now, const std::vector<std::string>& probe_ids);
    // A wake whose snapshot is still being opened into the new sandbox
    // while its kernel reads it (SnapshotPlacing::follow): told before the
    // kernel is attached, with the snapshot's final size (the kernel reads
    // up to it). The session is awake once the kernel's restore answered and
    // snapshot_placed() said the opening ended well; a failed one closes it
    // (resume_failed).
    void placing_snapshot(std::uint64_t bytes);
    void snapshot_placed(Clock::time_point now, const std::string* failed);
    // A verified request on shell or control.
    void on_client_request(Clock::time_point now, Channel channel, InboundMessage msg);
    // A verified message on the client's stdin (input_reply).
    void on_client_input(Clock::time_point now, InboundMessage msg);
    // A verified message from the kernel's shell or control.
    void on_kernel_reply(Clock::time_point now, Channel channel, InboundMessage msg);
    void on_kernel_iopub(Clock::time_point now, InboundMessage msg);
    void on_kernel_input_request(Clock::time_point now, InboundMessage msg);
    // The kernel's process is gone (its lifeline closed).
    void on_kernel_exit(Clock::time_point now);
    void on_tick(Clock::time_point now);
    // Earliest time on_tick() must run, if any.
    std::optional<Clock::time_point> next_deadline(Clock::time_point now) const;
    // Ends the session: answers what is pending and releases the kernel. The
    // adapter keeps answering SessionClosed until expired(). What was pending
    // is answered `ename` (ServerShuttingDown when the server stops) with
    // "<why>: <reason>".
    void close(Clock::time_point now, const std::string& reason,
               const char* ename = ename::SessionClosed,
               const std::string& why = "the session closed");
    // Hibernates the session if it is idle with nothing open: the kernel
    // saves its snapshot, then its sandbox goes (SessionIo::put_to_sleep).
    // False with why when it cannot start now.
    bool hibernate(Clock::time_point now, std::string& why);
    // Wakes a hibernated session now, as its next request would.
    bool resume(Clock::time_point now, std::string& why);
    // Its sandbox's node is being drained (Sandbox::moving): the session
    // hibernates as soon as it is idle with nothing open, and wakes at once
    // in a new sandbox (on another node). Requests that come meanwhile wait,
    // as for any hibernation. If it cannot (no policy to hibernate under,
    // the kernel's save fails, or it is still busy when the node's grace
    // ends) its kernel's end closes it, and the close reason says so.
    void move_away(Clock::time_point now);
    // The server hands its sessions to the next one (docs/restarts.md): from
    // now the session takes no new work (requests wait, not woken for, an
    // interrupt of the running execution excepted) and hibernates once idle
    // with nothing open. A session that cannot reports hibernate_failed.
    // With `hibernate` false the next start adopts its sandbox instead
    // (SIGHUP with adoption on): it stays as it is, and is settled once idle
    // with nothing open at its kernel; a busy one is left running anyway at
    // --takeover-wait.
    void hand_over(Clock::time_point now, bool hibernate = true);
    bool handing_over() const { return handing_over_; }
    // Hibernated, closed, or (left running) idle with nothing open: nothing
    // more will change before the handover.
    bool handover_settled() const;
    HandoverState handover_state(Clock::time_point now) const;
    // The next server: a session handed over hibernated, with its counters;
    // its requests are given to on_client_request after, and wake it.
    void take_over(Clock::time_point now, const HandoverState& state);
    // The next server after a crash: a session whose sandbox ran on, with
    // its counters (executions, age) and the requests its kernel had open
    // (state.in_kernel); the kernel is attached next, and the queued
    // requests (state.requests) handed to on_client_request after.
    void adopt(Clock::time_point now, const HandoverState& state);
    // What a crash now would leave open: requests at the kernel (in_kernel)
    // and the executions queued behind the running one (requests).
    HandoverState in_flight() const;
    // What names a request for telling one sent again (after a restart)
    // from another: msg_id, msg_type and date (HandoverState::answered).
    static std::string request_key(const nlohmann::json& header);

    bool kernel_live() const { return lifecycle_.kernel_live(); }
    // Hibernating, hibernated or resuming: requests wait for it to wake.
    bool asleep() const;
    // Closing or closed (close() has begun).
    bool closed() const { return lifecycle_.ending(); }
    SessionState lifecycle_state() const { return lifecycle_.state(); }
    bool expired(Clock::time_point now) const;
    const std::string& close_reason() const { return close_reason_; }
    const std::string& session_id() const { return options_.session_id; }
    const SessionGovernor* governor() const { return governor_ ? &*governor_ : nullptr; }
    std::string state() const;
    std::uint64_t memory_peak_bytes() const { return memory_peak_bytes_; }
    // Bytes the egress gateway relayed for the session (connections ended so
    // far): on every execute_reply of a gateway session, against max_bytes.
    void add_network_bytes(std::uint64_t bytes) { network_bytes_ += bytes; }
    std::uint64_t network_bytes() const { return network_bytes_; }
    std::uint64_t cpu_ms() const { return cpu_ms_total_; }
    // An execution's start, or the snapshot's save or restore's: the relay's
    // own work is the session's, not idle use the CPU balancer would demote.
    std::optional<Clock::time_point> running_since() const {
        if (execution_) return execution_->started;
        if (own_) return own_->started;
        return std::nullopt;
    }
    Clock::time_point idle_since() const { return idle_since_; }

  private:
    // A request is open at the kernel or waits for it (an execution, the
    // queue, a held reply, a shutdown): the session cannot hibernate now.
    bool requests_open() const;
    // Idle, nothing open, and a snapshot could be kept: hibernate_after_s
    // applies. A request still open at the kernel (an answer slow under
    // load) puts the hibernation off until it is answered, not for good.
    bool free_to_sleep() const;
    struct PendingRequest {
        Channel channel;
        std::vector<std::string> identities;
        std::string msg_type;
        nlohmann::json header;  // to parent what the server writes itself
    };
    struct Execution {
        std::string msg_id;
        std::string code;
        std::int64_t count = 0;
        Clock::time_point started{};
        std::uint64_t cpu_ns_at_start = 0;
        std::uint64_t output_bytes = 0;
        Clock::time_point deadline{};
        std::optional<Clock::time_point> kill_at;  // set once interrupted
        double timeout_s = 0;
        bool idle_seen = false;  // the kernel's idle for it came before its reply
    };
    struct HeldReply {
        PendingRequest request;
        InboundMessage message;
        Clock::time_point release_by;
    };
    struct QueuedRequest {
        Channel channel;
        InboundMessage message;
    };
    // A request of the relay's own at the kernel: a snapshot's save or restore.
    struct OwnRequest {
        std::string msg_id;
        bool restore = false;
        Clock::time_point started, deadline;
    };
    using RequestHandler = bool (SessionCore::*)(Clock::time_point, Channel, InboundMessage&,
                                                 PendingRequest&);

    // Request handlers by msg_type; true: forward to the kernel.
    bool on_interrupt_request(Clock::time_point now, Channel channel, InboundMessage& msg,
                              PendingRequest& request);
    bool on_execute_request(Clock::time_point now, Channel channel, InboundMessage& msg,
                            PendingRequest& request);
    void dispatch_request(Clock::time_point now, Channel channel, InboundMessage msg);
    // Starts the next queued execute once the running one has finished.
    void drain_queue(Clock::time_point now, bool previous_failed);

    // The iopub rules, by what the message is.
    void shape_outside_execution(InboundMessage& msg);
    // Forwards a rich message with its content replaced by a text/plain notice.
    void replace_with_notice(InboundMessage& msg, const std::string& what);
    void shape_execution_output(Clock::time_point now, InboundMessage& msg);

    void release_held_reply(Clock::time_point now);
    void refuse(const PendingRequest& request, const std::string& ename, const std::string& evalue);
    void fail_pending(const std::string& ename, const std::string& evalue);
    void kill_for(Clock::time_point now, const std::string& ename, const std::string& evalue,
                  const std::string& execution_status, const std::string& close_reason);
    void finish_execution(Clock::time_point now, const std::string& status,
                          const std::string& ename);
    ExecutionRecord execution_record(Clock::time_point now, const std::string& status,
                                     const std::string& ename) const;
    void remember_parent(const std::string& msg_id);
    bool known_parent(const std::string& msg_id) const;
    void publish(const nlohmann::json& parent, const std::string& msg_type, nlohmann::json content);
    void publish_status(const nlohmann::json& parent, const char* state);
    void reply(const PendingRequest& request, const std::string& msg_type, nlohmann::json content);
    // Moves the lifecycle and tells the observer.
    void move_to(SessionState to);
    // An execution ended: busy becomes idle (not while closing).
    void execution_ended();
    void event(const std::string& kind, const std::string& detail);

    // Hibernation's steps (session_sleep.cpp).
    void send_own(Clock::time_point now, bool restore);
    void on_own_reply(Clock::time_point now, InboundMessage& msg);
    // The kernel's restore answered (`content`: its reply's, if it parsed),
    // and the snapshot's opening ended well.
    void restored(Clock::time_point now, const std::optional<nlohmann::json>& content);
    // The saved snapshot is where put_to_sleep() keeps it from (or not: `failed`).
    void snapshot_fetched(Clock::time_point now, const nlohmann::json& report,
                          const std::string* failed);
    void hibernation_failed(Clock::time_point now, const std::string& why);
    // put_to_sleep() answered: asleep, or not (`failed`).
    void snapshot_kept(Clock::time_point now, const nlohmann::json& report,
                       const std::string* failed);
    void wake(Clock::time_point now);
    // Handing over: hibernates once idle with nothing open.
    void settle_handover(Clock::time_point now);
    void replay_asleep(Clock::time_point now);
    // Puts resumed_ms and lost in the first reply's metadata.cellblock.
    void mark_resumed(nlohmann::json& metadata);
    // Names what was lost on stderr, once, in the first execution after a
    // resume: just after its busy (between busy and idle, where a client
    // collects a cell's output), else at its reply.
    void tell_lost(const nlohmann::json& parent);
    // The kernel's figures so far, kept before its sandbox goes.
    void keep_usage();

    CoreOptions options_;
    SessionIo& io_;
    std::optional<SessionGovernor> governor_;
    SessionLifecycle lifecycle_;
    bool kernel_exited_ = false;
    Clock::time_point closed_at_{};
    std::string close_reason_;

    std::unordered_map<std::string, PendingRequest> pending_;
    std::deque<std::string> recent_order_;
    std::unordered_set<std::string> recent_;
    std::unordered_set<std::string> probe_ids_;
    std::unordered_map<std::string, int> free_passes_;
    // Output outside the running execution (a thread an earlier cell started
    // keeps printing under that cell's parent): capped like an execution's.
    std::uint64_t background_bytes_ = 0;
    bool background_marker_sent_ = false;
    std::optional<Execution> execution_;
    std::optional<HeldReply> held_reply_;
    // The last finished execution: its late output (past a held reply's
    // deadline on a loaded machine) is still shaped as that execution's.
    std::string last_execution_id_;
    std::deque<QueuedRequest> queue_;  // executes sent while one runs, in order
    std::optional<Clock::time_point> shutdown_deadline_;
    std::optional<PendingRequest> shutdown_request_;

    std::uint64_t memory_peak_bytes_ = 0;
    std::uint64_t cpu_ms_total_ = 0;
    std::uint64_t network_bytes_ = 0;
    std::uint64_t cpu_ns_at_attach_ = 0;          // the kernel's start is not the session's
    std::uint64_t cpu_ms_earlier_sandboxes_ = 0;  // before the last hibernation
    Clock::time_point idle_since_{};

    std::optional<OwnRequest> own_;
    bool handing_over_ = false;
    bool handover_failed_ = false;     // could not hibernate for it: the server closes it
    bool handover_hibernates_ = true;  // false: left running for the next start to adopt
    bool moving_ = false;              // move_away: hibernates once free, then wakes
    // Moving, idle and nothing open at the kernel: its hibernation starts now.
    bool due_to_move() const;
    // No execution, reply or request open at the kernel, none queued for it.
    bool nothing_open() const;
    Clock::time_point settle_at_{};  // when settle_handover looks again
    // Adopted with its kernel attached: until when requests wait for a
    // subscriber (adopt_settle), and when settle_adoption looks next (a
    // subscription is seen only by looking). A fixed time: one computed
    // from `now` in next_deadline would move on with every look, never due.
    std::optional<Clock::time_point> adopt_settle_until_;
    Clock::time_point adopt_look_at_{};
    // Requests the last server had sent the kernel (adopt): answered by the
    // kernel's reply if it comes, else ServerRestarting once the adoption settles.
    std::map<std::string, PendingRequest> carried_;
    // Replies to carried requests that came before the clients were back.
    std::vector<std::pair<PendingRequest, InboundMessage>> carried_replies_;
    // A kernel_info the relay sent on shell after the adoption: its reply
    // comes after the replies to every shell request sent before it (the
    // kernel serves shell in order), so a carried one still open by then
    // lost its reply with the server.
    std::string carried_fence_;
    bool fence_passed_ = false;
    // Carried shell requests whose idle status the kernel may have published
    // while no server ran (a reply it kept, cellblock_unrelayed.KeptReplies):
    // each is published here once the fence's own idle status shows the
    // kernel's went by (iopub is in order), unless the kernel's came.
    std::map<std::string, nlohmann::json> idle_owed_;
    std::string fence_status_id_;
    bool fence_idle_seen_ = false;
    // The requests answered last (request_key: msg_id and date, oldest
    // first): by this server
    // (answered_), by the one before a crash (answered_before_, from its
    // record). A client that saw its connection drop sends what it had open
    // again under the same msg_id (sent_again).
    static constexpr std::size_t kAnsweredKept = 32;
    std::deque<std::string> answered_;
    std::unordered_set<std::string> answered_before_;
    // The kernel's replies to those, sent again at the fence's asking (by
    // their parent's msg_id).
    std::map<std::string, InboundMessage> resent_;
    void note_answered(const nlohmann::json& header);
    bool sent_again(const InboundMessage& msg, Channel channel);
    void note_owed_idle(const InboundMessage& msg);
    void publish_owed_idles();
    // Forwards (or, while adopting, holds) a reply to a carried request;
    // false: not one.
    bool reply_carried(Channel channel, InboundMessage& msg);
    // Answers the carried requests whose replies are lost (ServerRestarting).
    void answer_lost_carried();
    void requests_changed();
    // The adoption is over: idle, and the requests that waited go on.
    void settle_adoption(Clock::time_point now);
    // A waiting request as the frames a restart carries (handover, adoption).
    static HandoverState::Request as_frames(const QueuedRequest& queued);
    // Requests that came while the session slept or was being put to sleep,
    // in order: replayed once it is awake.
    std::deque<QueuedRequest> asleep_;
    Clock::time_point sleep_started_{};  // hibernating, then resuming, began
    // The wake under way is the runtime's restore (SessionIo::snapshot_exact):
    // the kernel comes back whole, with no restore of its own to run.
    bool exact_wake_ = false;
    // A followed opening (placing_snapshot): the snapshot's size while the
    // opening goes on, and the kernel's restore reply if it came first (it
    // waits for the opening's end).
    std::optional<std::uint64_t> placing_bytes_;
    std::optional<std::optional<nlohmann::json>> restore_waiting_;
    // What the first reply after a resume, of any kind, says
    // (metadata.cellblock): resumed_ms and what was lost.
    std::optional<nlohmann::json> resumed_;
    // What was lost, to be named on stderr by the first execution after the
    // resume (the first reply may be a kernel_info's).
    nlohmann::json lost_to_tell_ = nlohmann::json::array();
};

}  // namespace cellblock
