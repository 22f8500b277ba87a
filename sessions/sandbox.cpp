#include "cellblock/sandbox.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

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

void mount_tmpfs(const fs::path& target, int size_mb, std::uint32_t owner) {
    const std::string options = "size=" + std::to_string(size_mb) +
                                "m,mode=0700,uid=" + std::to_string(owner) +
                                ",gid=" + std::to_string(owner);
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
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
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
void remove_session(const RuntimeSettings& settings, const std::string& session_id,
                    const fs::path& dir) {
    const std::string cid = container_id_for(session_id);
    const auto result = run_process(runtime_argv(settings, {"delete", "--force", cid}));
    if (result.exit_code != 0 && result.output.find("does not exist") == std::string::npos &&
        result.output.find("not exist") == std::string::npos) {
        spdlog::warn("session {}: {} delete: {}", session_id, settings.runtime, result.output);
    }
    unmount_if_mounted(dir / "ipc");
    unmount_if_mounted(dir / "output");
    remove_cgroups(cid);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) spdlog::warn("session {}: remove {}: {}", session_id, dir.string(), ec.message());
}

}  // namespace

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
    box->dir_ = settings.sessions_dir() / session_id;
    const fs::path& dir = box->dir_;
    const std::uint32_t sandbox_host_uid = settings.ids.host_uid(kSandboxUid);

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

    for (const char* sub : {"ipc", "input", "output", "bundle"}) {
        if (::mkdir((dir / sub).c_str(), 0711) != 0) {
            throw SandboxError("mkdir " + (dir / sub).string() + ": " + errno_text());
        }
    }
    mount_tmpfs(dir / "ipc", 4, sandbox_host_uid);
    mount_tmpfs(dir / "output", limits.output_mb, sandbox_host_uid);
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
    spec.ids = settings.ids;
    spec.rootfs = image.rootfs == "host" ? dir / "bundle" / "rootfs" : fs::path(image.rootfs);
    spec.ipc_dir = dir / "ipc";
    spec.input_dir = dir / "input";
    spec.output_dir = dir / "output";
    spec.libexec_dir = settings.libexec_dir;
    const json config = make_oci_config(spec);
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

    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        throw SandboxError("lifeline socketpair: " + errno_text());
    }
    box->lifeline_ = pair[0];
    const fs::path log = dir / "shim.log";
    const int log_fd = ::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd < 0) {
        ::close(pair[1]);
        throw SandboxError("open " + log.string() + ": " + errno_text());
    }
    const fs::path pid_file = dir / "init.pid";
    const auto result =
        run_process(runtime_argv(settings, {"run", "--detach", "--pid-file", pid_file.string(),
                                            "--preserve-fds", "1", "--bundle",
                                            (dir / "bundle").string(), box->container_id_}),
                    pair[1], log_fd);
    ::close(pair[1]);
    ::close(log_fd);
    if (result.exit_code != 0) {
        throw SandboxError(settings.runtime + " run " + box->container_id_ + ": " + log_tail(log));
    }
    box->init_pid_ = static_cast<pid_t>(read_u64(pid_file));
    if (box->init_pid_ <= 0) throw SandboxError("pid file " + pid_file.string() + ": no pid");
    box->cgroup_dirs_ = sandbox_cgroup_dirs(box->container_id_);
    return box;
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
    if (!exited_ && init_pid_ > 0) ::kill(init_pid_, SIGINT);
}

void Sandbox::kill() {
    // Killing PID 1 of the sandbox's PID namespace kills every process in it.
    if (init_pid_ > 0 && !reaped_) ::kill(init_pid_, SIGKILL);
}

void Sandbox::reap_init() {
    if (init_pid_ <= 0 || reaped_) return;
    // The init is our child (we are a subreaper); after SIGKILL it ends at once.
    for (int i = 0; i < 200; ++i) {
        const pid_t r = ::waitpid(init_pid_, nullptr, WNOHANG);
        if (r == init_pid_ || (r < 0 && errno == ECHILD)) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    reaped_ = true;
}

SandboxUsage Sandbox::usage() const {
    SandboxUsage u;
    if (destroyed_) return u;
    for (const auto& dir : cgroup_dirs_) {
        if (fs::exists(dir / "memory.max_usage_in_bytes")) {
            u.memory_peak_bytes = read_u64(dir / "memory.max_usage_in_bytes");
            u.memory_bytes = read_u64(dir / "memory.usage_in_bytes");
            std::istringstream oom(read_text(dir / "memory.oom_control"));
            std::string key;
            std::uint64_t value;
            while (oom >> key >> value) {
                if (key == "oom_kill") u.oom_kills = value;
            }
        }
        if (fs::exists(dir / "cpuacct.usage")) u.cpu_ns = read_u64(dir / "cpuacct.usage");
        if (fs::exists(dir / "memory.peak")) u.memory_peak_bytes = read_u64(dir / "memory.peak");
        if (fs::exists(dir / "memory.current")) u.memory_bytes = read_u64(dir / "memory.current");
    }
    return u;
}

void Sandbox::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    kill();
    reap_init();
    if (lifeline_ >= 0) ::close(lifeline_);
    lifeline_ = -1;
    remove_session(settings_, session_id_, dir_);
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
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
