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

#include "relay_priority.hpp"

#include "cellblock/connection_info.hpp"
#include "cellblock/cpu_fairness.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/sandbox_pool.hpp"
#include "cellblock/session_store.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/unique_fd.hpp"
#include "cellblock/wire_message.hpp"
#include "file_transfer.hpp"
#include "inner_channels.hpp"
#include "manager_paths.hpp"
#include "multipart.hpp"
#include "session_proxy.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kVersion = "0.1.0";
constexpr auto kProbeTimeout = std::chrono::seconds(60);
// How often the server checks whether a built image's name moved (a rebuild,
// `image rm`): a readlink and a stat per built image (ImageStore::current_id).
constexpr auto kPoolVersionCheck = std::chrono::seconds(2);
// The manager socket reads a frame up to this size so that a request too
// large gets an answer (MessageTooLarge); requests themselves are far smaller.
constexpr std::size_t kManagerFrameCeiling = 256u << 20;
constexpr std::size_t kManagerMaxFrames = 64;

double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// "x_request" -> "x_reply"; anything else -> "error_reply".
std::string reply_type(const std::string& request_type) {
    constexpr std::string_view suffix = "_request";
    if (request_type.size() > suffix.size() && request_type.ends_with(suffix))
        return request_type.substr(0, request_type.size() - suffix.size()) + "_reply";
    return "error_reply";
}

// A manager request failed in a way the client should be told about.
struct RequestError {
    std::string ename, evalue;
};

void write_server_file(const fs::path& path, const std::string& endpoint, const std::string& key) {
    const json j = {{"manager", endpoint},
                    {"key", key},
                    {"signature_scheme", "hmac-sha256"},
                    {"pid", ::getpid()},
                    {"version", kVersion}};
    const fs::path tmp = path.string() + ".tmp";
    UniqueFd fd(::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600));
    if (!fd) throw std::runtime_error("server file " + tmp.string() + ": " + strerror(errno));
    ::fchmod(fd.get(), 0600);
    const std::string text = j.dump(2) + "\n";
    const bool ok =
        ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size());
    fd.reset();
    if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
        throw std::runtime_error("server file " + path.string() + ": cannot write");
    }
}

// The live server's claim on its state dir: a POSIX write lock on
// server.lock, held for the server's life and released by the kernel when
// it dies, even by SIGKILL. Clients test it (server_lock_holder) before they
// trust server.json; a second server on the same state dir is refused
// before it could reap the first one's sandboxes.
UniqueFd hold_server_lock(const fs::path& state_dir) {
    const fs::path file = server_lock_file(state_dir);
    UniqueFd fd(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fd) throw std::runtime_error("server lock " + file.string() + ": " + strerror(errno));
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    if (::fcntl(fd.get(), F_SETLK, &lock) != 0) {
        const auto holder = server_lock_holder(state_dir);
        throw std::runtime_error("another cellblock server" +
                                 (holder ? " (pid " + std::to_string(*holder) + ")" : "") +
                                 " runs with state dir " + state_dir.string());
    }
    return fd;
}

// The host pids of a sandbox's processes (its cgroup's members).
std::vector<pid_t> sandbox_pids(const std::string& container_id) {
    std::vector<pid_t> pids;
    for (const auto& dir : sandbox_cgroup_dirs(container_id)) {
        std::ifstream procs(dir / "cgroup.procs");
        if (!procs) continue;
        for (pid_t pid; procs >> pid;) pids.push_back(pid);
        if (!pids.empty()) break;
    }
    std::sort(pids.begin(), pids.end());
    return pids;
}

// runc maps the container's root to an unprivileged host id, which must be
// able to reach the bundle: every ancestor of the state dir must be searchable.
void check_state_dir_reachable(const fs::path& state_dir) {
    for (fs::path p = state_dir.parent_path(); !p.empty() && p != p.root_path();
         p = p.parent_path()) {
        struct stat st {};
        if (::stat(p.c_str(), &st) == 0 && !(st.st_mode & S_IXOTH)) {
            throw std::runtime_error("state dir " + state_dir.string() + ": " + p.string() +
                                     " is not searchable by the sandbox's mapped user (mode " +
                                     std::to_string(st.st_mode & 0777) +
                                     " octal-less); choose a state dir under /var/lib or /run");
        }
    }
}

// Each session holds about ten sockets and twenty-odd descriptors: lift the
// process's descriptor limit to its hard maximum and size the ZMQ context by
// it (libzmq's default is 1023 sockets per context). Must run before the
// first socket exists.
zmq::context_t make_server_context() {
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        ::setrlimit(RLIMIT_NOFILE, &nofile);
    }
    ::getrlimit(RLIMIT_NOFILE, &nofile);
    zmq::context_t context(1);
    const auto sockets = std::clamp<rlim_t>(nofile.rlim_cur / 2, 1024, 65536);
    context.set(zmq::ctxopt::max_sockets, static_cast<int>(sockets));
    return context;
}

std::vector<Image> load_images(const std::vector<fs::path>& dirs) {
    std::map<std::string, Image> found;
    for (const auto& dir : dirs) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(dir, ec)) {
            const fs::path file = entry.path() / "image.json";
            if (!fs::exists(file) || found.count(entry.path().filename().string())) continue;
            try {
                Image image = Image::load(file);
                found.emplace(image.name, std::move(image));
            } catch (const std::exception& e) {
                spdlog::warn("{}", e.what());
            }
        }
    }
    std::vector<Image> out;
    for (auto& [name, image] : found) out.push_back(std::move(image));
    return out;
}

class Server final : public SessionObserver {
  public:
    explicit Server(const ServeOptions& options);
    ~Server() override;
    int run();

    // SessionObserver
    void on_execution(const ExecutionRecord& record) override;
    void on_state(const std::string& session_id, const std::string& state) override;
    void on_event(const std::string& session_id, const std::string& kind,
                  const std::string& detail) override;
    void on_closed(const std::string& session_id, const std::string& reason) override;

  private:
    struct Request {
        WireMessage message;
        // The message's buffers, still in the received frames (scratch_): an
        // upload's chunk is written from there, not copied first.
        std::vector<std::string_view> buffers;
    };
    struct PendingCreate {
        WireMessage request;
        std::string session_id;
        std::string image;
        SessionLimits limits;
        json metadata;
        Clock::time_point started;
        std::string image_id;  // content id of a built image's root
        // Creates with the same kind can take each other's sandboxes: image,
        // version, runtime and limits.
        std::string kind;
        bool poolable = false;  // the image's pool holds this kind
        // The create is answered ServerBusy at this time: the server's
        // bound on the wait, or earlier, the client's own timeout.
        Clock::time_point deadline;
        std::optional<double> client_timeout_s;
        std::uint64_t ticket = 0;  // the cold start under way for it
    };
    using Handler = json (Server::*)(Request&, std::vector<std::string>& reply_buffers);

    void on_manager();
    void reply(const WireMessage& request, json content, std::vector<std::string> buffers = {});
    void reply_error(const WireMessage& request, const std::string& ename,
                     const std::string& evalue);
    // An error reply and one log line: a request the manager will not handle.
    void refuse(const WireMessage& request, const std::string& ename, const std::string& evalue);
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
    std::size_t open_sessions() const;
    SessionProxy& live_session(const json& content);
    void flush_audit();
    std::string session_id_of(const json& content) const;

    json session_create(Request& r, std::vector<std::string>& buffers);
    json session_list(Request& r, std::vector<std::string>& buffers);
    json session_info(Request& r, std::vector<std::string>& buffers);
    json session_close(Request& r, std::vector<std::string>& buffers);
    json session_history(Request& r, std::vector<std::string>& buffers);
    json file_request(Request& r, std::vector<std::string>& buffers);
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
    zmq::context_t context_ = make_server_context();
    zmq::socket_t manager_{context_, zmq::socket_type::router};
    std::string manager_endpoint_;
    std::string key_ = make_random_key();
    Signer signer_{key_};
    ReplayGuard replay_;
    UniqueFd server_lock_;
    UniqueFd wake_fd_;
    UniqueFd signal_fd_;
    // Set when the server stops: the pool's kernel probes give up at once
    // rather than holding the shutdown for up to kProbeTimeout.
    std::atomic<bool> stopping_{false};
    std::unique_ptr<SandboxPool> pool_;
    std::map<std::string, std::unique_ptr<SessionProxy>> sessions_;
    // Creates waiting for a sandbox, in the order they came in.
    std::map<std::uint64_t, PendingCreate> creating_;
    std::uint64_t next_create_ = 0;
    // Cold starts running for creates that left (their kind): the sandbox
    // goes to the next create of that kind.
    std::unordered_map<std::uint64_t, std::string> orphan_starts_;
    // Files in and out of sessions, in chunks (file_transfer.hpp).
    FileTransfers transfers_;
    std::unordered_map<std::string, Handler> handlers_;
    Multipart scratch_;
    // Execution records wait here until the turn's messages are sent: the
    // SQLite write then overlaps the client's receive instead of delaying
    // the idle status behind it. Flushed before any manager request is read.
    std::vector<ExecutionRecord> audit_queue_;
    // CPU weights of sessions that burn CPU without pause (cpu_fairness.hpp).
    void balance_cpu(Clock::time_point now);
    std::unordered_map<std::string, CpuFairness> fairness_;
    Clock::time_point next_balance_{};
};

Server::Server(const ServeOptions& options)
    : options_(options),
      image_store_(options.paths.image_store.empty() ? options.paths.state_dir / "images"
                                                     : options.paths.image_store),
      store_((fs::create_directories(options.paths.state_dir),
              options.paths.state_dir / "cellblock.db")),
      transfers_(FileTransferLimits{
          .max_file_bytes = static_cast<std::uint64_t>(options.policy.max_file_bytes),
          .max_inline_bytes = static_cast<std::uint64_t>(options.policy.max_inline_file_bytes)}) {
    settings_.state_dir = options_.paths.state_dir;
    settings_.libexec_dir = options_.paths.libexec_dir;
    server_lock_ = hold_server_lock(settings_.state_dir);
    check_state_dir_reachable(settings_.state_dir);
    ::chmod(settings_.state_dir.c_str(), 0711);
    if (!fs::exists(settings_.libexec_dir / "cellblock-shim")) {
        throw std::runtime_error("kernel-shim " +
                                 (settings_.libexec_dir / "cellblock-shim").string() +
                                 " does not exist (build it, or pass --libexec-dir)");
    }
    options_.policy.validate();
    for (auto& image : load_images(options_.paths.image_dirs)) images_.emplace(image.name, image);
    // Imported images without a definition in the image dirs run as stored.
    for (const auto& name : image_store_.names()) {
        if (images_.count(name)) continue;
        try {
            Image stored = image_store_.image(*image_store_.current(name));
            stored.rootfs = "store";  // resolved again at each session_create
            stored.content_id.clear();
            images_.emplace(name, std::move(stored));
        } catch (const std::exception& e) {
            spdlog::warn("image store: {}: {}", name, e.what());
        }
    }
    if (!images_.count(options_.default_image)) {
        throw std::runtime_error("default image '" + options_.default_image + "' not found");
    }

    // Crash recovery: whatever an earlier server left is reaped, then marked.
    // First any process still running as an open session's host ids (the
    // registry has the range; while its session dir is there no one else can
    // lease it), then the sandboxes themselves.
    for (const auto& s : store_.sessions(true, 1000000)) {
        if (s.host_id_count == 0) continue;
        const auto killed = kill_leftovers_in(settings_.host_ids, {s.host_id_base, s.host_id_count},
                                              settings_.sessions_dir() / s.id);
        if (!killed.empty()) {
            spdlog::info("session {}: killed {} leftover process(es) running as its host ids {}..",
                         s.id, killed.size(), s.host_id_base);
        }
    }
    for (const auto& id : reap_abandoned_sessions(settings_)) {
        spdlog::info("reaped sandbox of session {} left by an earlier server", id);
    }
    for (const auto& path : remove_orphan_cgroups(std::chrono::seconds(60))) {
        spdlog::info("removed empty cgroup {} left by an earlier run", path.string());
    }
    for (const auto& id : store_.close_all_open("server_restart", unix_now())) {
        spdlog::info("session {} marked closed: server_restart", id);
    }

    handlers_ = {{"session_create_request", &Server::session_create},
                 {"session_list_request", &Server::session_list},
                 {"session_info_request", &Server::session_info},
                 {"session_close_request", &Server::session_close},
                 {"session_history_request", &Server::session_history},
                 {"server_info_request", &Server::server_info}};
    for (const auto& type : FileTransfers::request_types()) handlers_[type] = &Server::file_request;

    wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_fd_) throw std::runtime_error(std::string("eventfd: ") + strerror(errno));
    sigset_t signals;
    sigemptyset(&signals);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&signals, sig);
    signal_fd_.reset(::signalfd(-1, &signals, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!signal_fd_) throw std::runtime_error(std::string("signalfd: ") + strerror(errno));
    std::vector<PoolImage> pool_images;
    for (const auto& [name, image] : images_) {
        PoolImage p;
        try {
            p.image = resolve_image(image, image_store_);
        } catch (const ImageNotBuilt& e) {
            spdlog::warn("{} (no pool for it until then)", e.what());
            continue;
        }
        pool_image_ids_[name] = p.image.content_id;
        p.limits = options_.policy.effective(image.limits_json, json::object()).sandbox;
        auto it = options_.pool.find(name);
        p.target = it != options_.pool.end() ? it->second : 0;
        pool_images.push_back(std::move(p));
    }
    zmq::context_t* ctx = &context_;
    const int wake = wake_fd_.get();
    pool_ = std::make_unique<SandboxPool>(
        settings_,
        [ctx, stopping = &stopping_](Sandbox& box) -> std::shared_ptr<void> {
            return std::shared_ptr<InnerChannels>(
                probe_kernel(*ctx, box, kProbeTimeout, 64 << 20, stopping));
        },
        std::move(pool_images),
        [wake] {
            const std::uint64_t one = 1;
            [[maybe_unused]] auto n = ::write(wake, &one, sizeof one);
        },
        options_.pool_workers);

    manager_.set(zmq::sockopt::linger, 1000);
    // Frames up to the ceiling are read and answered (MessageTooLarge past the
    // real limit, see on_manager); past it libzmq cuts the connection.
    manager_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kManagerFrameCeiling));
    manager_.set(zmq::sockopt::router_handover, 1);
    manager_.bind(options_.manager_endpoint);
    manager_endpoint_ = manager_.get(zmq::sockopt::last_endpoint);
    write_server_file(server_file(settings_.state_dir), manager_endpoint_, key_);
}

Server::~Server() {
    stopping_ = true;  // kernel starts still being probed give up now
    for (auto& [id, session] : sessions_) session->close("server_shutdown");
    sessions_.clear();
    flush_audit();
    pool_.reset();  // joins workers, destroys warm sandboxes
    std::error_code ec;
    fs::remove(server_file(settings_.state_dir), ec);
}

void Server::reply(const WireMessage& request, json content, std::vector<std::string> buffers) {
    WireMessage msg =
        make_reply(request, reply_type(request.msg_type()), std::move(content), "cellblock-server");
    // The buffers (a download's chunk, megabytes) are not signed: they go out
    // as frames that own their string, without a copy; the rest is small.
    std::vector<zmq::message_t> frames;
    for (auto& f : encode(msg, signer_)) frames.push_back(to_frame(f));
    for (auto& buffer : buffers) {
        auto* owned = new std::string(std::move(buffer));
        frames.emplace_back(
            owned->data(), owned->size(),
            [](void*, void* hint) { delete static_cast<std::string*>(hint); }, owned);
    }
    send_multipart(manager_, frames);
}

namespace {

// A message that failed to decode, as far as its sender proved it holds the
// key (the signature over its four JSON frames verifies): its identities and
// header, to address a refusal to. nullopt when the sender is not
// authenticated or the message is a replay: those get the log line only, as
// on a kernel's channels (no signed answer to whoever cannot sign).
std::optional<WireMessage> authenticated_parent(std::span<const std::string_view> frames,
                                                const Signer& signer, const std::string& error) {
    if (error == "bad signature" || error == "replayed message") return std::nullopt;
    const auto delimiter = std::find(frames.begin(), frames.end(), kDelimiter);
    if (delimiter == frames.end()) return std::nullopt;
    const WireLayout at{static_cast<std::size_t>(delimiter - frames.begin())};
    if (frames.size() < at.first_buffer() ||
        !signer.verify(frames[at.signature()], frames[at.header()], frames[at.parent()],
                       frames[at.metadata()], frames[at.content()])) {
        return std::nullopt;
    }
    WireMessage parent;
    parent.identities.assign(frames.begin(), delimiter);
    if (auto header = parse_json_frame(frames[at.header()], WireLimits{}.max_json_depth);
        header && header->is_object()) {
        parent.header = std::move(*header);
    }
    return parent;
}

}  // namespace

void Server::reply_error(const WireMessage& request, const std::string& ename,
                         const std::string& evalue) {
    reply(request, {{"status", "error"}, {"ename", ename}, {"evalue", evalue}});
}

void Server::refuse(const WireMessage& request, const std::string& ename,
                    const std::string& evalue) {
    spdlog::warn("manager: refused {} from {}: {}: {}", request.msg_type(),
                 identity_text(request.identities.empty() ? "" : request.identities[0]), ename,
                 evalue);
    reply_error(request, ename, evalue);
}

void Server::on_manager() {
    // The largest request anyone needs: one file in one message, or one chunk.
    const std::size_t max_request_bytes =
        std::max<std::size_t>(static_cast<std::size_t>(options_.policy.max_inline_file_bytes),
                              transfers_.limits().max_chunk_bytes) +
        (1 << 20);
    // A burst of requests is handled in one turn, bounded so sessions keep flowing.
    for (int i = 0; i < 64 && recv_multipart(manager_, scratch_, kManagerMaxFrames); ++i) {
        const auto views = scratch_.views();
        const std::string_view sender = views.empty() ? std::string_view() : views[0];
        WireLimits limits;  // up to the socket's ceiling: read, then refused with a reply
        limits.max_total_bytes = kManagerFrameCeiling * 2;
        // The buffers are not signed and stay where they are: only the routing,
        // the signature and the four JSON frames are decoded.
        const auto delimiter = std::find(views.begin(), views.end(), kDelimiter);
        const std::size_t first_buffer =
            WireLayout{static_cast<std::size_t>(delimiter - views.begin())}.first_buffer();
        const std::span<const std::string_view> all(views);
        const auto head = delimiter == views.end() || views.size() <= first_buffer
                              ? all
                              : all.first(first_buffer);
        auto decoded = decode(head, signer_, &replay_, limits);
        if (!decoded.message) {
            spdlog::warn("manager: rejected message from {}: {}", identity_text(sender),
                         decoded.error);
            if (auto parent = authenticated_parent(views, signer_, decoded.error)) {
                const bool large = decoded.error.find("too large") != std::string::npos;
                reply_error(*parent, large ? ename::MessageTooLarge : ename::InvalidRequest,
                            "refused: " + decoded.error);
            }
            continue;
        }
        Request request{std::move(*decoded.message), {views.begin() + head.size(), views.end()}};
        const std::string type = request.message.msg_type();
        if (scratch_.dropped_frames > 0) {
            refuse(request.message, ename::InvalidRequest,
                   std::to_string(scratch_.frames.size() + scratch_.dropped_frames) +
                       " frames, over the " + std::to_string(kManagerMaxFrames) +
                       " a manager request may have");
            continue;
        }
        if (scratch_.total_bytes > max_request_bytes) {
            refuse(request.message, ename::MessageTooLarge,
                   "the message is " + std::to_string(scratch_.total_bytes) + " bytes, over the " +
                       std::to_string(max_request_bytes) +
                       " a manager request may carry; send big files in chunks "
                       "(file_put_begin_request)");
            continue;
        }
        if (type.size() < 9 || !type.ends_with("_request")) {
            refuse(request.message, ename::InvalidRequest, "'" + type + "' is not a request");
            continue;
        }
        auto handler = handlers_.find(type);
        if (handler == handlers_.end()) {
            refuse(request.message, ename::UnknownRequest,
                   "the manager does not know '" + type + "'");
            continue;
        }
        std::vector<std::string> buffers;
        try {
            json content = (this->*(handler->second))(request, buffers);
            if (!content.is_null()) reply(request.message, std::move(content), std::move(buffers));
        } catch (const RequestError& e) {
            reply_error(request.message, e.ename, e.evalue);
        } catch (const FileRequestError& e) {
            reply_error(request.message, e.ename(), e.what());
        } catch (const PolicyError& e) {
            reply_error(request.message, e.ename(), e.what());
        } catch (const std::exception& e) {
            spdlog::error("manager {}: {}", type, e.what());
            reply_error(request.message, ename::ServerError, e.what());
        }
    }
}

std::string Server::session_id_of(const json& content) const {
    auto it = content.find("session_id");
    if (it == content.end() || !it->is_string() || it->get<std::string>().empty()) {
        throw RequestError{ename::InvalidRequest, "session_id (a string) is required"};
    }
    return it->get<std::string>();
}

SessionProxy& Server::live_session(const json& content) {
    const std::string id = session_id_of(content);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
        if (auto record = store_.session(id)) {
            throw RequestError{ename::SessionClosed,
                               "session " + id + " is closed: " + record->close_reason};
        }
        throw RequestError{ename::NoSuchSession, "no session " + id};
    }
    if (it->second->closed()) {
        throw RequestError{ename::SessionClosed,
                           "session " + id + " is closed: " + it->second->close_reason()};
    }
    return *it->second;
}

json Server::session_create(Request& r, std::vector<std::string>&) {
    const json& c = r.message.content;
    const std::string image_name = c.contains("image") && c["image"].is_string()
                                       ? c["image"].get<std::string>()
                                       : options_.default_image;
    auto image = images_.find(image_name);
    if (image == images_.end()) {
        std::string known;
        for (const auto& [name, def] : images_) known += (known.empty() ? "" : ", ") + name;
        throw RequestError{ename::UnknownImage,
                           "no image '" + image_name + "'; known images: " + known};
    }
    // A built image runs on its current version (a rebuild moves the name).
    follow_image_version(image_name);
    Image resolved;
    try {
        resolved = resolve_image(image->second, image_store_);
    } catch (const std::exception& e) {
        throw RequestError{ename::ImageNotBuilt, e.what()};
    }
    const json requested = c.contains("limits") ? c["limits"] : json::object();
    if (!requested.is_object() && !requested.is_null()) {
        throw RequestError{ename::InvalidLimits, "limits must be an object"};
    }
    const SessionLimits limits = options_.policy.effective(resolved.limits_json, requested);
    const json metadata = c.contains("metadata") ? c["metadata"] : json::object();
    if (!metadata.is_object())
        throw RequestError{ename::InvalidRequest, "metadata must be an object"};
    // The client's own timeout: past it nobody waits for the session.
    std::optional<double> client_timeout_s;
    if (c.contains("timeout_s") && !c["timeout_s"].is_null()) {
        if (!c["timeout_s"].is_number() || !(c["timeout_s"].get<double>() > 0)) {
            throw RequestError{ename::InvalidRequest,
                               "timeout_s must be a positive number of seconds"};
        }
        client_timeout_s = c["timeout_s"].get<double>();
    }
    // Closed sessions do not count: they hold no sandbox, and their
    // channels are released closed_channels_s after the close.
    const std::size_t open = open_sessions();
    if (open + creating_.size() >= static_cast<std::size_t>(options_.policy.max_sessions)) {
        throw RequestError{ename::TooManySessions,
                           std::to_string(open) + " sessions open and " +
                               std::to_string(creating_.size()) +
                               " starting: the server's maximum is " +
                               std::to_string(options_.policy.max_sessions) + " (--max-sessions)"};
    }
    // The image's runtime, or the one the request names (allowlisted, installed).
    Image image_def = resolved;
    if (c.contains("runtime") && !c["runtime"].is_null()) {
        if (!c["runtime"].is_string() || !runtime_allowed(c["runtime"].get<std::string>())) {
            throw RequestError{ename::UnknownRuntime, "runtime must be one of runc, runsc, crun"};
        }
        image_def.runtime = c["runtime"].get<std::string>();
    }
    if (!runtime_installed(image_def.runtime)) {
        throw RequestError{ename::UnknownRuntime,
                           "runtime '" + image_def.runtime + "' is not installed on this host"};
    }
    PendingCreate pending;
    pending.request = r.message;
    pending.image = image_name;
    pending.limits = limits;
    pending.metadata = metadata;
    pending.started = Clock::now();
    pending.image_id = image_def.content_id;
    pending.kind = image_name + "@" + image_def.content_id + " on " + image_def.runtime + " " +
                   limits.sandbox.to_json().dump();
    pending.client_timeout_s = client_timeout_s;
    const auto wait_bound = std::chrono::duration<double>(options_.policy.max_create_wait_s);
    pending.deadline = pending.started + std::chrono::duration_cast<Clock::duration>(wait_bound);
    if (client_timeout_s) {
        // Leave the reply time to travel before the client gives up.
        const double margin = std::min(1.0, *client_timeout_s / 10);
        const auto client_wait = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(*client_timeout_s - margin));
        pending.deadline = std::min(pending.deadline, pending.started + client_wait);
    }
    // The pool holds sandboxes of the image's own runtime and pool version only.
    const auto pool_id = pool_image_ids_.find(image_name);
    pending.poolable = image_def.runtime == resolved.runtime && pool_id != pool_image_ids_.end() &&
                       pool_id->second == image_def.content_id;
    // First come, first served: a warm sandbox goes to this create only if
    // no earlier one still waits.
    if (pending.poolable && creating_.empty()) {
        if (WarmSandbox warm = pool_->take(image_name, limits.sandbox)) {
            pending.session_id = warm.sandbox->session_id();
            finish_create(pending, std::move(warm), 0, true);
            return nullptr;
        }
    }
    pending.session_id = make_session_id();
    pending.ticket = pool_->start_cold(pending.session_id, image_def, limits.sandbox);
    creating_.emplace(next_create_++, std::move(pending));
    serve_from_pool();
    return nullptr;  // answered when a sandbox is up
}

std::size_t Server::open_sessions() const {
    return static_cast<std::size_t>(std::count_if(
        sessions_.begin(), sessions_.end(), [](const auto& s) { return !s.second->closed(); }));
}

void Server::serve_from_pool() {
    for (auto it = creating_.begin(); it != creating_.end();) {
        PendingCreate& pending = it->second;
        WarmSandbox warm;
        if (pending.poolable) warm = pool_->take(pending.image, pending.limits.sandbox);
        if (!warm) {
            ++it;
            continue;
        }
        PendingCreate served = std::move(pending);
        it = creating_.erase(it);
        release_cold_start(served.ticket, served.kind);
        served.session_id = warm.sandbox->session_id();
        try {
            finish_create(served, std::move(warm), 0, true);
        } catch (const std::exception& e) {
            reply(served.request,
                  {{"status", "error"}, {"ename", ename::ServerError}, {"evalue", e.what()}});
        }
    }
}

void Server::release_cold_start(std::uint64_t ticket, const std::string& kind) {
    if (!pool_->cancel_cold(ticket)) orphan_starts_.emplace(ticket, kind);
}

void Server::hand_out(std::uint64_t ticket, const std::string& kind, StartResult result) {
    // The oldest create of this kind gets the sandbox, whichever create's
    // start it was: starts run side by side and finish in any order.
    auto oldest = std::find_if(creating_.begin(), creating_.end(),
                               [&](const auto& entry) { return entry.second.kind == kind; });
    if (oldest == creating_.end()) {
        spdlog::info("sandbox {}: started for a create that no longer waits; destroyed",
                     result.warm.sandbox->container_id());
        result.warm.channels.reset();
        pool_->dispose(std::move(result.warm.sandbox));
        return;
    }
    PendingCreate served = std::move(oldest->second);
    creating_.erase(oldest);
    if (served.ticket != ticket) {
        // The served create's own start is still under way: the create this
        // sandbox was started for (if it still waits) waits for that one.
        auto mine = std::find_if(creating_.begin(), creating_.end(),
                                 [&](const auto& entry) { return entry.second.ticket == ticket; });
        if (mine != creating_.end()) {
            mine->second.ticket = served.ticket;
        } else {
            release_cold_start(served.ticket, kind);
        }
    }
    served.session_id = result.warm.sandbox->session_id();
    try {
        finish_create(served, std::move(result.warm), result.start_ms, false);
    } catch (const std::exception& e) {
        reply(served.request,
              {{"status", "error"}, {"ename", ename::ServerError}, {"evalue", e.what()}});
    }
}

void Server::expire_creates(Clock::time_point now) {
    std::size_t ahead = 0;
    for (auto it = creating_.begin(); it != creating_.end();) {
        PendingCreate& pending = it->second;
        if (pending.deadline > now) {
            ++it;
            ++ahead;
            continue;
        }
        const double waited = std::chrono::duration<double>(now - pending.started).count();
        const std::string queue = std::to_string(creating_.size()) + " creates waiting, " +
                                  std::to_string(ahead) + " ahead of this one";
        std::string evalue;
        if (pending.client_timeout_s && waited < options_.policy.max_create_wait_s) {
            evalue = fmt::format(
                "no sandbox within the client's timeout_s {:g} (waited {:.1f} s; {}); the "
                "session is not created",
                *pending.client_timeout_s, waited, queue);
            spdlog::warn(
                "session_create abandoned: its client gives up after {:g} s ({}); the "
                "sandbox started for it goes to the next create",
                *pending.client_timeout_s, queue);
        } else {
            evalue = fmt::format(
                "no sandbox after {:.1f} s (the server's max_create_wait_s is "
                "{:g}; {})",
                waited, options_.policy.max_create_wait_s, queue);
            spdlog::warn("session_create refused: {}", evalue);
        }
        reply(pending.request,
              {{"status", "error"}, {"ename", ename::ServerBusy}, {"evalue", evalue}});
        const std::uint64_t ticket = pending.ticket;
        const std::string kind = pending.kind;
        it = creating_.erase(it);
        release_cold_start(ticket, kind);
    }
}

void Server::finish_create(PendingCreate& pending, WarmSandbox warm, double start_ms,
                           bool warm_start) {
    ConnectionInfo outer;
    outer.transport = "tcp";
    outer.ip = "127.0.0.1";
    outer.key = make_random_key();
    outer.kernel_name = "cellblock-" + pending.image;
    ProxyOptions opts;
    opts.policy = &options_.policy;
    opts.limits = pending.limits;
    opts.observer = this;
    opts.audit_code_hash_only = options_.audit_code_hash_only;
    SandboxPool* pool = pool_.get();
    opts.dispose = [pool](std::unique_ptr<Sandbox> box) { pool->dispose(std::move(box)); };
    auto channels = std::static_pointer_cast<InnerChannels>(warm.channels);
    const std::string runtime = warm.sandbox->runtime();
    const IdMapping host_ids = warm.sandbox->host_ids();
    auto proxy = std::make_unique<SessionProxy>(context_, pending.session_id, outer, opts);
    proxy->attach(std::move(warm.sandbox), std::move(*channels));

    SessionRecord record;
    record.id = pending.session_id;
    record.image = pending.image;
    record.image_id = pending.image_id;
    record.host_id_base = host_ids.host_base;
    record.host_id_count = host_ids.size;
    record.state = "idle";
    record.created_at = unix_now();
    record.limits = pending.limits.to_json();
    record.metadata = pending.metadata;
    json connection = proxy->outer_connection().to_json();
    spdlog::info("session {}: created ({}, image {}, {})", pending.session_id,
                 warm_start ? "warm" : "cold", pending.image, runtime);
    SessionProxy& session = *proxy;
    sessions_.emplace(pending.session_id, std::move(proxy));
    reply(pending.request, {{"status", "ok"},
                            {"session_id", pending.session_id},
                            {"connection", connection},
                            {"limits", pending.limits.to_json()},
                            {"runtime", runtime},
                            {"image", pending.image},
                            {"image_id", pending.image_id},
                            {"warm", warm_start}});
    // The registry is written once the client has its reply (the session
    // is live either way); a session the registry cannot record is closed.
    try {
        store_.add_session(record);
        store_.add_event(
            {pending.session_id, record.created_at, "created",
             (warm_start ? "warm sandbox from the pool"
                         : "cold start in " + std::to_string(static_cast<int>(start_ms)) + " ms") +
                 " on " + runtime +
                 (pending.image_id.empty() ? ""
                                           : ", image " + pending.image + "@" + pending.image_id)});
    } catch (const std::exception& e) {
        spdlog::error("session {}: registry: {}; closing it", pending.session_id, e.what());
        session.close("server_error");
    }
}

void Server::on_pool_results() {
    std::uint64_t count;
    [[maybe_unused]] auto n = ::read(wake_fd_.get(), &count, sizeof count);
    for (auto& result : pool_->drain_results()) {
        auto it = std::find_if(creating_.begin(), creating_.end(), [&](const auto& entry) {
            return entry.second.ticket == result.ticket;
        });
        std::string kind;
        if (it != creating_.end()) {
            kind = it->second.kind;
        } else if (auto orphan = orphan_starts_.find(result.ticket);
                   orphan != orphan_starts_.end()) {
            kind = std::move(orphan->second);
            orphan_starts_.erase(orphan);
        }
        if (!result.warm) {
            if (it == creating_.end()) continue;
            PendingCreate pending = std::move(it->second);
            creating_.erase(it);
            spdlog::error("session {}: the sandbox did not start: {}", pending.session_id,
                          result.error);
            reply(pending.request, {{"status", "error"},
                                    {"ename", ename::SandboxStartFailed},
                                    {"evalue", result.error}});
            continue;
        }
        hand_out(result.ticket, kind, std::move(result));
    }
    serve_from_pool();  // a refill may have come in
}

json Server::session_list(Request& r, std::vector<std::string>&) {
    const bool open_only = r.message.content.value("open_only", false);
    json list = json::array();
    for (const auto& s : store_.sessions(open_only, 1000)) {
        json entry = {{"session_id", s.id},
                      {"image", s.image},
                      {"state", s.state},
                      {"created_at", s.created_at},
                      {"executions", s.execution_count},
                      {"close_reason", s.close_reason}};
        if (auto it = sessions_.find(s.id); it != sessions_.end()) {
            entry["state"] = it->second->state();
            if (const auto* g = it->second->governor()) entry["executions"] = g->executions();
            if (const Sandbox* box = it->second->sandbox(); box && !it->second->closed()) {
                entry["container_id"] = box->container_id();
                entry["pids"] = sandbox_pids(box->container_id());
            }
        }
        list.push_back(entry);
    }
    // Every sandbox on the host that this server runs: the sessions' above,
    // and the warm ones waiting in the pool (`runc --root RUNTIME_ROOT list`).
    json warm = pool_->warm_sandboxes();
    for (auto& box : warm) box["pids"] = sandbox_pids(box["container_id"].get<std::string>());
    return {{"status", "ok"},
            {"sessions", list},
            {"warm_sandboxes", warm},
            {"runtime_root", settings_.runtime_root().string()}};
}

json Server::session_info(Request& r, std::vector<std::string>&) {
    const std::string id = session_id_of(r.message.content);
    const auto record = store_.session(id);
    if (!record) throw RequestError{ename::NoSuchSession, "no session " + id};
    json info = {{"status", "ok"},
                 {"session_id", id},
                 {"image", record->image},
                 {"image_id", record->image_id},
                 {"state", record->state},
                 {"created_at", record->created_at},
                 {"closed_at", record->closed_at},
                 {"close_reason", record->close_reason},
                 {"limits", record->limits},
                 {"metadata", record->metadata},
                 {"executions", record->execution_count},
                 {"host_ids", {{"base", record->host_id_base}, {"count", record->host_id_count}}}};
    if (record->state == "closed") {
        // What the session used over its life, kept at the close.
        info["usage"] = {{"memory_peak_bytes", record->memory_peak_bytes},
                         {"cpu_ms", record->cpu_ms}};
    }
    if (auto it = sessions_.find(id); it != sessions_.end() && !it->second->closed()) {
        SessionProxy& s = *it->second;
        info["state"] = s.state();
        if (const auto* g = s.governor()) {
            info["executions"] = g->executions();
            info["executions_left"] = g->executions_left();
        }
        if (Sandbox* box = s.sandbox()) {
            const auto u = box->usage();
            info["usage"] = {{"memory_bytes", u.memory_bytes},
                             {"memory_peak_bytes", u.memory_peak_bytes},
                             {"cpu_ms", u.cpu_ns / 1000000}};
        }
    }
    return info;
}

json Server::session_close(Request& r, std::vector<std::string>&) {
    SessionProxy& s = live_session(r.message.content);
    s.close("closed_by_request");
    return {{"status", "ok"}, {"session_id", s.session_id()}};
}

json Server::session_history(Request& r, std::vector<std::string>&) {
    const std::string id = session_id_of(r.message.content);
    const auto record = store_.session(id);
    if (!record) throw RequestError{ename::NoSuchSession, "no session " + id};
    json executions = json::array();
    for (const auto& e : store_.executions(id)) {
        executions.push_back({{"count", e.count},
                              {"msg_id", e.msg_id},
                              {"code", e.code},
                              {"status", e.status},
                              {"ename", e.ename},
                              {"started_at", e.started_at},
                              {"wall_ms", e.wall_ms},
                              {"cpu_ms", e.cpu_ms},
                              {"memory_peak_bytes", e.memory_peak_bytes},
                              {"output_bytes", e.output_bytes},
                              {"truncated", e.truncated}});
    }
    json events = json::array();
    for (const auto& e : store_.events(id)) {
        events.push_back({{"at", e.at}, {"kind", e.kind}, {"detail", e.detail}});
    }
    return {{"status", "ok"},
            {"session_id", id},
            {"image", record->image},
            {"image_id", record->image_id},
            {"state", record->state},
            {"close_reason", record->close_reason},
            {"memory_peak_bytes", record->memory_peak_bytes},
            {"cpu_ms", record->cpu_ms},
            {"executions", executions},
            {"events", events}};
}

json Server::file_request(Request& r, std::vector<std::string>& buffers) {
    SessionProxy& s = live_session(r.message.content);
    const SessionFiles files{s.session_id(), s.sandbox()->input_dir(), s.sandbox()->output_dir(),
                             s.sandbox()->input_dir().parent_path() / "partial",
                             static_cast<std::uint64_t>(s.governor()->limits().sandbox.disk_mb)
                                 << 20};
    auto done =
        transfers_.handle(r.message.msg_type(), r.message.content, r.buffers, files, Clock::now());
    if (done.event) on_event(s.session_id(), done.event->first, done.event->second);
    buffers = std::move(done.buffers);
    return std::move(done.content);
}

json Server::server_info(Request&, std::vector<std::string>&) {
    // {name: {rootfs, runtime, content_id, size_bytes, built, pool}}: a built
    // image's current version, and the one its pool holds.
    const json pools = pool_->state();
    json images = json::object();
    for (const auto& [name, image] : images_) {
        json entry = {{"rootfs", image.rootfs == "store" ? "store" : image.rootfs},
                      {"runtime", image.runtime},
                      {"preload", image.preload},
                      {"pool", pools.contains(name) ? pools[name] : json(nullptr)}};
        if (image.rootfs == "store") {
            const auto current = image_store_.current(name);
            entry["built"] = current.has_value();
            entry["content_id"] = current ? current->content_id : "";
            entry["size_bytes"] = current ? current->size_bytes() : 0;
            entry["source"] = current ? current->manifest.value("source", "") : "";
            const auto pool_id = pool_image_ids_.find(name);
            entry["pool_content_id"] = pool_id != pool_image_ids_.end() ? pool_id->second : "";
        }
        images[name] = entry;
    }
    const std::size_t open = open_sessions();
    return {
        {"status", "ok"},
        {"implementation", "cellblock"},
        {"version", kVersion},
        {"protocol_version", std::string(kProtocolVersion)},
        {"images", images},
        {"default_image", options_.default_image},
        {"pool", pools},
        {"sessions",
         {{"open", open}, {"starting", creating_.size()}, {"max", options_.policy.max_sessions}}},
        {"policy", options_.policy.to_json()},
        {"state_dir", settings_.state_dir.string()}};
}

void Server::on_execution(const ExecutionRecord& record) { audit_queue_.push_back(record); }

void Server::follow_image_version(const std::string& name) {
    const auto image = images_.find(name);
    if (image == images_.end() || image->second.rootfs != "store") return;
    const auto pooled = pool_image_ids_.find(name);
    const auto same = [&](const std::string& id) {
        return pooled != pool_image_ids_.end() ? pooled->second == id : id.empty();
    };
    if (same(image_store_.current_id(name))) return;  // the cheap check, every 2 s
    const auto current = image_store_.current(name);
    const std::string current_id = current ? current->content_id : "";
    if (same(current_id)) return;  // moved back meanwhile
    PoolImage p;
    const auto target = options_.pool.find(name);
    p.target = target != options_.pool.end() ? target->second : 0;
    try {
        p.image = current ? image_store_.image(*current) : image->second;
        p.limits = options_.policy.effective(image->second.limits_json, json::object()).sandbox;
    } catch (const std::exception& e) {
        spdlog::warn("image {}: version {} unusable: {}", name, current_id.substr(0, 12), e.what());
        return;
    }
    if (!current) {
        p.target = 0;  // the name is gone: the pool empties
        p.image.name = name;
    }
    const std::string old_id = pooled != pool_image_ids_.end() ? pooled->second : "";
    spdlog::info("image {}: current version {} (pool held {}); the pool follows", name,
                 current_id.empty() ? "none" : current_id.substr(0, 12),
                 old_id.empty() ? "none" : old_id.substr(0, 12));
    pool_image_ids_[name] = current_id;
    pool_->replace_image(std::move(p));
}

void Server::balance_cpu(Clock::time_point now) {
    for (auto& [id, session] : sessions_) {
        Sandbox* box = session->sandbox();
        if (session->closed() || !box) continue;
        auto& fairness = fairness_[id];
        CpuSample sample;
        sample.at = now;
        sample.cpu_ns = box->usage().cpu_ns;
        sample.tasks = box->task_count();
        // Only a demoted session needs it (to tell calm from starved): /proc reads per task.
        if (fairness.demoted()) sample.runnable = box->any_task_runnable();
        if (const auto running = session->running_since()) sample.running_for = now - *running;
        sample.executed = sample.running_for || session->idle_since() > fairness.last_sample();
        const auto change = fairness.observe(sample);
        if (!change) continue;
        // A cap of 0 is the session's own quota (its limits, as the pool applied them).
        const double own = box->limits().cpus;
        const double cpus = change->setting.cpus <= 0 ? own
                            : own > 0                 ? std::min(change->setting.cpus, own)
                                                      : change->setting.cpus;
        const bool weighted = box->set_cpu_weight(change->setting.weight);
        const bool capped = box->set_cpu_quota(cpus);
        if (!weighted && !capped) continue;  // no CPU controller for this sandbox
        spdlog::info("session {}: {}: {}", id, change->event, change->detail);
        on_event(id, change->event, change->detail);
    }
    next_balance_ = now + CpuFairnessPolicy{}.interval;
}

void Server::flush_audit() {
    for (const auto& record : audit_queue_) {
        try {
            store_.add_execution(record);
        } catch (const std::exception& e) {
            spdlog::error("audit: {}", e.what());
        }
    }
    audit_queue_.clear();
}

void Server::on_state(const std::string& session_id, const std::string& state) {
    // busy/idle change twice per execution and are served from memory
    // (session_list, session_info); the registry keeps lifecycle states only.
    if (state == "busy" || state == "idle") return;
    try {
        store_.set_state(session_id, state);
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

void Server::on_event(const std::string& session_id, const std::string& kind,
                      const std::string& detail) {
    try {
        store_.add_event({session_id, unix_now(), kind, detail});
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

void Server::on_closed(const std::string& session_id, const std::string& reason) {
    transfers_.session_closed(session_id);
    fairness_.erase(session_id);
    auto it = sessions_.find(session_id);
    std::int64_t executions = 0;
    std::uint64_t memory_peak_bytes = 0, cpu_ms = 0;
    if (it != sessions_.end()) {
        if (it->second->governor()) executions = it->second->governor()->executions();
        memory_peak_bytes = it->second->memory_peak_bytes();
        cpu_ms = it->second->cpu_ms();
    }
    try {
        store_.close_session(session_id, reason, unix_now(), executions, memory_peak_bytes, cpu_ms);
        store_.add_event({session_id, unix_now(), "closed", reason});
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

int Server::run() {
    spdlog::info("cellblock serve: manager on {}, state in {}, {} image(s)", manager_endpoint_,
                 settings_.state_dir.string(), images_.size());
    std::vector<zmq::pollitem_t> items;
    std::vector<SessionProxy*> order;
    for (;;) {
        items.clear();
        order.clear();
        items.push_back({manager_.handle(), 0, ZMQ_POLLIN, 0});
        items.push_back({nullptr, wake_fd_.get(), ZMQ_POLLIN, 0});
        items.push_back({nullptr, signal_fd_.get(), ZMQ_POLLIN, 0});
        std::optional<Clock::time_point> next;
        for (auto& [id, session] : sessions_) {
            order.push_back(session.get());
            session->add_poll_items(items);
            if (auto d = session->next_deadline(); d && (!next || *d < *next)) next = d;
        }
        if (!sessions_.empty() && (!next || next_balance_ < *next)) next = next_balance_;
        if (!next || next_version_check_ < *next) next = next_version_check_;
        for (const auto& [order, pending] : creating_) {
            if (pending.deadline < *next) next = pending.deadline;
        }
        long timeout_ms = -1;
        if (next) {
            timeout_ms = std::max<long>(
                0, std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now())
                           .count() +
                       1);
        }
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout_ms));
        if (items[2].revents & ZMQ_POLLIN) {
            signalfd_siginfo info;
            [[maybe_unused]] auto n = ::read(signal_fd_.get(), &info, sizeof info);
            spdlog::info("cellblock serve: {}; closing {} session(s)",
                         strsignal(static_cast<int>(info.ssi_signo)), sessions_.size());
            return 0;
        }
        for (std::size_t i = 0; i < order.size(); ++i) {
            order[i]->handle(&items[3 + i * SessionProxy::kPollItems]);
        }
        flush_audit();
        if (items[0].revents & ZMQ_POLLIN) on_manager();
        if (items[1].revents & ZMQ_POLLIN) on_pool_results();
        const auto now = Clock::now();
        expire_creates(now);
        if (now >= next_balance_) balance_cpu(now);
        transfers_.expire(now);
        if (now >= next_version_check_) {
            for (const auto& [name, image] : images_) follow_image_version(name);
            next_version_check_ = now + kPoolVersionCheck;
        }
        bool released = false;
        for (auto it = sessions_.begin(); it != sessions_.end();) {
            it->second->on_timer(now);
            if (it->second->expired(now)) {
                it = sessions_.erase(it);
                released = true;
            } else {
                ++it;
            }
        }
        // A session's buffers are freed by now; without a trim glibc keeps
        // the pages (a 300-session soak left the RSS 16 MB above its start).
        if (released) ::malloc_trim(0);
    }
}

}  // namespace

int run_server(const ServeOptions& options) {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    give_relay_priority(options.relay_nice);
    Server server(options);
    return server.run();
}

}  // namespace cellblock
