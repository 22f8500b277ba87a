// Start-up: the state directory and its lock, images, the pool, the manager socket.
#include "server.hpp"
#include "server_key.hpp"

namespace cellblock {

void write_server_file(const fs::path& path, const std::string& endpoint, const std::string& key,
                       const fs::path& files_socket) {
    json j = {{"manager", endpoint},
              {"key", key},
              {"signature_scheme", "hmac-sha256"},
              {"pid", ::getpid()},
              {"version", kVersion}};
    if (!files_socket.empty()) j["files_socket"] = files_socket.string();
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
    egress_ = start_egress_gateway(options_.egress, options_.policy.maxima.network,
                                   options_.paths.egress_gateway);
    if (options_.weigh_sandboxes) {
        // The server relays every session's messages: next to sandboxes that
        // weigh many processes it must weigh as much, or each message waits
        // behind their spins (bench figure 6: 30-65 ms of run-queue wait per
        // round trip in the server once ten spinning sessions weighed ten).
        if (const std::string why = join_servers_cgroup(); !why.empty())
            spdlog::warn("the server keeps the host's CPU weight: {}", why);
        // A server that ended without its shutdown (--cpu-idle) may have left
        // the parent idle: every sandbox would then wait on every host process.
        set_sandboxes_cpu_idle(false);
        try {
            cpu_demand_ = std::make_unique<HostCpuDemand>(options_.cpu_demand_dir);
        } catch (const std::exception& e) {
            spdlog::warn("the sandboxes' CPU weight follows this server's sessions only: {}",
                         e.what());
        }
    }

    // The server key seals what outlives this process (docs/restarts.md):
    // made on first use when sandboxes are to outlive a crash, read when the
    // last server left rows. Without it sandboxes end with the server.
    std::vector<HandoverRow> handover = store_.handovers();
    const bool grace = options_.adopt_grace_s > 0;
    if (grace || !handover.empty()) {
        try {
            server_key_ = load_server_key(options_.key_file, grace);
        } catch (const std::exception& e) {
            server_key_error_ = e.what();
            spdlog::error("server key: {}: {}", server_key_error_,
                          grace ? "sandboxes end with this server (no --adopt-grace)"
                                : "the sessions the last server left cannot be taken back");
        }
    }
    if (grace && server_key_) {
        settings_.adopt_grace_ms = static_cast<int>(options_.adopt_grace_s * 1000);
    }
    if (options_.backend == "swarm") {
        SwarmSettings swarm = options_.swarm;
        swarm.state_dir = options_.paths.state_dir;
        swarm.libexec_dir = settings_.libexec_dir;
        swarm_ = std::make_shared<SwarmBackend>(swarm);
        spdlog::info(
            "backend swarm: manager {}, server id {}, network {}, images tagged "
            "for shim {}{}",
            swarm.docker_host, swarm_->server_id(), swarm.network, swarm_->settings().libexec_tag,
            swarm.share_boot_memory ? ", kernels sharing their boot memory (KSM)" : "");
    }
    // Sandboxes a crashed server left running within their grace are taken
    // back first (their locks held, the reaper passes them by).
    adopt_sandboxes(handover);
    if (swarm_) swarm_->remove_unclaimed();
    std::set<std::string> adopted;
    for (const auto& a : adopting_) adopted.insert(a.id);

    // Crash recovery: whatever an earlier server left is reaped, then marked.
    // First any process still running as an open session's host ids (the
    // registry has the range; while its session dir is there no one else can
    // lease it), then the sandboxes themselves.
    for (const auto& s : store_.sessions(true, 1000000)) {
        if (s.host_id_count == 0 || adopted.count(s.id)) continue;
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
    // Sessions the last server handed over (SIGHUP, docs/restarts.md) and
    // those adopted are taken over below; every other open one ended with
    // that server.
    const std::set<std::string> handed = handed_over_sessions();
    std::set<std::string> carried = handed;
    carried.insert(adopted.begin(), adopted.end());
    for (const auto& id : store_.close_all_open("server_restart", unix_now(), carried)) {
        spdlog::info("session {} marked closed: server_restart", id);
        if (auto failed = adopt_failures_.find(id); failed != adopt_failures_.end()) {
            store_.add_event({id, unix_now(), "closed", "not adopted: " + failed->second});
        }
    }
    SnapshotCaps caps;
    caps.per_session = options_.snapshot_max_mb << 20;
    caps.total = options_.snapshots_max_mb << 20;
    snapshots_ = std::make_unique<SnapshotStore>(settings_.state_dir / "snapshots", caps);
    for (const auto& left : fs::directory_iterator(snapshots_->root())) {
        if (handed.count(left.path().filename().string())) continue;
        spdlog::info("snapshot of session {} removed: its server ended",
                     left.path().filename().string());
    }
    snapshots_->clear(handed);

    register_requests();

    wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_fd_) throw std::runtime_error(std::string("eventfd: ") + strerror(errno));
    sigset_t signals;
    sigemptyset(&signals);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR2}) sigaddset(&signals, sig);
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
    std::shared_ptr<SandboxBackend> backend;
    if (swarm_) {
        backend = std::move(swarm_);
    } else {
        backend = std::make_shared<RuncBackend>(settings_);
    }
    spdlog::info("kernel transport: {}, client transport: {}",
                 relay_transport_name(options_.kernel_transport),
                 relay_transport_name(options_.client_transport));
    pool_ = std::make_unique<SandboxPool>(
        std::move(backend),
        [ctx, stopping = &stopping_, transport = options_.kernel_transport](
            Sandbox& box, bool background) -> std::shared_ptr<InnerChannels> {
            // A fork a client waits for skips the warm-up: it would cost the
            // create about 8 ms to save the first execution 2-4 (zygote.md).
            const HostProcess* host = box.host_process();
            const bool warm_up = background || !host || !host->forked();
            return std::shared_ptr<InnerChannels>(
                probe_kernel(*ctx, box, kProbeTimeout, 64 << 20, stopping, transport, warm_up));
        },
        std::move(pool_images),
        [wake] {
            const std::uint64_t one = 1;
            [[maybe_unused]] auto n = ::write(wake, &one, sizeof one);
        },
        options_.pool_workers);

    // The last server's endpoint and key, if it handed over: its clients
    // hold them. Its port taken meanwhile, a new one (logged; the clients
    // read server.json again).
    const std::string last_endpoint = take_over_manager(handover);
    try {
        manager_.bind(last_endpoint.empty() ? options_.manager_endpoint : last_endpoint);
    } catch (const zmq::error_t& e) {
        if (last_endpoint.empty()) throw;
        spdlog::warn("handover: the manager's last endpoint {}: {}; binding {}", last_endpoint,
                     e.what(), options_.manager_endpoint);
        manager_.bind(options_.manager_endpoint);
    }
    take_over_sessions(handover);
    take_over_adopted();
    open_local_files();
    if (!options_.metrics_address.empty()) start_metrics();
    write_server_file(server_file(settings_.state_dir), manager_.endpoint(), manager_.key(),
                      local_listener_ ? local_files_socket(settings_.state_dir) : fs::path());
}

void Server::register_requests() {
    const std::pair<const char*, json (Server::*)(Request&, std::vector<std::string>&)> requests[] =
        {{"session_create_request", &Server::session_create},
         {"session_hibernate_request", &Server::session_hibernate},
         {"session_resume_request", &Server::session_resume},
         {"server_info_request", &Server::server_info}};
    const auto bound = [this](json (Server::*handler)(Request&, std::vector<std::string>&)) {
        return [this, handler](Request& r, std::vector<std::string>& buffers) {
            return (this->*handler)(r, buffers);
        };
    };
    for (const auto& [type, handler] : requests) manager_.handle(type, bound(handler));
    // The requests that read or close sessions go through the narrow
    // SessionService (session_requests.hpp).
    const std::pair<const char*, json (SessionRequests::*)(const json&)> reads[] = {
        {"session_list_request", &SessionRequests::list},
        {"session_info_request", &SessionRequests::info},
        {"session_close_request", &SessionRequests::close},
        {"session_history_request", &SessionRequests::history}};
    for (const auto& [type, handler] : reads) {
        manager_.handle(type, [this, handler](Request& r, std::vector<std::string>&) {
            return (session_requests_.*handler)(r.message.content);
        });
    }
    for (const auto& type : FileTransfers::request_types()) {
        manager_.handle(type, bound(&Server::file_request));
    }
    // The largest request anyone needs: one file in one message, or one chunk.
    manager_.set_max_request_bytes(
        std::max<std::size_t>(static_cast<std::size_t>(options_.policy.max_inline_file_bytes),
                              transfers_.limits().max_chunk_bytes) +
        (1 << 20));
    // With --metrics (started later), each create's answer is counted.
    manager_.watch_replies([this](const WireMessage& request, const json& content) {
        if (metrics_) count_create_reply(request, content);
    });
}

Server::~Server() {
    // The metrics endpoint's thread reads the pool: it stops first.
    metrics_http_.reset();
    stopping_ = true;  // kernel starts still being probed give up now
    for (auto& [id, session] : sessions_) {
        if (SessionProxy* relay = session.proxy()) relay->close("server_shutdown");
    }
    sessions_.clear();
    // Seals that wait for a kernel's file stop waiting.
    for (const auto& [id, streamed] : streamed_) {
        if (streamed->keeping) streamed->keeping->cancelled = true;
    }
    background_.reset();  // waits for seals under way; a waking sandbox is destroyed
    if (snapshots_) snapshots_->abandon_unfinished();
    audit_.flush();
    pool_.reset();  // joins workers, destroys warm sandboxes
    std::error_code ec;
    fs::remove(server_file(settings_.state_dir), ec);
    if (local_listener_) fs::remove(local_files_socket(settings_.state_dir), ec);
}

}  // namespace cellblock
