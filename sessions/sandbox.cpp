#include "cellblock/sandbox.hpp"

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
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string errno_text() { return std::strerror(errno); }

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

void mount_tmpfs(const fs::path& target, int size_mb, std::uint32_t owner,
                 const char* mode = "0700") {
    const std::string options = "size=" + std::to_string(size_mb) + "m,mode=" + mode +
                                ",uid=" + std::to_string(owner) + ",gid=" + std::to_string(owner);
    if (::mount("tmpfs", target.c_str(), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                options.c_str()) != 0) {
        throw SandboxError("mount tmpfs " + target.string() + ": " + errno_text());
    }
}

void unmount_if_mounted(const fs::path& target) {
    // MNT_DETACH so a process still holding a file there cannot keep the session alive.
    for (int i = 0; i < 4; ++i) {
        if (::umount2(target.c_str(), MNT_DETACH) != 0) break;
    }
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
fs::path runtime_file(const fs::path& dir) { return dir / "runtime"; }

// The lifeline of a runtime that cannot pass fds: a listening socket in the
// session's ipc dir (bind-mounted at /run/cellblock), connectable only by the
// sandbox's user.
int listen_lifeline(const fs::path& path, std::uint32_t owner) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.string().size() >= sizeof addr.sun_path) {
        throw SandboxError("lifeline socket path too long: " + path.string());
    }
    std::memcpy(addr.sun_path, path.c_str(), path.string().size());
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw SandboxError("lifeline socket: " + errno_text());
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::chown(path.c_str(), owner, owner) != 0 || ::chmod(path.c_str(), 0600) != 0 ||
        ::listen(fd, 1) != 0 || ::fcntl(fd, F_SETFL, O_NONBLOCK) != 0) {
        const std::string why = errno_text();
        ::close(fd);
        throw SandboxError("lifeline socket " + path.string() + ": " + why);
    }
    return fd;
}

bool process_gone(pid_t pid) {
    const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    return paren == std::string::npos || stat.compare(paren + 1, 3, " Z ") == 0;
}

// Accepts the shim's connection; -1 if the sandbox ended or the time passed first.
int accept_lifeline(int listener, pid_t init_pid, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        // A sandbox that ended at once may still have connected first: accept before judging.
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) return fd;
        if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) return -1;
        if ((init_pid > 0 && process_gone(init_pid)) ||
            std::chrono::steady_clock::now() >= deadline) {
            return -1;
        }
        pollfd p{listener, POLLIN, 0};
        ::poll(&p, 1, 50);
    }
}

// gVisor's Sentry forks its ptrace stubs; when the Sentry dies they are
// orphaned to the nearest subreaper (this process) and must be reaped here.
// The Sentry and gofer pids of live sandboxes are registered: their own
// reap_init waits for them, and it must be the one to (it kills them by pid).
struct RunscChildren {
    std::mutex mutex;
    std::set<pid_t> owned;  // Sentries and gofers of Sandbox objects not yet reaped
    int starting = 0;       // runsc runs whose pids are not registered yet
};
RunscChildren& runsc_children() {
    static RunscChildren children;
    return children;
}

// Reaps zombie children that gVisor left: comm "exe" (gVisor re-executes
// /proc/self/exe for the Sentry, the gofer and the stubs forked from the
// Sentry) and no live Sandbox's own pid. Skipped while a runsc start is between
// run and registration, when its pids are not known yet; a later sweep takes them.
void reap_runsc_orphans() {
    auto& children = runsc_children();
    std::lock_guard lock(children.mutex);
    if (children.starting > 0) return;
    const std::string self = std::to_string(::getpid());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        const std::string stat = read_text(entry.path() / "stat");
        const auto open = stat.find('(');
        const auto close = stat.rfind(')');
        if (open == std::string::npos || close == std::string::npos) continue;
        std::istringstream rest(stat.substr(close + 1));
        std::string state, ppid;
        rest >> state >> ppid;
        if (state != "Z" || ppid != self || stat.substr(open + 1, close - open - 1) != "exe")
            continue;
        const pid_t pid = static_cast<pid_t>(std::stoi(name));
        if (children.owned.count(pid)) continue;
        ::waitpid(pid, nullptr, WNOHANG);
    }
}

// runsc run --detach leaves its gofer to the nearest subreaper (us) too:
// found here so that it can be reaped with the sandbox.
pid_t find_child_gofer(const fs::path& bundle) {
    const std::string self = std::to_string(::getpid());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        const std::string stat = read_text(entry.path() / "stat");
        const auto paren = stat.rfind(')');
        if (paren == std::string::npos) continue;
        std::istringstream rest(stat.substr(paren + 1));
        std::string state, ppid;
        rest >> state >> ppid;
        if (ppid != self) continue;
        const std::string cmdline = read_text(entry.path() / "cmdline");
        if (cmdline.rfind(std::string("runsc-gofer") + '\0', 0) == 0 &&
            cmdline.find('\0' + bundle.string() + '\0') != std::string::npos) {
            return static_cast<pid_t>(std::stoi(name));
        }
    }
    return -1;
}

void remove_cgroups(const std::string& container_id) {
    for (const auto& dir : sandbox_cgroup_dirs(container_id)) {
        // A cgroup is removed with rmdir once empty; retry briefly while the
        // last processes are being torn down.
        for (int i = 0; i < 50 && fs::exists(dir); ++i) {
            if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
}

// Removes a session directory completely: the container, mounts, cgroups, files.
void remove_session(RuntimeSettings settings, const std::string& session_id, const fs::path& dir) {
    const std::string cid = container_id_for(session_id);
    // The runtime that created it, which may not be the caller's default.
    std::string recorded = read_text(runtime_file(dir));
    while (!recorded.empty() && recorded.back() == '\n') recorded.pop_back();
    if (!recorded.empty()) settings.runtime = recorded;
    const auto result = run_process(runtime_argv(settings, {"delete", "--force", cid}));
    if (result.exit_code != 0 && result.output.find("does not exist") == std::string::npos &&
        result.output.find("not exist") == std::string::npos) {
        spdlog::warn("session {}: {} delete: {}", session_id, settings.runtime, result.output);
    }
    unmount_if_mounted(dir / "ipc");
    unmount_if_mounted(dir / "output");
    unmount_if_mounted(dir / "log");
    remove_cgroups(cid);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) spdlog::warn("session {}: remove {}: {}", session_id, dir.string(), ec.message());
}

}  // namespace

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

std::vector<fs::path> sandbox_cgroup_dirs(const std::string& container_id) {
    std::vector<fs::path> dirs;
    const fs::path root = "/sys/fs/cgroup";
    if (fs::exists(root / "cgroup.controllers")) {
        dirs.push_back(root / "cellblock" / container_id);
        return dirs;
    }
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
        const fs::path dir = entry.path() / "cellblock" / container_id;
        if (fs::exists(dir)) dirs.push_back(dir);
    }
    return dirs;
}

std::unique_ptr<Sandbox> Sandbox::start(const std::string& session_id, const Image& image,
                                        const SandboxLimits& limits,
                                        const RuntimeSettings& settings) {
    std::unique_ptr<Sandbox> box(new Sandbox());
    box->session_id_ = session_id;
    box->container_id_ = container_id_for(session_id);
    box->settings_ = settings;
    box->limits_ = limits;
    box->image_name_ = image.name;
    box->preload_ = image.preload;
    box->dir_ = settings.sessions_dir() / session_id;
    const fs::path& dir = box->dir_;
    if (!image.content_id.empty() && !image.rootfs.empty() && image.rootfs[0] == '/') {
        // Kept from here until destroy(): `image rm` leaves this version alone.
        try {
            box->version_fd_ = hold_stored_version(image.rootfs);
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
    box->lock_fd_ = ::open((dir / "lock.new").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (box->lock_fd_ < 0 || ::flock(box->lock_fd_, LOCK_EX | LOCK_NB) != 0 ||
        ::rename((dir / "lock.new").c_str(), (dir / "lock").c_str()) != 0) {
        throw SandboxError("session lock " + (dir / "lock").string() + ": " + errno_text());
    }

    for (const char* sub : {"ipc", "input", "output", "bundle", "log"}) {
        if (::mkdir((dir / sub).c_str(), 0711) != 0) {
            throw SandboxError("mkdir " + (dir / sub).string() + ": " + errno_text());
        }
    }
    // The kernel creates its sockets in ipc/, so the sandbox can write there;
    // the directory is root's and sticky, and holds .server/ (root only) where
    // the server links the kernel's sockets before connecting: a socket the
    // sandbox later swaps for a symlink never redirects the server.
    mount_tmpfs(dir / "ipc", 4, 0, "1777");
    if (::mkdir((dir / "ipc" / ".server").c_str(), 0700) != 0) {
        throw SandboxError("mkdir " + (dir / "ipc" / ".server").string() + ": " + errno_text());
    }
    mount_tmpfs(dir / "output", limits.output_mb, sandbox_host_uid);
    // The init's stdout and stderr: its own 1 MB tmpfs, so nothing the sandbox
    // does can grow a file on the host's disk.
    mount_tmpfs(dir / "log", 1, 0);
    ::chmod((dir / "input").c_str(), 0755);

    // The inner connection: ipc sockets in the session's own directory and a
    // key of its own. The client's key never enters the sandbox.
    ConnectionInfo inner;
    inner.transport = "ipc";
    inner.ip = std::string(kSandboxIpcDir) + "/k";
    inner.shell_port = 1;
    inner.iopub_port = 2;
    inner.stdin_port = 3;
    inner.control_port = 4;
    inner.hb_port = 5;
    inner.key = make_random_key();
    inner.kernel_name = image.name;
    const fs::path conn_file = dir / "ipc" / "kernel.json";
    inner.write(conn_file);
    if (::chown(conn_file.c_str(), sandbox_host_uid, sandbox_host_uid) != 0) {
        throw SandboxError("chown " + conn_file.string() + ": " + errno_text());
    }
    box->inner_ = inner;
    box->inner_.ip = (dir / "ipc" / "k").string();

    SandboxSpec spec;
    spec.container_id = box->container_id_;
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
    spec.limits = limits;
    spec.ids = box->host_ids();
    spec.rootfs = image.rootfs == "host" ? dir / "bundle" / "rootfs" : fs::path(image.rootfs);
    spec.ipc_dir = dir / "ipc";
    spec.input_dir = dir / "input";
    spec.output_dir = dir / "output";
    spec.libexec_dir = settings.libexec_dir;
    spec.runtime = settings.runtime;
    json config = make_oci_config(spec);
    if (settings.start_cpu_shares > 0)
        config["linux"]["resources"]["cpu"]["shares"] = settings.start_cpu_shares;
    try {
        if (image.rootfs == "host") prepare_host_rootfs(spec, config);
    } catch (const std::exception& e) {
        throw SandboxError(std::string("session ") + session_id + ": " + e.what());
    }
    {
        std::ofstream out(dir / "bundle" / "config.json");
        out << config.dump(1);
        if (!out) throw SandboxError("write " + (dir / "bundle" / "config.json").string());
    }

    {
        std::ofstream out(runtime_file(dir));
        out << settings.runtime << "\n";
        if (!out) throw SandboxError("write " + runtime_file(dir).string());
    }

    const fs::path log = dir / "log" / "shim.log";
    const int log_fd = ::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd < 0) throw SandboxError("open " + log.string() + ": " + errno_text());
    const fs::path pid_file = dir / "init.pid";
    std::vector<std::string> run_args{"run", "--detach", "--pid-file", pid_file.string()};
    int pass_fd = -1;
    int listener = -1;
    const fs::path lifeline_socket = dir / "ipc" / fs::path(kSandboxLifelineSocket).filename();
    if (runtime_passes_fds(runtime_kind(settings.runtime))) {
        // One end of a socketpair becomes the init's fd 3.
        int pair[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
            ::close(log_fd);
            throw SandboxError("lifeline socketpair: " + errno_text());
        }
        box->lifeline_ = pair[0];
        pass_fd = pair[1];
        run_args.insert(run_args.end(), {"--preserve-fds", "1"});
    } else {
        // The shim connects to this socket as its first act, before the kernel
        // (the first untrusted code) exists; see accept_lifeline below.
        try {
            listener = listen_lifeline(lifeline_socket, sandbox_host_uid);
        } catch (...) {
            ::close(log_fd);
            throw;
        }
    }
    run_args.insert(run_args.end(), {"--bundle", (dir / "bundle").string(), box->container_id_});
    const bool runsc = runtime_kind(settings.runtime) == RuntimeKind::runsc;
    if (runsc) {
        std::lock_guard lock(runsc_children().mutex);
        ++runsc_children().starting;
    }
    const auto result = run_process(runtime_argv(settings, run_args), pass_fd, log_fd);
    box->init_pid_ = static_cast<pid_t>(read_u64(pid_file));
    if (runsc) {
        const pid_t gofer = find_child_gofer(dir / "bundle");
        std::lock_guard lock(runsc_children().mutex);
        --runsc_children().starting;
        if (box->init_pid_ > 0) runsc_children().owned.insert(box->init_pid_);
        if (gofer > 0) runsc_children().owned.insert(gofer);
        box->gofer_pid_ = gofer;
    }
    if (pass_fd >= 0) ::close(pass_fd);
    ::close(log_fd);
    if (result.exit_code != 0) {
        if (listener >= 0) ::close(listener);
        throw SandboxError(settings.runtime + " run " + box->container_id_ + ": " + log_tail(log));
    }
    if (box->init_pid_ <= 0) {
        if (listener >= 0) ::close(listener);
        throw SandboxError("pid file " + pid_file.string() + ": no pid");
    }
    if (listener >= 0) {
        // Only the first connection is taken; the socket is then closed and
        // unlinked, so nothing started later in the sandbox can reach it. The
        // shim connects before it starts the kernel, so the first is the shim's.
        box->lifeline_ = accept_lifeline(listener, box->init_pid_, std::chrono::seconds(30));
        ::close(listener);
        ::unlink(lifeline_socket.c_str());
        if (box->lifeline_ < 0) {
            throw SandboxError(settings.runtime + " run " + box->container_id_ +
                               ": the shim never connected to its lifeline; log: " + log_tail(log));
        }
    }
    box->cgroup_dirs_ = sandbox_cgroup_dirs(box->container_id_);
    box->open_counters();
    return box;
}

void Sandbox::open_counters() {
    auto open_first = [&](std::initializer_list<const char*> names, int flags) {
        for (const auto& dir : cgroup_dirs_) {
            for (const char* name : names) {
                const int fd = ::open((dir / name).c_str(), flags | O_CLOEXEC);
                if (fd >= 0) return fd;
            }
        }
        return -1;
    };
    // v1 names first, then v2's.
    counters_.memory_peak = open_first({"memory.max_usage_in_bytes", "memory.peak"}, O_RDONLY);
    counters_.memory_usage = open_first({"memory.usage_in_bytes", "memory.current"}, O_RDONLY);
    counters_.oom_control = open_first({"memory.oom_control", "memory.events"}, O_RDONLY);
    counters_.cpu_usage = open_first({"cpuacct.usage"}, O_RDONLY);
    counters_.pids_current = open_first({"pids.current"}, O_RDONLY);
    counters_.cpu_weight = open_first({"cpu.shares"}, O_WRONLY);
    if (counters_.cpu_weight < 0) {
        counters_.cpu_weight = open_first({"cpu.weight"}, O_WRONLY);
        counters_.cpu_weight_v2 = counters_.cpu_weight >= 0;
    }
    counters_.cpu_quota = open_first({"cpu.cfs_quota_us"}, O_WRONLY);
    if (counters_.cpu_quota < 0) {
        counters_.cpu_quota = open_first({"cpu.max"}, O_WRONLY);
        counters_.cpu_quota_v2 = counters_.cpu_quota >= 0;
    }
}

void Sandbox::close_counters() {
    for (int* fd : {&counters_.memory_peak, &counters_.memory_usage, &counters_.oom_control,
                    &counters_.cpu_usage, &counters_.cpu_weight, &counters_.cpu_quota,
                    &counters_.pids_current}) {
        if (*fd >= 0) ::close(*fd);
        *fd = -1;
    }
}

Sandbox::~Sandbox() { destroy(); }

bool Sandbox::read_lifeline() {
    if (exited_) return false;
    char buf[512];
    const ssize_t n = ::recv(lifeline_, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
        shim_status_.append(buf, static_cast<size_t>(std::min<ssize_t>(n, 512)));
        if (shim_status_.size() > 4096) shim_status_.resize(4096);
        return true;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    exited_ = true;
    return false;
}

bool Sandbox::memory_limit_hit() const {
    const auto u = usage();
    return u.oom_kills > 0 ||
           u.memory_peak_bytes >=
               (static_cast<std::uint64_t>(limits_.memory_mb) << 20) - (1u << 20);
}

std::string Sandbox::exit_description() const {
    std::string status = shim_status_;
    while (!status.empty() && status.back() == '\n') status.pop_back();
    const auto pos = status.rfind("kernel-exit ");
    std::string what = pos == std::string::npos ? "" : status.substr(pos + 12);
    std::string text;
    if (what.rfind("signal=", 0) == 0) {
        text = "the kernel was killed by signal " + what.substr(7);
    } else if (what.rfind("status=", 0) == 0) {
        text = "the kernel exited with status " + what.substr(7);
    } else {
        text = "the sandbox ended";
    }
    if (memory_limit_hit()) {
        text += " (memory limit of " + std::to_string(limits_.memory_mb) + " MB reached)";
    }
    return text;
}

void Sandbox::interrupt() {
    if (exited_ || init_pid_ <= 0) return;
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) {
        // The init pid is gVisor's Sentry, which a SIGINT would end: ask the
        // shim over the lifeline instead (it forwards SIGINT to the kernel).
        static const char line[] = "interrupt\n";
        [[maybe_unused]] auto n =
            ::send(lifeline_, line, sizeof line - 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        return;
    }
    ::kill(init_pid_, SIGINT);
}

void Sandbox::kill() {
    // Killing PID 1 of the sandbox's PID namespace kills every process in it;
    // under runsc the init pid is the Sentry, whose death ends the sandbox too.
    if (init_pid_ > 0 && !reaped_) ::kill(init_pid_, SIGKILL);
    if (gofer_pid_ > 0 && !reaped_) ::kill(gofer_pid_, SIGKILL);
}

void Sandbox::reap_init() {
    if (init_pid_ <= 0 || reaped_) return;
    // The init (and runsc's gofer) is our child (we are a subreaper); after
    // SIGKILL it ends at once.
    for (pid_t pid : {init_pid_, gofer_pid_}) {
        if (pid <= 0) continue;
        for (int i = 0; i < 200; ++i) {
            const pid_t r = ::waitpid(pid, nullptr, WNOHANG);
            if (r == pid || (r < 0 && errno == ECHILD)) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }
    reaped_ = true;
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) {
        std::lock_guard lock(runsc_children().mutex);
        runsc_children().owned.erase(init_pid_);
        runsc_children().owned.erase(gofer_pid_);
    }
}

namespace {

// The whole of a small cgroup file, read again from its start.
std::string_view pread_text(int fd, char (&buf)[512]) {
    if (fd < 0) return {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    return n > 0 ? std::string_view(buf, static_cast<std::size_t>(n)) : std::string_view();
}

std::uint64_t parse_u64(std::string_view text) {
    std::uint64_t v = 0;
    std::from_chars(text.data(), text.data() + text.size(), v);
    return v;
}

// The value after "key " in a "key value" per line file (0 when absent).
std::uint64_t keyed_u64(std::string_view text, std::string_view key) {
    for (std::size_t at = 0; at < text.size();) {
        const std::size_t end = std::min(text.find('\n', at), text.size());
        const std::string_view line = text.substr(at, end - at);
        if (line.size() > key.size() && line.substr(0, key.size()) == key &&
            line[key.size()] == ' ')
            return parse_u64(line.substr(key.size() + 1));
        at = end + 1;
    }
    return 0;
}

}  // namespace

SandboxUsage Sandbox::usage() const {
    SandboxUsage u;
    if (destroyed_) return u;
    char buf[512];
    u.memory_peak_bytes = parse_u64(pread_text(counters_.memory_peak, buf));
    u.memory_bytes = parse_u64(pread_text(counters_.memory_usage, buf));
    u.oom_kills = keyed_u64(pread_text(counters_.oom_control, buf), "oom_kill");
    u.cpu_ns = parse_u64(pread_text(counters_.cpu_usage, buf));
    return u;
}

void Sandbox::renice(int nice) {
    if (destroyed_) return;
    for (const auto& dir : cgroup_dirs_) {
        std::ifstream tasks(dir / (fs::exists(dir / "tasks") ? "tasks" : "cgroup.threads"));
        if (!tasks) continue;
        for (long tid = 0; tasks >> tid;) ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
        return;
    }
}

std::int64_t Sandbox::task_count() const {
    if (destroyed_ || counters_.pids_current < 0) return -1;
    char buf[512];
    const std::string_view text = pread_text(counters_.pids_current, buf);
    return text.empty() ? -1 : static_cast<std::int64_t>(parse_u64(text));
}

int Sandbox::any_task_runnable() const {
    if (destroyed_) return -1;
    for (const auto& dir : cgroup_dirs_) {
        std::ifstream tasks(dir / (fs::exists(dir / "tasks") ? "tasks" : "cgroup.threads"));
        if (!tasks) continue;
        for (long tid = 0; tasks >> tid;) {
            std::ifstream stat("/proc/" + std::to_string(tid) + "/stat");
            std::string line;
            if (!std::getline(stat, line)) continue;  // exited meanwhile
            // "pid (comm) S ...": the comm may hold spaces and parentheses.
            const auto close = line.rfind(')');
            if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'R')
                return 1;
        }
        return 0;
    }
    return -1;
}

bool Sandbox::set_cpu_quota(double cpus) {
    if (destroyed_ || counters_.cpu_quota < 0) return false;
    // The period apply_cgroup_limits sets; the kernel's floor is 1 ms.
    constexpr long period = 100000;
    const long quota = std::max(1000L, std::lround(cpus * period));
    // cpus <= 0: no quota at all.
    const std::string value = cpus > 0                 ? std::to_string(quota)
                              : counters_.cpu_quota_v2 ? "max"
                                                       : "-1";
    const std::string text = counters_.cpu_quota_v2 ? value + " " + std::to_string(period) : value;
    return ::pwrite(counters_.cpu_quota, text.data(), text.size(), 0) ==
           static_cast<ssize_t>(text.size());
}

bool Sandbox::set_cpu_weight(int shares) {
    if (destroyed_ || counters_.cpu_weight < 0) return false;
    // v2's cpu.weight is 1..10000 with 100 the default; v1's shares 2..262144, 1024.
    const long value = counters_.cpu_weight_v2 ? std::clamp(shares * 100L / 1024, 1L, 10000L)
                                               : std::clamp<long>(shares, 2, 262144);
    const std::string text = std::to_string(value);
    return ::pwrite(counters_.cpu_weight, text.data(), text.size(), 0) ==
           static_cast<ssize_t>(text.size());
}

void Sandbox::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    close_counters();
    kill();
    reap_init();
    if (lifeline_ >= 0) ::close(lifeline_);
    lifeline_ = -1;
    remove_session(settings_, session_id_, dir_);
    // By now (runsc delete has run) the Sentry's stubs are dead: reap them.
    if (runtime_kind(settings_.runtime) == RuntimeKind::runsc) reap_runsc_orphans();
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    if (version_fd_ >= 0) ::close(version_fd_);
    version_fd_ = -1;
    host_ids_.release();
}

std::vector<fs::path> remove_orphan_cgroups(std::chrono::seconds min_age) {
    std::vector<fs::path> removed;
    std::vector<fs::path> parents = {"/sys/fs/cgroup/cellblock"};
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/sys/fs/cgroup", ec))
        parents.push_back(entry.path() / "cellblock");
    const auto now = fs::file_time_type::clock::now();
    for (const auto& parent : parents) {
        std::error_code it_ec;
        for (const auto& entry : fs::directory_iterator(parent, it_ec)) {
            const std::string name = entry.path().filename().string();
            if (name.rfind("cb-", 0) != 0) continue;
            std::error_code age_ec;
            const auto mtime = fs::last_write_time(entry.path(), age_ec);
            if (age_ec || now - mtime < min_age) continue;
            if (::rmdir(entry.path().c_str()) == 0) removed.push_back(entry.path());
        }
    }
    return removed;
}

std::vector<std::string> reap_abandoned_sessions(const RuntimeSettings& settings) {
    std::vector<std::string> reaped;
    std::error_code ec;
    if (!fs::exists(settings.sessions_dir(), ec)) return reaped;
    for (const auto& entry : fs::directory_iterator(settings.sessions_dir(), ec)) {
        const std::string session_id = entry.path().filename().string();
        const int fd = ::open((entry.path() / "lock").c_str(), O_RDWR | O_CLOEXEC);
        if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            ::close(fd);  // its owner is alive
            continue;
        }
        if (fd < 0) {
            // No lock yet: another process may be creating it right now.
            std::error_code age_ec;
            const auto mtime = fs::last_write_time(entry.path(), age_ec);
            if (!age_ec && fs::file_time_type::clock::now() - mtime < std::chrono::seconds(60))
                continue;
        }
        // Either its owner died (the lock was released with it) or it never got a lock.
        const pid_t pid = static_cast<pid_t>(read_u64(entry.path() / "init.pid"));
        if (pid > 0) {
            const std::string cgroup_line = read_text("/proc/" + std::to_string(pid) + "/cgroup");
            if (cgroup_line.find(container_id_for(session_id)) != std::string::npos) {
                ::kill(pid, SIGKILL);
            }
        }
        remove_session(settings, session_id, entry.path());
        if (fd >= 0) ::close(fd);
        reaped.push_back(session_id);
    }
    return reaped;
}

}  // namespace cellblock
