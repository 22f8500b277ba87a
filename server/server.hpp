// The server of `cellblock serve`, private to server/: one class, its parts
// in files by concern. server_startup.cpp (state dir, lock, images, pool,
// manager socket), manager_api.cpp (the manager's requests, one handler
// each), session_creation.cpp (creates waiting for a sandbox, warm and cold
// starts, the hand-out to a SessionProxy), server_mode.cpp (the audit trail,
// CPU fairness, image versions and the loop).
#pragma once

#include "server_mode.hpp"

#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <unordered_map>

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include "audit_trail.hpp"
#include "background_work.hpp"
#include "cellblock/connection_info.hpp"
#include "cellblock/cpu_fairness.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/host_contention.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/runc_backend.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_pool.hpp"
#include "cellblock/session_store.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/unique_fd.hpp"
#include "cellblock/wire_message.hpp"
#include "egress_gateway.hpp"
#include "event_loop.hpp"
#include "file_transfer.hpp"
#include "inner_channels.hpp"
#include "local_files.hpp"
#include "manager_api.hpp"
#include "manager_paths.hpp"
#include "multipart.hpp"
#include "server_metrics.hpp"
#include "session.hpp"
#include "session_proxy.hpp"
#include "session_requests.hpp"
#include "session_snapshots.hpp"
#include "snapshot_cipher.hpp"
#include "version.hpp"

namespace cellblock {

// Under STATE_DIR, per session with no directory on this host (a Swarm
// task): the front's copy of its files (remote_files.cpp) and its egress
// listener (session_egress.cpp).
inline constexpr const char* kRemoteFilesDir = "remote-files";
inline constexpr const char* kRemoteEgressDir = "remote-egress";
namespace fs = std::filesystem;
using nlohmann::json;

inline constexpr auto kProbeTimeout = std::chrono::seconds(60);
// How often the server checks whether a built image's name moved (a rebuild,
// `image rm`): a readlink and a stat per built image (ImageStore::current_id).
inline constexpr auto kPoolVersionCheck = std::chrono::seconds(2);
// Start-up helpers (server_startup.cpp).
void write_server_file(const fs::path& path, const std::string& endpoint, const std::string& key,
                       const fs::path& files_socket);
UniqueFd hold_server_lock(const fs::path& state_dir);
zmq::context_t make_server_context();
std::vector<Image> load_images(const std::vector<fs::path>& dirs);

class Server final : public SessionObserver, private SessionService {
  public:
    explicit Server(const ServeOptions& options);
    ~Server() override;
    int run();
    // run() ended with the sessions handed over on SIGHUP: the caller execs
    // the server again (on SIGUSR2 it exits; the next start takes them).
    bool handed_over() const { return handed_over_; }

    // SessionObserver
    void on_execution(const ExecutionRecord& record) override;
    void on_state(const std::string& session_id, const std::string& state) override;
    void on_event(const std::string& session_id, const std::string& kind,
                  const std::string& detail) override;
    void on_closed(const std::string& session_id, const std::string& reason) override;
    void on_rejected(std::string_view where, std::string_view why) override;
    void on_requests_changed(const std::string& session_id) override;

  private:
    using Request = ManagerApi::Request;
    struct PendingCreate {
        WireMessage request;
        std::string session_id;
        std::string image;
        SessionLimits limits;
        json metadata;
        Clock::time_point started;
        std::string image_id;  // content id of a built image's root
        Image image_def;       // resolved: what a cold start runs
        // Creates with the same kind can take each other's sandboxes: image,
        // version, runtime and limits.
        std::string kind;
        bool poolable = false;  // the image's pool holds this kind
        // The create is answered ServerBusy at this time: the server's
        // bound on the wait, or earlier, the client's own timeout.
        Clock::time_point deadline;
        std::optional<double> client_timeout_s;
        std::uint64_t ticket = 0;  // the cold start under way for it
        // Not a create: the sandbox a hibernated session wakes in (no request
        // to answer; a failure closes that session).
        std::string resume_of;
    };
    // The manager's requests, each to its Server method (server_startup.cpp).
    void register_requests();
    void reply(const WireMessage& request, json content, std::vector<std::string> buffers = {}) {
        manager_.reply(request, std::move(content), std::move(buffers));
    }
    void reply_error(const WireMessage& request, const std::string& ename,
                     const std::string& evalue) {
        manager_.reply_error(request, ename, evalue);
    }
    void on_pool_results();
    void finish_create(PendingCreate& pending, WarmSandbox warm, double start_ms, bool warm_start);
    // Queued creates, oldest first, take the warm sandboxes the pool holds.
    void serve_from_pool();
    // A started sandbox of `kind` goes to the oldest create of that kind.
    void hand_out(std::uint64_t ticket, const std::string& kind, StartResult result);
    // The cold start of a create that no longer waits: cancelled, or its
    // sandbox goes to the next create of its kind (or is destroyed).
    void release_cold_start(std::uint64_t ticket, const std::string& kind);
    void expire_creates(Clock::time_point now);
    // A signal stops the server: every request in flight (creates waiting,
    // local copies, executions and the requests queued behind them) is
    // answered ServerShuttingDown naming `signal`, and the loop turns until
    // those answers are written (at most kShutdownFlush).
    void shut_down(const std::string& signal);
    // The session a request names, live (RequestError otherwise), and its id.
    SessionProxy& live_session(const json& content) { return session_requests_.live(content); }
    static std::string session_id_of(const json& content) {
        return SessionRequests::session_id_of(content);
    }
    // The session an event is about, for its observers.
    SessionTag tag_of(const std::string& session_id) const;

    // SessionService: what session_list, _info, _close and _history read
    // (session_requests.hpp).
    const SessionStore& registry() const override { return store_; }
    SessionTable& sessions() override { return sessions_; }
    json snapshot(const std::string& session_id) const override {
        return snapshot_json(session_id);
    }
    json backend_inventory() const override;
    SessionRequests session_requests_{*this};

    json session_create(Request& r, std::vector<std::string>& buffers);
    // Hibernation (session_hibernation.cpp, docs/hibernation.md).
    json session_hibernate(Request& r, std::vector<std::string>& buffers);
    json session_resume(Request& r, std::vector<std::string>& buffers);
    // {bytes, kept_at, age_s} of a hibernated session's snapshot, or null.
    json snapshot_json(const std::string& session_id) const;
    // Sealed on a thread of background_ (a GiB took the loop for a second);
    // `done` as ProxyOptions::keep_snapshot says.
    void keep_snapshot(const std::string& session_id, Sandbox& box, const json& report,
                       SessionIo::Moved done);
    // A local sandbox's snapshot is sealed while its kernel writes it
    // (SnapshotStore::begin_streamed_keep): begun as the save is sent, ended
    // by keep_snapshot() once the kernel answered, or dropped (the save
    // failed, the session closed, the server stops).
    struct StreamedKeep {
        std::shared_ptr<SnapshotKeeping> keeping;
        Clock::time_point started;
        bool ended = false;  // its thread is done: `error`, or sealed
        std::string error;
        bool dropped = false;
        // keep_snapshot() came: what it was given.
        std::optional<SessionIo::Moved> done;
        json report;
    };
    void begin_streamed_keep(const std::string& session_id, Sandbox& box);
    void drop_streamed_keep(const std::string& session_id);
    void streamed_keep_ended(const std::shared_ptr<StreamedKeep>& streamed);
    void kept_or_not(const std::shared_ptr<SnapshotKeeping>& keeping, Clock::time_point started,
                     const json& report, const std::string& error, const SessionIo::Moved& done);
    void wake_session(const std::string& session_id);
    // The exact level (session_exact.cpp): a quiesced sandbox checkpointed
    // by its runtime off the loop, its image sealed into the store, then
    // gone; and the wake, a restore of that image into a new sandbox.
    void checkpoint_session(const std::string& session_id, std::unique_ptr<Sandbox> box,
                            SessionIo::Checkpointed done);
    void wake_exact(const std::string& session_id);
    // The snapshot is opened into the sandbox's input dir on a thread of
    // background_, then attach_resumed() hands the sandbox to the session.
    void finish_resume(PendingCreate& pending, WarmSandbox warm);
    void attach_resumed(const std::string& session_id, const SessionLimits& limits,
                        WarmSandbox warm, const std::string& failed);
    // The session's way out through the egress gateway in `sandbox`
    // (session_egress.cpp): the gateway's listener in its ipc dir, or for a
    // Swarm task the tunnel to its kernel (returned, for its Session).
    // Throws std::runtime_error. close_egress ends either.
    std::unique_ptr<EgressTunnel> open_egress(const std::string& session_id, Sandbox& sandbox,
                                              const SessionLimits& limits);
    void close_egress(const std::string& session_id);
    fs::path remote_egress_dir(const std::string& session_id) const;
    // What the server does when the core says a hibernation or a wake ended.
    void on_sleep_event(Session& session, const std::string& kind, const std::string& detail);
    // A create that will not be served: its client is answered, or the
    // session it was to wake is closed.
    void fail_create(PendingCreate& pending, const std::string& ename, const std::string& evalue);
    // What a session of `image_name` runs as (`image_def`: `resolved`, the
    // image's current version, with the runtime the request named): which
    // warm sandboxes fit it, and whether the image's pool holds them.
    SessionOrigin origin_of(const std::string& image_name, const Image& image_def,
                            const Image& resolved, const SessionLimits& limits) const;
    // A planned restart (session_handover.cpp, docs/restarts.md).
    ProxyOptions proxy_options(const std::string& session_id, const SessionLimits& limits);
    // SIGHUP: false (logged) when the server key cannot be had; the server goes on.
    bool begin_handover();
    // Every session hibernated, left running or given up on, or
    // --takeover-wait passed.
    bool handover_ready(Clock::time_point now) const;
    // SIGHUP with adoption on: a session whose sandbox can be adopted is left
    // running for the next start (the exec follows at once), as a crash
    // leaves it; the others hibernate. SIGUSR2's next start may come later
    // than any grace: its sessions all hibernate.
    bool leaves_running(const Session& session) const;
    // Hands each session over: to hibernate, or to be left running.
    void settle_handover();
    // One sealed row per hibernated session, a fresh live row per session
    // left running; the others are closed with why.
    void write_handover();
    // The sessions left running: their rows written again, what they owe
    // their clients sent (bounded), their sandboxes let go of. Returns how many.
    std::size_t leave_running(const std::vector<std::string>& ids);
    std::set<std::string> leave_running_;  // chosen at the signal
    // The next start: the sessions the rows name, and the manager's endpoint and key.
    std::set<std::string> handed_over_sessions() const;
    // The last server's manager endpoint when ours has a wildcard port ("":
    // none), and its key (key_, signer_).
    std::string take_over_manager(std::vector<HandoverRow>& rows);
    void take_over_sessions(const std::vector<HandoverRow>& rows);
    void take_over_session(const HandoverRow& row);
    // A hibernated session's sealed row (the handover's): written by
    // write_handover, and whenever a session hibernates or is taken over
    // hibernated (its row kept), so that a crash takes it back as a planned
    // restart does; removed once it has resumed or closed (forget_asleep).
    // Returns the number of requests the row carries. `durable`: on the
    // disk when this returns, as the snapshot it names is (a hibernation's
    // answer waits for both); write_handover's are not (a sync per row, and
    // the next server reads them seconds later).
    std::size_t put_asleep_row(const std::string& id, Session& session, SessionProxy& relay,
                               double now_unix, bool durable = false);
    void record_asleep(const std::string& id);
    void forget_asleep(const std::string& id);
    std::set<std::string> asleep_recorded_;
    // Sessions that outlive a crash (session_adoption.cpp, docs/restarts.md
    // phase 2): each live sandbox's sealed row, written when it starts to
    // relay and removed when it goes; at start, the sandboxes the rows name
    // taken back before the reaper runs, then their sessions relayed again.
    static bool live_row(const HandoverRow& row);
    // Written (again) after each turn in which the session became idle or
    // its open requests changed (live_dirty_).
    // False when no row was written now (no record to take, or the write failed).
    bool record_live(const std::string& id);
    // The row as the session is now (none: nothing to adopt it by), and its write.
    std::optional<HandoverRow> live_row_of(const std::string& id) const;
    bool put_live_row(const HandoverRow& row);
    void forget_live(const std::string& id);
    void flush_live();  // the rows of the sessions whose requests changed this turn
    std::set<std::string> live_dirty_;
    void adopt_sandboxes(std::vector<HandoverRow>& rows);  // takes the live rows out
    void take_over_adopted();
    // A fork's zygote (its mounts are the fork's root), adopted once.
    std::shared_ptr<RuncSandbox> adopt_zygote(
        const json& from, const Image& image, const SandboxLimits& limits,
        std::map<std::string, std::pair<std::shared_ptr<RuncSandbox>, std::string>>& zygotes);
    std::int64_t executions_recorded(const std::string& id) const;
    struct AdoptedSandbox {
        std::string id;
        json body;
        std::unique_ptr<Sandbox> sandbox;
        double created_at = 0;
        std::int64_t executions = 0;
    };
    std::vector<AdoptedSandbox> adopting_;
    // The Swarm backend, made before the adoption (its services are adopted
    // or removed first), then handed to the pool (null after the start).
    std::shared_ptr<SwarmBackend> swarm_;
    std::map<std::string, std::string> adopt_failures_;  // session id: why not adopted
    std::set<std::string> live_recorded_;                // the sessions with a row
    bool handing_over_ = false;
    bool exec_after_handover_ = false;  // SIGHUP; SIGUSR2 exits instead
    std::string handover_signal_;
    Clock::time_point handover_deadline_{};
    Clock::time_point next_handover_check_{};  // run() turns at least this often meanwhile
    std::unique_ptr<SnapshotKey> server_key_;
    std::string server_key_error_;  // why server_key_ is null at start-up
    // Sessions that could not hibernate for the handover, and why.
    std::map<std::string, std::string> handover_refusals_;
    json file_request(Request& r, std::vector<std::string>& buffers);
    // What a transfer needs of a live session: its sandbox's directories, or
    // for a sandbox with none on this host (a Swarm task), the front's
    // staging copy of them (remote_files.cpp). FileError when it sleeps.
    SessionFiles session_files(SessionProxy& s) const;
    // The files of a sandbox with no directory here go through its kernel
    // (kernel_files.hpp, remote_files.cpp).
    static bool files_in_kernel(SessionProxy& s);
    fs::path remote_files_dir(const std::string& session_id) const;
    // The same, made (root's, 0700, with input/, output/, partial/); FileError.
    fs::path make_remote_files_dir(const std::string& session_id) const;
    AskKernel kernel_asker(const std::string& session_id);
    // How a move through the kernel ended for the request that waits on it:
    // the reply, or the error.
    using KernelFilesAnswer =
        std::function<void(FileTransfers::Reply* reply, const FileRequestError* error)>;
    // A put landed in the front's copy of /data/input (`done`, its reply):
    // the file goes to the kernel, then the reply (and its audit event).
    void put_in_kernel(const std::string& session_id, FileTransfers::Reply done,
                       KernelFilesAnswer answer);
    // The kernel's /data/output/<path of `content`> comes into the front's
    // copy first (at most `max_bytes`, `over_what` naming that limit), then
    // `then` runs (error null: it came, to `local`).
    using PulledThen = std::function<void(const FileRequestError* error, const fs::path& local)>;
    void pull_output(const std::string& session_id, const json& content, std::uint64_t max_bytes,
                     const std::string& over_what, PulledThen then);
    // file_list_request, file_get_request and file_get_begin_request of such
    // a session, answered later.
    void kernel_file_request(const WireMessage& request);
    // Its staging copy goes at close, and any left by an earlier run at start.
    void remove_remote_files(const std::string& session_id);
    // Moves through each session's kernel under way (puts and gets): at most
    // the per-session transfer cap at once (TooManyTransfers).
    std::map<std::string, std::size_t> kernel_moves_;
    // Counts one move of `session_id` (or refuses it); `done`, wrapped to
    // count it ended.
    KernelFilesDone counted_move(const std::string& session_id, KernelFilesDone done);
    // Hibernation of such a session: its snapshot is fetched into the front's
    // copy (kept from there with the inputs), and placed in the next sandbox
    // with every input file, through the kernel.
    void fetch_snapshot(const std::string& session_id, SessionIo::Moved done);
    void place_snapshot(const std::string& session_id, SessionIo::Moved done);
    void remove_stale_remote_files();
    json server_info(Request& r, std::vector<std::string>& buffers);

    ServeOptions options_;
    RuntimeSettings settings_;
    std::map<std::string, Image> images_;
    // Built and imported images (image_builder.hpp); the content id each
    // image's pool holds. A rebuild (or `image rm`) moves the name; the pool
    // follows within kPoolVersionCheck, or at the next session_create.
    ImageStore image_store_;
    std::map<std::string, std::string> pool_image_ids_;
    void follow_image_version(const std::string& name);
    Clock::time_point next_version_check_{};
    SessionStore store_;
    // Hibernated sessions' snapshots (session_snapshots.hpp); made at start-up.
    std::unique_ptr<SnapshotStore> snapshots_;
    std::map<std::string, std::shared_ptr<StreamedKeep>> streamed_;
    // The observers of the sessions' events: the audit trail, and the
    // metrics when served (metrics_).
    AuditTrail audit_{store_};
    std::vector<SessionEvents*> observers_{&audit_};
    zmq::context_t context_ = make_server_context();
    // The manager socket (manager_api.hpp): bound at start-up, under the
    // last server's key when it handed over.
    ManagerApi manager_{context_, make_random_key()};
    UniqueFd server_lock_;
    UniqueFd wake_fd_;
    UniqueFd signal_fd_;
    // Set when the server stops: the pool's kernel probes give up at once
    // rather than holding the shutdown for up to kProbeTimeout.
    std::atomic<bool> stopping_{false};
    std::unique_ptr<SandboxPool> pool_;
    // The one loop: the manager, the pool's wake-ups, signals, and every
    // session's sockets and deadline (sessions_ go first when the server ends).
    EventLoop loop_;
    // Snapshots sealed and opened off the loop's thread (reset before the
    // pool when the server ends: what waits on it holds sandboxes).
    std::unique_ptr<BackgroundWork> background_ = std::make_unique<BackgroundWork>(loop_);
    SessionTable sessions_;
    // Closed sessions whose channels have answered SessionClosed long
    // enough; destroyed after the loop's turn, not from their own deadline.
    std::vector<std::string> expired_;
    // Memory was freed (a session closed or expired): glibc is asked to give
    // it back, at most once a second (run()).
    bool trim_due_ = false;
    Clock::time_point next_trim_{};
    // Creates waiting for a sandbox, in the order they came in.
    std::map<std::uint64_t, PendingCreate> creating_;
    std::uint64_t next_create_ = 0;
    // Cold starts running for creates that left (their kind): the sandbox
    // goes to the next create of that kind.
    std::unordered_map<std::uint64_t, std::string> orphan_starts_;
    // Files in and out of sessions, in chunks (file_transfer.hpp).
    FileTransfers transfers_;
    // CPU weights of sessions that burn CPU without pause (cpu_fairness.hpp).
    void balance_cpu(Clock::time_point now);
    // Puts `setting` on a sandbox's CPU controls: its weight, its cap (never
    // past the sandbox's own quota), the idle cgroup (--cpu-idle) and its
    // tasks' slice. False when the sandbox has no CPU controller; `idled`:
    // whether its cgroup became idle.
    bool apply_cpu_setting(Sandbox& box, SandboxCpu& cpu, const CpuSetting& setting, bool& idled);
    // --loud-cpus: the sessions holding the CPU on the loud CPUs, or back on
    // every CPU, as loud_on_cpus says (cpu_fairness.hpp).
    void keep_loud_sessions_apart();
    // Publishes this server's interactive and hogging sessions, and gives the
    // sandboxes' parent cgroup the weight of every server's on the host.
    void weigh_sandboxes(std::size_t interactive, std::size_t hogging);
    // What the sandboxes' parent cgroup was last given (cpu_fairness.hpp,
    // sandboxes_weight), and how many sessions were interactive and hogging then.
    int sandboxes_weight_ = CpuFairnessPolicy{}.normal_weight;
    bool sandboxes_weight_set_ = false;  // by this server, and the cgroup took it
    bool sandboxes_idle_ = false;        // cpu.idle, as this server last wrote it
    std::size_t interactive_sessions_ = 0;
    std::size_t hogging_sessions_ = 0;
    // The host's servers' figures (cpu_demand.hpp); null when this server
    // does not weigh the sandboxes or could not publish (then its own count).
    std::unique_ptr<HostCpuDemand> cpu_demand_;
    CpuDemand host_demand_;
    // Whether the host's own processes contend with the sandboxes, which
    // decides whether the hogging sessions weigh a process each
    // (host_contention.hpp).
    HostContention host_contention_;
    // Sessions' way out (egress_gateway.hpp); null when the server has none.
    std::unique_ptr<EgressGateway> egress_;
    std::unique_ptr<EgressEvents> egress_events_;  // its events, watched from run()
    void on_egress(const EgressEvent& event);
    Clock::time_point next_balance_{};
    // The local file socket (local_files.hpp, local_files.cpp): descriptors
    // passed by clients on this host, copied on a thread each.
    void open_local_files();
    void on_local_accept();
    void on_local_client(std::uint64_t id);
    void on_local_copies();
    // The copy a request on it asks for starts (its descriptor: `client_file`).
    void start_local_copy(std::uint64_t id, int client_file);
    void finish_local_copy(std::uint64_t id);
    void send_local(LocalClient& c, const std::string& msg_type, json content);
    void refuse_local(std::uint64_t id, const std::string& ename, const std::string& evalue);
    // refuse_local for the exception being handled (called in a catch).
    void refuse_local_for_exception(std::uint64_t id, const std::string& type);
    void close_local_client(std::uint64_t id);
    void cancel_local_copies(const std::string& session_id);
    UniqueFd local_listener_;
    UniqueFd local_wake_;  // written by the copies' threads
    std::map<std::uint64_t, std::unique_ptr<LocalClient>> local_clients_;
    std::uint64_t next_local_ = 0;
    // --metrics (server_endpoint.cpp): what the observers count, and the
    // endpoint's thread, stopped first when the server ends. Null without it.
    void start_metrics();
    void tick_metrics(Clock::time_point now, bool stopping);
    // A session_create answered: counted by outcome.
    void count_create_reply(const WireMessage& request, const json& content);
    std::unique_ptr<ServerMetrics> metrics_;
    std::unique_ptr<MetricsHttpServer> metrics_http_;
    bool handed_over_ = false;
};

}  // namespace cellblock
