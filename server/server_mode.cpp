#include "server_mode.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <unordered_map>

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/cpu_fairness.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/sandbox_pool.hpp"
#include "cellblock/session_store.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
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

double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// A manager request failed in a way the client should be told about.
struct RequestError {
    std::string ename, evalue;
};

// A relative path inside /data/input or /data/output, checked as text:
// no absolute path, no "..", no empty or "." components, no NUL.
std::string checked_relative_path(std::string path, const std::string& prefix) {
    if (path.rfind(prefix + "/", 0) == 0) path = path.substr(prefix.size() + 1);
    if (path.empty() || path.size() > 4096 || path[0] == '/' ||
        path.find('\0') != std::string::npos) {
        throw RequestError{"InvalidPath", "path '" + path + "' must be relative to " + prefix};
    }
    std::size_t start = 0;
    while (start <= path.size()) {
        const std::size_t end = std::min(path.find('/', start), path.size());
        const std::string part = path.substr(start, end - start);
        if (part.empty() || part == "." || part == ".." || part.size() > 255) {
            throw RequestError{"InvalidPath",
                               "path '" + path + "' leaves " + prefix + " or is not normal"};
        }
        start = end + 1;
    }
    return path;
}

// Opens a file under `dir` without following any symlink and without leaving
// `dir` (the sandbox writes /data/output: everything in it is hostile).
int open_beneath(const fs::path& dir, const std::string& relative, int flags, mode_t mode = 0) {
    const int dirfd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0) throw RequestError{"FileError", "session directory is gone"};
    open_how how{};
    how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC | O_NOFOLLOW);
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
    const int fd =
        static_cast<int>(::syscall(SYS_openat2, dirfd, relative.c_str(), &how, sizeof how));
    const int saved = errno;
    ::close(dirfd);
    errno = saved;
    return fd;
}

void write_server_file(const fs::path& path, const std::string& endpoint, const std::string& key) {
    const json j = {{"manager", endpoint},
                    {"key", key},
                    {"signature_scheme", "hmac-sha256"},
                    {"pid", ::getpid()},
                    {"version", kVersion}};
    const fs::path tmp = path.string() + ".tmp";
    const int fd = ::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) throw std::runtime_error("server file " + tmp.string() + ": " + strerror(errno));
    ::fchmod(fd, 0600);
    const std::string text = j.dump(2) + "\n";
    const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    ::close(fd);
    if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
        throw std::runtime_error("server file " + path.string() + ": cannot write");
    }
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
    };
    struct PendingCreate {
        WireMessage request;
        std::string session_id;
        std::string image;
        SessionLimits limits;
        json metadata;
        Clock::time_point started;
        std::string image_id;  // content id of a built image's root
    };
    using Handler = json (Server::*)(Request&, std::vector<std::string>& reply_buffers);

    void on_manager();
    void reply(const WireMessage& request, json content, std::vector<std::string> buffers = {});
    void on_pool_results();
    void finish_create(PendingCreate& pending, WarmSandbox warm, double start_ms, bool warm_start);
    SessionProxy& live_session(const json& content);
    void flush_audit();
    std::string session_id_of(const json& content) const;

    json session_create(Request& r, std::vector<std::string>& buffers);
    json session_list(Request& r, std::vector<std::string>& buffers);
    json session_info(Request& r, std::vector<std::string>& buffers);
    json session_close(Request& r, std::vector<std::string>& buffers);
    json session_history(Request& r, std::vector<std::string>& buffers);
    json file_put(Request& r, std::vector<std::string>& buffers);
    json file_get(Request& r, std::vector<std::string>& buffers);
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
    int wake_fd_ = -1;
    int signal_fd_ = -1;
    std::unique_ptr<SandboxPool> pool_;
    std::map<std::string, std::unique_ptr<SessionProxy>> sessions_;
    std::unordered_map<std::uint64_t, PendingCreate> creating_;
    std::unordered_map<std::string, std::uint64_t> input_bytes_;
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
              options.paths.state_dir / "cellblock.db")) {
    settings_.state_dir = options_.paths.state_dir;
    settings_.libexec_dir = options_.paths.libexec_dir;
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
                 {"file_put_request", &Server::file_put},
                 {"file_get_request", &Server::file_get},
                 {"server_info_request", &Server::server_info}};

    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
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
    const int wake = wake_fd_;
    pool_ = std::make_unique<SandboxPool>(
        settings_,
        [ctx](Sandbox& box) -> std::shared_ptr<void> {
            return std::shared_ptr<InnerChannels>(probe_kernel(*ctx, box, kProbeTimeout));
        },
        std::move(pool_images),
        [wake] {
            const std::uint64_t one = 1;
            [[maybe_unused]] auto n = ::write(wake, &one, sizeof one);
        },
        options_.pool_workers);

    manager_.set(zmq::sockopt::linger, 1000);
    manager_.set(zmq::sockopt::maxmsgsize,
                 static_cast<int64_t>(options_.policy.max_file_bytes + (1 << 20)));
    manager_.set(zmq::sockopt::router_handover, 1);
    manager_.bind(options_.manager_endpoint);
    manager_endpoint_ = manager_.get(zmq::sockopt::last_endpoint);
    write_server_file(server_file(settings_.state_dir), manager_endpoint_, key_);
}

Server::~Server() {
    for (auto& [id, session] : sessions_) session->close("server_shutdown");
    sessions_.clear();
    flush_audit();
    pool_.reset();  // joins workers, destroys warm sandboxes
    std::error_code ec;
    fs::remove(server_file(settings_.state_dir), ec);
    if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Server::reply(const WireMessage& request, json content, std::vector<std::string> buffers) {
    const std::string type = request.msg_type();
    WireMessage msg = make_reply(request, type.substr(0, type.size() - 8) + "_reply",
                                 std::move(content), "cellblock-server");
    msg.buffers = std::move(buffers);
    std::vector<zmq::message_t> frames;
    for (auto& f : encode(msg, signer_)) frames.push_back(to_frame(f));
    send_multipart(manager_, frames);
}

void Server::on_manager() {
    // A burst of requests is handled in one turn, bounded so sessions keep flowing.
    for (int i = 0; i < 64 && recv_multipart(manager_, scratch_, 64); ++i) {
        const auto views = scratch_.views();
        const std::string_view sender = views.empty() ? std::string_view() : views[0];
        if (scratch_.dropped_frames > 0) {
            spdlog::warn("manager: rejected message from {}: too many frames",
                         identity_text(sender));
            continue;
        }
        WireLimits limits;
        limits.max_total_bytes =
            static_cast<std::size_t>(options_.policy.max_file_bytes) + (1 << 20);
        auto decoded = decode(views, signer_, &replay_, limits);
        if (!decoded.message) {
            spdlog::warn("manager: rejected message from {}: {}", identity_text(sender),
                         decoded.error);
            continue;
        }
        Request request{std::move(*decoded.message)};
        const std::string type = request.message.msg_type();
        if (type.size() < 9 || type.substr(type.size() - 8) != "_request") {
            spdlog::warn("manager: rejected message from {}: '{}' is not a request",
                         identity_text(sender), type);
            continue;
        }
        auto handler = handlers_.find(type);
        if (handler == handlers_.end()) {
            reply(request.message, {{"status", "error"},
                                    {"ename", "UnknownRequest"},
                                    {"evalue", "the manager does not know '" + type + "'"}});
            continue;
        }
        std::vector<std::string> buffers;
        try {
            json content = (this->*(handler->second))(request, buffers);
            if (!content.is_null()) reply(request.message, std::move(content), std::move(buffers));
        } catch (const RequestError& e) {
            reply(request.message, {{"status", "error"}, {"ename", e.ename}, {"evalue", e.evalue}});
        } catch (const PolicyError& e) {
            reply(request.message,
                  {{"status", "error"}, {"ename", e.ename()}, {"evalue", e.what()}});
        } catch (const std::exception& e) {
            spdlog::error("manager {}: {}", type, e.what());
            reply(request.message,
                  {{"status", "error"}, {"ename", "ServerError"}, {"evalue", e.what()}});
        }
    }
}

std::string Server::session_id_of(const json& content) const {
    auto it = content.find("session_id");
    if (it == content.end() || !it->is_string() || it->get<std::string>().empty()) {
        throw RequestError{"InvalidRequest", "session_id (a string) is required"};
    }
    return it->get<std::string>();
}

SessionProxy& Server::live_session(const json& content) {
    const std::string id = session_id_of(content);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
        if (auto record = store_.session(id)) {
            throw RequestError{"SessionClosed",
                               "session " + id + " is closed: " + record->close_reason};
        }
        throw RequestError{"NoSuchSession", "no session " + id};
    }
    if (it->second->closed()) {
        throw RequestError{"SessionClosed",
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
        throw RequestError{"UnknownImage", "no image '" + image_name + "'; known images: " + known};
    }
    // A built image runs on its current version (a rebuild moves the name).
    follow_image_version(image_name);
    Image resolved;
    try {
        resolved = resolve_image(image->second, image_store_);
    } catch (const std::exception& e) {
        throw RequestError{"ImageNotBuilt", e.what()};
    }
    const json requested = c.contains("limits") ? c["limits"] : json::object();
    if (!requested.is_object() && !requested.is_null()) {
        throw RequestError{"InvalidLimits", "limits must be an object"};
    }
    const SessionLimits limits = options_.policy.effective(resolved.limits_json, requested);
    const json metadata = c.contains("metadata") ? c["metadata"] : json::object();
    if (!metadata.is_object()) throw RequestError{"InvalidRequest", "metadata must be an object"};
    if (sessions_.size() + creating_.size() >=
        static_cast<std::size_t>(options_.policy.max_sessions)) {
        throw RequestError{"TooManySessions", "the server holds its maximum of " +
                                                  std::to_string(options_.policy.max_sessions) +
                                                  " sessions"};
    }
    // The image's runtime, or the one the request names (allowlisted, installed).
    Image image_def = resolved;
    if (c.contains("runtime") && !c["runtime"].is_null()) {
        if (!c["runtime"].is_string() || !runtime_allowed(c["runtime"].get<std::string>())) {
            throw RequestError{"UnknownRuntime", "runtime must be one of runc, runsc, crun"};
        }
        image_def.runtime = c["runtime"].get<std::string>();
    }
    if (!runtime_installed(image_def.runtime)) {
        throw RequestError{"UnknownRuntime",
                           "runtime '" + image_def.runtime + "' is not installed on this host"};
    }
    PendingCreate pending{r.message, "",           image_name,          limits,
                          metadata,  Clock::now(), image_def.content_id};
    // The pool holds sandboxes of the image's own runtime and pool version only.
    const auto pool_id = pool_image_ids_.find(image_name);
    if (image_def.runtime == resolved.runtime && pool_id != pool_image_ids_.end() &&
        pool_id->second == image_def.content_id) {
        if (WarmSandbox warm = pool_->take(image_name, limits.sandbox)) {
            pending.session_id = warm.sandbox->session_id();
            finish_create(pending, std::move(warm), 0, true);
            return nullptr;
        }
    }
    pending.session_id = make_session_id();
    const std::uint64_t ticket = pool_->start_cold(pending.session_id, image_def, limits.sandbox);
    creating_.emplace(ticket, std::move(pending));
    return nullptr;  // answered when the sandbox is up
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
    [[maybe_unused]] auto n = ::read(wake_fd_, &count, sizeof count);
    for (auto& result : pool_->drain_results()) {
        auto it = creating_.find(result.ticket);
        if (it == creating_.end()) {
            pool_->dispose(std::move(result.warm.sandbox));
            continue;
        }
        PendingCreate pending = std::move(it->second);
        creating_.erase(it);
        if (!result.warm) {
            spdlog::error("session {}: the sandbox did not start: {}", pending.session_id,
                          result.error);
            reply(pending.request,
                  {{"status", "error"}, {"ename", "SandboxStartFailed"}, {"evalue", result.error}});
            continue;
        }
        try {
            finish_create(pending, std::move(result.warm), result.start_ms, false);
        } catch (const std::exception& e) {
            reply(pending.request,
                  {{"status", "error"}, {"ename", "ServerError"}, {"evalue", e.what()}});
        }
    }
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
        }
        list.push_back(entry);
    }
    return {{"status", "ok"}, {"sessions", list}};
}

json Server::session_info(Request& r, std::vector<std::string>&) {
    const std::string id = session_id_of(r.message.content);
    const auto record = store_.session(id);
    if (!record) throw RequestError{"NoSuchSession", "no session " + id};
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
    if (!record) throw RequestError{"NoSuchSession", "no session " + id};
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
    return {{"status", "ok"},           {"session_id", id},
            {"image", record->image},   {"image_id", record->image_id},
            {"state", record->state},   {"close_reason", record->close_reason},
            {"executions", executions}, {"events", events}};
}

json Server::file_put(Request& r, std::vector<std::string>&) {
    SessionProxy& s = live_session(r.message.content);
    const json& c = r.message.content;
    if (!c.contains("path") || !c["path"].is_string())
        throw RequestError{"InvalidRequest", "path is required"};
    const std::string path = checked_relative_path(c["path"].get<std::string>(), kSandboxInputDir);
    if (r.message.buffers.size() != 1) {
        throw RequestError{"InvalidRequest",
                           "file_put_request carries the file as exactly one buffer"};
    }
    const std::string& data = r.message.buffers[0];
    const auto cap = static_cast<std::uint64_t>(options_.policy.max_file_bytes);
    std::uint64_t& used = input_bytes_[s.session_id()];
    const std::uint64_t session_cap =
        static_cast<std::uint64_t>(s.governor()->limits().sandbox.disk_mb) << 20;
    if (data.size() > cap) {
        throw RequestError{"FileTooLarge", std::to_string(data.size()) + " bytes is over the " +
                                               std::to_string(cap) + "-byte limit"};
    }
    if (used + data.size() > session_cap) {
        throw RequestError{"FileTooLarge", "the session's input files would pass " +
                                               std::to_string(session_cap >> 20) + " MB"};
    }
    const fs::path base = s.sandbox()->input_dir();
    // Parent folders, one component at a time, beneath the input dir.
    std::size_t slash = 0;
    while ((slash = path.find('/', slash)) != std::string::npos) {
        const fs::path dir = base / path.substr(0, slash);
        if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
            throw RequestError{"FileError",
                               "mkdir " + path.substr(0, slash) + ": " + strerror(errno)};
        }
        ++slash;
    }
    const int fd = open_beneath(base, path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) throw RequestError{"FileError", "open " + path + ": " + strerror(errno)};
    const bool ok = ::write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size());
    ::fchmod(fd, 0644);
    ::close(fd);
    if (!ok) throw RequestError{"FileError", "write " + path + " failed"};
    used += data.size();
    on_event(s.session_id(), "file_put", path + " (" + std::to_string(data.size()) + " bytes)");
    return {{"status", "ok"},
            {"path", std::string(kSandboxInputDir) + "/" + path},
            {"size", data.size()}};
}

json Server::file_get(Request& r, std::vector<std::string>& buffers) {
    SessionProxy& s = live_session(r.message.content);
    const json& c = r.message.content;
    if (!c.contains("path") || !c["path"].is_string())
        throw RequestError{"InvalidRequest", "path is required"};
    const std::string path = checked_relative_path(c["path"].get<std::string>(), kSandboxOutputDir);
    const int fd = open_beneath(s.sandbox()->output_dir(), path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) {
        const int err = errno;
        throw RequestError{err == ENOENT ? "FileNotFound" : "FileError",
                           std::string(kSandboxOutputDir) + "/" + path + ": " + strerror(err)};
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw RequestError{"FileError", path + " is not a regular file"};
    }
    if (st.st_size > options_.policy.max_file_bytes) {
        ::close(fd);
        throw RequestError{"FileTooLarge",
                           path + " is " + std::to_string(st.st_size) + " bytes, over the " +
                               std::to_string(options_.policy.max_file_bytes) + "-byte limit"};
    }
    std::string data(static_cast<std::size_t>(st.st_size), '\0');
    std::size_t got = 0;
    while (got < data.size()) {
        const ssize_t n = ::read(fd, data.data() + got, data.size() - got);
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
    }
    ::close(fd);
    data.resize(got);
    buffers.push_back(std::move(data));
    return {{"status", "ok"}, {"path", std::string(kSandboxOutputDir) + "/" + path}, {"size", got}};
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
    std::size_t open = 0;
    for (const auto& [id, s] : sessions_) open += s->closed() ? 0 : 1;
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
        const auto running = session->running_since();
        const bool sustained = running ? now - *running >= fairness.policy().long_execution
                                       : session->idle_since() <= fairness.last_sample();
        const auto weight = fairness.observe(now, box->usage().cpu_ns, sustained);
        if (!weight) continue;
        const bool demoted = fairness.demoted();
        // The kernel refuses a shares write to an idle group: leave idle first.
        bool applied;
        if (demoted) {
            applied = box->set_cpu_weight(*weight);
            applied = box->set_cpu_idle(true) || applied;
        } else {
            applied = box->set_cpu_idle(false);
            applied = box->set_cpu_weight(*weight) || applied;
        }
        if (!applied) continue;
        spdlog::info("session {}: CPU weight {} ({})", id, *weight,
                     demoted ? "it has burned CPU without pause" : "it has calmed down");
        on_event(id, demoted ? "cpu_demoted" : "cpu_restored",
                 "cpu.shares " + std::to_string(*weight) + (demoted ? ", cpu.idle 1" : ""));
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
    input_bytes_.erase(session_id);
    fairness_.erase(session_id);
    auto it = sessions_.find(session_id);
    std::int64_t executions = 0;
    if (it != sessions_.end() && it->second->governor())
        executions = it->second->governor()->executions();
    try {
        store_.close_session(session_id, reason, unix_now(), executions, 0, 0);
        store_.add_event({session_id, unix_now(), "closed", reason});
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

int Server::run() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    signal_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    spdlog::info("cellblock serve: manager on {}, state in {}, {} image(s)", manager_endpoint_,
                 settings_.state_dir.string(), images_.size());
    std::vector<zmq::pollitem_t> items;
    std::vector<SessionProxy*> order;
    for (;;) {
        items.clear();
        order.clear();
        items.push_back({manager_.handle(), 0, ZMQ_POLLIN, 0});
        items.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
        items.push_back({nullptr, signal_fd_, ZMQ_POLLIN, 0});
        std::optional<Clock::time_point> next;
        for (auto& [id, session] : sessions_) {
            order.push_back(session.get());
            session->add_poll_items(items);
            if (auto d = session->next_deadline(); d && (!next || *d < *next)) next = d;
        }
        if (!sessions_.empty() && (!next || next_balance_ < *next)) next = next_balance_;
        if (!next || next_version_check_ < *next) next = next_version_check_;
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
            [[maybe_unused]] auto n = ::read(signal_fd_, &info, sizeof info);
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
        if (now >= next_balance_) balance_cpu(now);
        if (now >= next_version_check_) {
            for (const auto& [name, image] : images_) follow_image_version(name);
            next_version_check_ = now + kPoolVersionCheck;
        }
        for (auto it = sessions_.begin(); it != sessions_.end();) {
            it->second->on_timer(now);
            if (it->second->expired(now)) {
                it = sessions_.erase(it);
            } else {
                ++it;
            }
        }
    }
}

}  // namespace

int run_server(const ServeOptions& options) {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    Server server(options);
    return server.run();
}

}  // namespace cellblock
