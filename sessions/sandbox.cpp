// A session's sandbox: its start (bundle, mounts, runtime, lifeline), signals,
// exit and destruction. Cgroups, the lifeline, gVisor and the reaper have files
// of their own (sandbox_internal.hpp).
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_tuning.hpp"
#include "cellblock/session_dir.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/image_builder.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"
#include "sandbox_internal.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::uint64_t read_u64(const fs::path& path) {
    std::ifstream in(path);
    std::uint64_t v = 0;
    in >> v;
    return v;
}

// Last lines of the session log, for error messages.
std::string log_tail(const fs::path& log) {
    std::string text = read_text(log);
    if (text.size() > 2000) text = text.substr(text.size() - 2000);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
}

std::string container_id_for(const std::string& session_id) { return "cb-" + session_id; }

std::vector<std::string> runtime_argv(const RuntimeSettings& s, std::vector<std::string> args) {
    std::vector<std::string> argv{s.runtime, "--root", s.runtime_root().string()};
    if (runtime_kind(s.runtime) == RuntimeKind::runsc) {
        // gVisor's own network stack with nothing but loopback; unix sockets in
        // the bind-mounted ipc dir are host sockets (the kernel's, which it
        // creates, and the lifeline, which the shim opens); the bundle's
        // seccomp profile is enforced by the Sentry on the sandbox's processes.
        for (const char* flag : {"--network=none", "--host-uds=all", "--oci-seccomp"}) {
            argv.emplace_back(flag);
        }
    }
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
}

// Which runtime created a session dir (written at start, read by the reaper).
fs::path runtime_file(const fs::path& dir) { return SessionDir(dir).runtime_file(); }

void write_runtime_file(const fs::path& dir, const std::string& runtime) {
    std::ofstream out(runtime_file(dir));
    out << runtime << "\n";
    if (!out) throw SandboxError("write " + runtime_file(dir).string());
}

void write_value(const fs::path& file, const std::string& value) {
    const UniqueFd fd(::open(file.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) throw SandboxError("write " + file.string() + " = " + value + ": " + errno_text());
    const ssize_t n = ::write(fd.get(), value.data(), value.size());
    if (n != static_cast<ssize_t>(value.size())) {
        const std::string why = errno_text();
        throw SandboxError("write " + file.string() + " = " + value + ": " + why);
    }
}

void reap_child(pid_t pid) {
    if (pid <= 0) return;
    for (int i = 0; i < 200; ++i) {
        const pid_t r = ::waitpid(pid, nullptr, WNOHANG);
        if (r == pid || (r < 0 && errno == ECHILD)) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // A killed PID namespace init ends only once the kernel has torn down
    // every process of its namespace, which takes seconds while dozens of
    // sandboxes close at once on a loaded host. Left unreaped it would stay a
    // zombie, still counted as running as the sandbox's host ids, for the
    // server's whole life: a thread waits for it instead.
    std::thread([pid] {
        while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
        }
    }).detach();
}
}  // namespace cellblock::sandbox_detail

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;

bool runtime_allowed(const std::string& name) {
    return name == "runc" || name == "runsc" || name == "crun";
}

bool runtime_installed(const std::string& runtime) {
    if (runtime.empty()) return false;
    if (runtime.find('/') != std::string::npos) return ::access(runtime.c_str(), X_OK) == 0;
    // The PATH run_process gives the runtime's parent.
    for (const char* dir :
         {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
        const fs::path candidate = fs::path(dir) / runtime;
        std::error_code ec;
        if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0)
            return true;
    }
    return false;
}

std::unique_ptr<RuncSandbox> RuncSandbox::prepare(const std::string& session_id, const Image& image,
                                                  const SandboxLimits& limits,
                                                  const RuntimeSettings& settings) {
    std::unique_ptr<RuncSandbox> box(new RuncSandbox());
    box->session_id_ = session_id;
    box->container_id_ = container_id_for(session_id);
    box->settings_ = settings;
    box->limits_ = limits;
    box->image_name_ = image.name;
    box->preload_ = image.preload;
    box->bridged_ = image.hibernate_level == "exact";
    box->dir_ = SessionDir(settings.sessions_dir() / session_id);
    const fs::path& dir = box->dir();
    if (!image.content_id.empty() && !image.rootfs.empty() && image.rootfs[0] == '/') {
        // Kept from here until destroy(): `image rm` leaves this version alone.
        try {
            box->version_fd_.reset(hold_stored_version(image.rootfs));
        } catch (const std::exception& e) {
            throw SandboxError("image " + image.name + ": " + e.what());
        }
    }
    // A host id range of its own, so that the kernel's per-uid quotas
    // (keys, processes, inotify, mqueue) are this sandbox's alone.
    try {
        box->host_ids_ = lease_host_ids(settings.host_ids, dir);
    } catch (const std::exception& e) {
        throw SandboxError("session " + session_id + ": " + e.what());
    }
    const std::uint32_t sandbox_host_uid = box->host_ids().host_uid(kSandboxUid);

    // runc --detach leaves the sandbox's init to its parent's nearest
    // subreaper: make that us, so a dead init is reaped here, not left as a
    // zombie for the host's PID 1.
    static const bool subreaper = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
    (void)subreaper;
    std::error_code ec;
    fs::create_directories(settings.sessions_dir(), ec);
    fs::create_directories(settings.runtime_root(), ec);
    // Traversable but not listable: the mapped container root must reach its bundle.
    ::chmod(settings.state_dir.c_str(), 0711);
    ::chmod(settings.sessions_dir().c_str(), 0711);
    if (::mkdir(dir.c_str(), 0711) != 0) {
        throw SandboxError("session dir " + dir.string() + ": " + errno_text());
    }
    // The lock appears under its final name only once held, so a reaper in
    // another cellblock process never sees an unlocked lock of a live session.
    const SessionDir paths(dir);
    box->lock_fd_.reset(::open(paths.lock_staging().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
    if (!box->lock_fd_ || ::flock(box->lock_fd_.get(), LOCK_EX | LOCK_NB) != 0 ||
        ::rename(paths.lock_staging().c_str(), paths.lock().c_str()) != 0) {
        throw SandboxError("session lock " + paths.lock().string() + ": " + errno_text());
    }

    for (const fs::path& sub : paths.subdirectories()) {
        if (::mkdir(sub.c_str(), 0711) != 0) {
            throw SandboxError("mkdir " + sub.string() + ": " + errno_text());
        }
    }
    // The kernel creates its sockets in ipc/, so the sandbox can write there;
    // the directory is root's and sticky, and holds .server/ (root only) where
    // the server links the kernel's sockets before connecting: a socket the
    // sandbox later swaps for a symlink never redirects the server.
    mount_tmpfs(paths.ipc(), tuning::kIpcTmpfsMb, 0, "1777");
    if (::mkdir(paths.server_links().c_str(), 0700) != 0) {
        throw SandboxError("mkdir " + paths.server_links().string() + ": " + errno_text());
    }
    mount_tmpfs(paths.output(), limits.output_mb, sandbox_host_uid);
    // The init's stdout and stderr: its own 1 MB tmpfs, so nothing the sandbox
    // does can grow a file on the host's disk.
    mount_tmpfs(paths.log(), tuning::kLogTmpfsMb, 0);
    ::chmod(paths.input().c_str(), 0755);

    // The inner connection: ipc sockets in the session's own directory and a
    // key of its own. The client's key never enters the sandbox.
    ConnectionInfo inner;
    inner.transport = "ipc";
    // Bridged (the exact level): the kernel binds in its own /tmp and the
    // shim at ipc/ (kBridgeEnv), where the server links and connects as ever.
    inner.ip = std::string(image.hibernate_level == "exact" ? sandbox_protocol::kBridgeDir
                                                            : kSandboxIpcDir) +
               "/k";
    inner.shell_port = 1;
    inner.iopub_port = 2;
    inner.stdin_port = 3;
    inner.control_port = 4;
    inner.hb_port = 5;
    inner.key = make_random_key();
    inner.kernel_name = image.name;
    const fs::path conn_file = paths.connection_file();
    inner.write(conn_file);
    if (::chown(conn_file.c_str(), sandbox_host_uid, sandbox_host_uid) != 0) {
        throw SandboxError("chown " + conn_file.string() + ": " + errno_text());
    }
    box->inner_ = inner;
    box->inner_.ip = paths.kernel_sockets().string();
    return box;
}

// The bundle (config.json, and the skeleton root of a "host" image) and
// the runtime's name, in the prepared session dir.
void RuncSandbox::write_bundle(const Image& image, SandboxRole role) {
    const fs::path& dir = this->dir();
    const RuntimeSettings& settings = settings_;
    SandboxSpec spec;
    spec.role = role;
    if (role == SandboxRole::zygote) {
        // What the directory is, for operators and tests (`cellblock ls` lists zygotes).
        std::ofstream(dir / "role") << "zygote\n";
        // As high as runc may set it (it cannot raise past its own hard limit
        // where root lacks CAP_SYS_RESOURCE, as here).
        rlimit nproc{};
        if (::getrlimit(RLIMIT_NPROC, &nproc) == 0) {
            spec.nproc = nproc.rlim_max == RLIM_INFINITY ? (1u << 22) : nproc.rlim_max;
        }
    }
    spec.container_id = container_id_;
    spec.image = image;
    spec.image.host_binds.clear();
    for (const auto& path : image.host_binds) {
        if (fs::exists(path)) {
            spec.image.host_binds.push_back(path);
        } else {
            spdlog::debug("image {}: host path {} does not exist here; not bound", image.name,
                          path);
        }
    }
    spec.limits = limits_;
    spec.ids = host_ids();
    const SessionDir paths(dir);
    spec.rootfs = image.rootfs == "host" ? paths.bundle_rootfs() : fs::path(image.rootfs);
    spec.ipc_dir = paths.ipc();
    spec.input_dir = paths.input();
    spec.output_dir = paths.output();
    spec.libexec_dir = settings.libexec_dir;
    spec.runtime = settings.runtime;
    spec.adopt_grace_ms = settings.adopt_grace_ms;
    json config = make_oci_config(spec);
    if (settings.start_cpu_shares > 0)
        config["linux"]["resources"]["cpu"]["shares"] = settings.start_cpu_shares;
    try {
        if (image.rootfs == "host") prepare_host_rootfs(spec, config);
    } catch (const std::exception& e) {
        throw SandboxError(std::string("session ") + session_id_ + ": " + e.what());
    }
    {
        std::ofstream out(paths.bundle_config());
        out << config.dump(1);
        if (!out) throw SandboxError("write " + paths.bundle_config().string());
    }

    write_runtime_file(dir, settings.runtime);
}

std::unique_ptr<RuncSandbox> RuncSandbox::start(const std::string& session_id, const Image& image,
                                                const SandboxLimits& limits,
                                                const RuntimeSettings& settings, SandboxRole role) {
    std::unique_ptr<RuncSandbox> box = prepare(session_id, image, limits, settings);
    box->write_bundle(image, role);
    const fs::path& dir = box->dir();
    const SessionDir paths(dir);
    const std::uint32_t sandbox_host_uid = box->host_ids().host_uid(kSandboxUid);

    const fs::path log = paths.shim_log();
    UniqueFd log_fd(::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600));
    if (!log_fd) throw SandboxError("open " + log.string() + ": " + errno_text());
    const fs::path pid_file = dir / "init.pid";
    std::vector<std::string> run_args{"run", "--detach", "--pid-file", pid_file.string()};
    UniqueFd pass_fd;   // the init's end of the lifeline (runc, crun)
    UniqueFd listener;  // where the shim connects its lifeline (runsc)
    const fs::path lifeline_socket = paths.lifeline_socket();
    if (runtime_passes_fds(runtime_kind(settings.runtime))) {
        // One end of a socketpair becomes the init's fd 3.
        int pair[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
            throw SandboxError("lifeline socketpair: " + errno_text());
        }
        box->lifeline_.reset(pair[0]);
        pass_fd.reset(pair[1]);
        run_args.insert(run_args.end(), {"--preserve-fds", "1"});
    } else {
        // The shim connects to this socket as its first act, before the kernel
        // (the first untrusted code) exists; see accept_lifeline below.
        listener.reset(listen_lifeline(lifeline_socket, sandbox_host_uid));
    }
    run_args.insert(run_args.end(), {"--bundle", paths.bundle().string(), box->container_id_});
    const int exit_code = box->launch(run_args, pass_fd.get(), log_fd.get(), pid_file);
    pass_fd.reset();
    log_fd.reset();
    if (exit_code != 0) {
        throw SandboxError(settings.runtime + " run " + box->container_id_ + ": " +
                           sandbox_detail::log_tail(log));
    }
    if (box->init_pid_ <= 0) {
        throw SandboxError("pid file " + pid_file.string() + ": no pid");
    }
    if (listener) {
        // Only the first connection is taken; the socket is then closed and
        // unlinked, so nothing started later in the sandbox can reach it. The
        // shim connects before it starts the kernel, so the first is the shim's.
        box->lifeline_.reset(
            accept_lifeline(listener.get(), box->init_pid_, std::chrono::seconds(30)));
        listener.reset();
        ::unlink(lifeline_socket.c_str());
        if (!box->lifeline_) {
            throw SandboxError(settings.runtime + " run " + box->container_id_ +
                               ": the shim never connected to its lifeline; log: " +
                               sandbox_detail::log_tail(log));
        }
        // The exact level's restore needs it too: the restored shim connects
        // its lifeline again as an adopted one does.
        if (settings.adopt_grace_ms > 0 || box->bridged_) box->give_adopt_key();
    }
    box->cgroup_dirs_ = sandbox_cgroup_dirs(box->container_id_);
    box->open_counters();
    return box;
}

int RuncSandbox::launch(const std::vector<std::string>& args, int pass_fd, int log_fd,
                        const fs::path& pid_file) {
    const bool runsc = runtime_kind(settings_.runtime) == RuntimeKind::runsc;
    if (runsc) {
        std::lock_guard lock(runsc_children().mutex);
        ++runsc_children().starting;
    }
    const auto result = run_process(runtime_argv(settings_, args), pass_fd, log_fd);
    init_pid_ = static_cast<pid_t>(read_u64(pid_file));
    if (runsc) {
        const pid_t gofer = find_child_gofer(dir_.bundle());
        std::lock_guard lock(runsc_children().mutex);
        --runsc_children().starting;
        if (init_pid_ > 0) runsc_children().owned.insert(init_pid_);
        if (gofer > 0) runsc_children().owned.insert(gofer);
        gofer_pid_ = gofer;
    }
    return result.exit_code;
}

RuncSandbox::~RuncSandbox() { destroy(); }

bool RuncSandbox::read_lifeline() {
    if (exited_) return false;
    char buf[512];
    const ssize_t n = ::recv(lifeline_.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
        shim_status_.append(buf, static_cast<size_t>(std::min<ssize_t>(n, 512)));
        if (shim_status_.size() > 4096) shim_status_.resize(4096);
        return true;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    exited_ = true;
    return false;
}

std::string RuncSandbox::log_tail() const { return sandbox_detail::log_tail(dir_.shim_log()); }

bool RuncSandbox::memory_limit_hit() const {
    const auto u = usage();
    return u.oom_kills > 0 ||
           u.memory_peak_bytes >=
               (static_cast<std::uint64_t>(limits_.memory_mb) << 20) - (1u << 20);
}

std::string describe_kernel_exit(std::string_view lifeline_text) {
    using How = sandbox_protocol::KernelExit::How;
    const auto exit = sandbox_protocol::parse_kernel_exit(lifeline_text);
    switch (exit.how) {
        case How::exited:
            return "the kernel exited with status " + std::to_string(exit.value);
        case How::signaled:
            return "the kernel was killed by signal " + std::to_string(exit.value);
        case How::terminated:
            return "the sandbox's init was told to stop, and the kernel had not ended " +
                   std::to_string(sandbox_protocol::kShimTermGraceMs / 1000) +
                   " s after its SIGTERM";
        case How::unknown:
            break;
    }
    // No line: the init was killed, or it ended before the kernel had.
    return "the sandbox ended";
}

std::string RuncSandbox::exit_description() const {
    std::string text = describe_kernel_exit(shim_status_);
    if (memory_limit_hit()) {
        text += " (memory limit of " + std::to_string(limits_.memory_mb) + " MB reached)";
    }
    return text;
}

void RuncSandbox::give_adopt_key() {
    adopt_key_ = make_random_key().substr(0, sandbox_protocol::kAdoptKeyHexDigits);
    const std::string line = sandbox_protocol::adopt_key_line(adopt_key_);
    // Only the shim reads this socket (the kernel cannot reach it); fresh, so the line fits.
    if (::send(lifeline_.get(), line.data(), line.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(line.size())) {
        spdlog::warn("session {}: its shim did not take the key to adopt it by: {}", session_id_,
                     errno_text());
        adopt_key_.clear();  // not adoptable, then
    }
}

bool RuncSandbox::interrupt() {
    if (exited_ || init_pid_ <= 0) return true;
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) {
        // The init pid is gVisor's Sentry, which a SIGINT would end: ask the
        // shim over the lifeline instead (it forwards SIGINT to the kernel).
        const std::string line = std::string(sandbox_protocol::kInterruptLine) + "\n";
        [[maybe_unused]] auto n =
            ::send(lifeline_.get(), line.data(), line.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        return true;
    }
    ::kill(init_pid_, SIGINT);
    return true;
}

void RuncSandbox::kill() {
    // Killing PID 1 of the sandbox's PID namespace kills every process in it;
    // under runsc the init pid is the Sentry, whose death ends the sandbox too.
    if (init_pid_ > 0 && !reaped_) ::kill(init_pid_, SIGKILL);
    if (gofer_pid_ > 0 && !reaped_) ::kill(gofer_pid_, SIGKILL);
}

void RuncSandbox::reap_init() {
    if (init_pid_ <= 0 || reaped_) return;
    // The init (and runsc's gofer) is our child (we are a subreaper); after
    // SIGKILL it ends at once.
    for (pid_t pid : {init_pid_, gofer_pid_}) reap_child(pid);
    reaped_ = true;
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) {
        std::lock_guard lock(runsc_children().mutex);
        runsc_children().owned.erase(init_pid_);
        runsc_children().owned.erase(gofer_pid_);
    }
}

void RuncSandbox::destroy() {
    if (destroyed_) return;
    // A demoted sandbox runs a few ms per 100 ms: its killed processes would
    // take that long to die (a fork storm's hundreds, seconds), and its cgroup
    // outlive it. Its own quota back first.
    set_cpu_quota(limits().cpus);
    destroyed_ = true;
    close_counters();
    kill();
    reap_init();
    lifeline_.reset();
    remove_session(settings_, session_id_, dir());
    // By now (runsc delete has run) the Sentry's stubs are dead: reap them.
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) reap_runsc_orphans();
    lock_fd_.reset();
    version_fd_.reset();
    host_ids_.release();
    keep_.reset();
}

}  // namespace cellblock
