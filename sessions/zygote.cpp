// A per-image zygote and the sessions forked from it (zygote.hpp,
// docs/zygote.md). The containment steps a fork takes are in
// kernel-shim/cellblock_zygote.py; this side gives it what only the host can:
// the session's id maps, its cgroups, its directories as detached mounts, and
// checks each step against the pid the kernel attached to the report.
#include "cellblock/zygote.hpp"

#include <fcntl.h>
#include <poll.h>
#include <seccomp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/fd_passing.hpp"
#include "cellblock/sandbox_pool.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/sandbox_tuning.hpp"
#include "cellblock/session_dir.hpp"
#include "sandbox_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;
namespace protocol = sandbox_protocol;

namespace {

constexpr std::chrono::seconds kStepTimeout{10};
// How often a starting zygote's socket is looked for.
constexpr std::chrono::milliseconds kStartPoll{20};
// The largest reply of the zygote that is read whole.
constexpr size_t kMaxReplyBytes = 65536;
// The zygote's RLIMIT_NOFILE bounds what a fork may set for its session (it
// cannot raise it): as high as this process may give (runc sets it after it
// has become the zygote's user), within the kernel's fs.nr_open default.
constexpr int kNofileUnknown = 65536;
constexpr rlim_t kMaxNofile = 1 << 20;
int zygote_nofile() {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_max == RLIM_INFINITY) {
        return kNofileUnknown;
    }
    return static_cast<int>(std::min(limit.rlim_max, kMaxNofile));
}

std::uint32_t scmp_action(const json& rule) {
    const std::string action = rule.at("action");
    if (action == "SCMP_ACT_ALLOW") return SCMP_ACT_ALLOW;
    if (action == "SCMP_ACT_ERRNO")
        return SCMP_ACT_ERRNO(static_cast<std::uint16_t>(rule.value("errnoRet", EPERM)));
    throw SandboxError("seccomp: action " + action + " is not supported here");
}

scmp_compare scmp_op(const std::string& op) {
    if (op == "SCMP_CMP_NE") return SCMP_CMP_NE;
    if (op == "SCMP_CMP_EQ") return SCMP_CMP_EQ;
    if (op == "SCMP_CMP_MASKED_EQ") return SCMP_CMP_MASKED_EQ;
    throw SandboxError("seccomp: comparison " + op + " is not supported here");
}

// Waits until `fd` is readable or `timeout` passes.
bool wait_readable(int fd, std::chrono::milliseconds timeout) {
    pollfd p{fd, POLLIN, 0};
    for (;;) {
        const int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
        if (r < 0 && errno == EINTR) continue;
        return r > 0;
    }
}

// One message on a SOCK_SEQPACKET report socket, with the sender's pid as
// the kernel saw it (SO_PASSCRED): a fork cannot claim another process's.
struct Report {
    std::string text;
    pid_t pid = -1;
};

Report receive_report(int fd, const std::string& step) {
    if (!wait_readable(fd, kStepTimeout)) {
        throw SandboxError("zygote fork: no answer within " + std::to_string(kStepTimeout.count()) +
                           " s while waiting for " + step);
    }
    char buf[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
    iovec iov{buf, sizeof buf};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) {
        throw SandboxError("zygote fork: the session's process ended while waiting for " + step);
    }
    Report report;
    report.text.assign(buf, static_cast<size_t>(n));
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
            ucred cred;
            std::memcpy(&cred, CMSG_DATA(c), sizeof cred);
            report.pid = cred.pid;
        }
    }
    const std::string error = std::string(protocol::kReportError) + " ";
    if (report.text.starts_with(error)) {
        throw SandboxError("zygote fork: " + report.text.substr(error.size()));
    }
    return report;
}

// Moving a process into a cgroup takes the kernel's global threadgroup lock
// for writing, and the first taking after a pause waits for an RCU grace
// period (6-15 ms here) with the cgroup mutex held; for one more grace
// period after it is released, the next taking is immediate (the lock's
// rcu_sync stays on its slow path). A fork needs one such move (its init
// into the v2 cgroup, below), about 10 ms after the request. This takes the
// lock once, early, on a thread of its own, so that the wait overlaps the
// zygote's fork and the init's move finds the lock on its fast path: the
// server re-joins its own v2 cgroup, a move that moves nothing. Measured in
// docs/zygote.md ("Why A moves itself"). Failures change nothing and are
// only logged: the init's move then pays the wait itself.
std::jthread take_threadgroup_lock_early(const fs::path& v2_root) {
    std::string own;
    {
        std::istringstream lines(read_text("/proc/self/cgroup"));
        for (std::string line; std::getline(lines, line);) {
            if (line.rfind("0::", 0) == 0) own = line.substr(3);
        }
    }
    if (own.empty() || own.find("..") != std::string::npos) return {};
    return std::jthread([procs = v2_root / fs::path(own).relative_path() / "cgroup.procs"] {
        const UniqueFd fd(::open(procs.c_str(), O_WRONLY | O_CLOEXEC));
        // "0": the writer's own process, which is in that cgroup already.
        if (!fd || ::write(fd.get(), "0", 1) != 1) {
            spdlog::debug("re-joining {} (to take the threadgroup lock early): {}", procs.string(),
                          errno_text());
        }
    });
}

// The session's own cgroup in every hierarchy, as runc makes for a booted
// sandbox (v2: the one unified directory; v1: each mounted hierarchy, the
// named and hybrid ones too), so that nothing of it stays in the zygote's.
// A v1 cpuset gets the zygote's cpus and mems, a v1 devices cgroup the
// zygote's device list (runc's: the default devices only).
std::vector<fs::path> create_session_cgroups(const std::string& container_id,
                                             const std::string& zygote_id) {
    std::vector<fs::path> dirs;
    const bool v2 = cgroup_v2();
    for (const auto& parent : sandboxes_cgroup_parents()) {
        if (v2) {
            ::mkdir(parent.c_str(), 0755);
            std::ofstream(parent / "cgroup.subtree_control") << "+memory +pids +cpu";
        } else if (!fs::exists(parent / zygote_id)) {
            continue;
        }
        dirs.push_back(parent / container_id);
    }
    for (const auto& dir : dirs) {
        if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
            throw SandboxError("cgroup " + dir.string() + ": " + errno_text());
        }
        const fs::path zygote = dir.parent_path() / zygote_id;
        if (fs::exists(dir / "cpuset.cpus")) {
            for (const char* file : {"cpuset.cpus", "cpuset.mems"}) {
                std::string value = read_text(zygote / file);
                while (!value.empty() && value.back() == '\n') value.pop_back();
                if (!value.empty()) write_value(dir / file, value);
            }
        }
        if (fs::exists(dir / "devices.deny")) {
            write_value(dir / "devices.deny", "a");
            std::istringstream allowed(read_text(zygote / "devices.list"));
            for (std::string line; std::getline(allowed, line);) {
                if (!line.empty()) write_value(dir / "devices.allow", line);
            }
        }
    }
    return dirs;
}

// A detached copy of a session directory's mount (open_tree), with the
// attributes the session gets: the forked child moves it into its own mount
// namespace; it never sees the host path.
UniqueFd detached_tree(const fs::path& dir, std::uint64_t attributes) {
    UniqueFd tree(::open_tree(AT_FDCWD, dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
    if (!tree) throw SandboxError("open_tree " + dir.string() + ": " + errno_text());
    mount_attr attr{};
    attr.attr_set = attributes;
    if (::mount_setattr(tree.get(), "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) {
        throw SandboxError("mount_setattr " + dir.string() + ": " + errno_text());
    }
    return tree;
}

void send_request(int socket, const std::string& data, const std::vector<int>& fds) {
    if (data.size() > static_cast<size_t>(protocol::kMaxRequestBytes)) {
        throw SandboxError("zygote: a request of " + std::to_string(data.size()) +
                           " bytes, more than the zygote reads (" +
                           std::to_string(protocol::kMaxRequestBytes) + ")");
    }
    if (send_with_fds(socket, data, fds) != static_cast<ssize_t>(data.size())) {
        throw SandboxError("zygote: send: " + errno_text());
    }
}

json receive_reply(int socket, std::chrono::milliseconds timeout) {
    if (!wait_readable(socket, timeout)) throw SandboxError("zygote: no reply");
    std::string buf(kMaxReplyBytes, '\0');
    const ssize_t n = ::recv(socket, buf.data(), buf.size(), 0);
    if (n <= 0) throw SandboxError("zygote: the zygote closed its socket");
    buf.resize(static_cast<size_t>(n));
    json reply = json::parse(buf, nullptr, false);
    if (!reply.is_object()) throw SandboxError("zygote: a reply that is not a JSON object");
    if (reply.contains(protocol::kReplyError)) {
        throw SandboxError("zygote: " + reply[protocol::kReplyError].get<std::string>());
    }
    return reply;
}

}  // namespace

std::string compile_seccomp_bpf(const json& profile) {
    const std::uint32_t default_action =
        scmp_action({{"action", profile.at("defaultAction")},
                     {"errnoRet", profile.value("defaultErrnoRet", EPERM)}});
    scmp_filter_ctx ctx = seccomp_init(default_action);
    if (!ctx) throw SandboxError("seccomp_init failed");
    std::unique_ptr<void, void (*)(void*)> owner(ctx, [](void* c) { seccomp_release(c); });
    // runc's defaults: no_new_privs is the caller's business, and a rule
    // that cannot be added for one architecture (a call i386 lacks) is skipped.
    seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0);
    for (const auto& arch : profile.value("architectures", json::array())) {
        const std::string name = arch;
        const std::uint32_t token = name == "SCMP_ARCH_X86"   ? SCMP_ARCH_X86
                                    : name == "SCMP_ARCH_X32" ? SCMP_ARCH_X32
                                                              : SCMP_ARCH_NATIVE;
        const int r = seccomp_arch_add(ctx, token);
        if (r != 0 && r != -EEXIST) throw SandboxError("seccomp_arch_add " + name + " failed");
    }
    for (const auto& rule : profile.at("syscalls")) {
        const std::uint32_t action = scmp_action(rule);
        if (action == default_action) continue;  // libseccomp refuses it; runc skips it too
        std::vector<scmp_arg_cmp> args;
        for (const auto& arg : rule.value("args", json::array())) {
            args.push_back({arg.at("index").get<unsigned>(), scmp_op(arg.at("op")),
                            arg.at("value").get<std::uint64_t>(),
                            arg.value("valueTwo", std::uint64_t{0})});
        }
        for (const auto& name : rule.at("names")) {
            const int nr = seccomp_syscall_resolve_name(name.get<std::string>().c_str());
            if (nr == __NR_SCMP_ERROR) continue;  // unknown to libseccomp: the default applies
            const int r = seccomp_rule_add_array(ctx, action, nr,
                                                 static_cast<unsigned>(args.size()), args.data());
            if (r != 0 && r != -EEXIST) {
                throw SandboxError("seccomp rule for " + name.get<std::string>() + ": " +
                                   std::strerror(-r));
            }
        }
    }
    const int out = ::memfd_create("cellblock-seccomp", MFD_CLOEXEC);
    if (out < 0) throw SandboxError("memfd_create: " + errno_text());
    UniqueFd memfd(out);
    if (seccomp_export_bpf(ctx, memfd.get()) != 0) throw SandboxError("seccomp_export_bpf failed");
    const off_t size = ::lseek(memfd.get(), 0, SEEK_END);
    std::string bpf(static_cast<size_t>(size), '\0');
    if (::pread(memfd.get(), bpf.data(), bpf.size(), 0) != size) {
        throw SandboxError("seccomp: reading the program back failed");
    }
    return bpf;
}

std::shared_ptr<Zygote> Zygote::start(const Image& image, const RuntimeSettings& settings,
                                      std::chrono::milliseconds timeout) {
    // The fork's directories are detached mounts with their attributes set
    // (detached_tree): a kernel older than 5.12 cannot, and boots instead.
    if (::mount_setattr(-1, "", AT_EMPTY_PATH, nullptr, 0) != 0 && errno == ENOSYS) {
        throw ForkingRefused("this kernel has no mount_setattr (Linux 5.12)");
    }
    std::shared_ptr<Zygote> zygote(new Zygote());
    zygote->image_ = image;
    SandboxLimits limits = image.limits;
    limits.nofile = std::max(limits.nofile, zygote_nofile());
    zygote->box_ =
        RuncSandbox::start(make_session_id(), image, limits, settings, SandboxRole::zygote);
    RuncSandbox& box = *zygote->box_;
    const fs::path socket_path = SessionDir(box.dir()).zygote_socket();
    const fs::path log = SessionDir(box.dir()).shim_log();
    // The socket appears once the zygote has imported everything.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        struct stat st {};
        if (::lstat(socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) break;
        if (!box.read_lifeline() || std::chrono::steady_clock::now() > deadline) {
            throw SandboxError("zygote of image " + image.name +
                               (box.exited()
                                    ? " ended while starting (" + box.exit_description() + ")"
                                    : " did not start in time") +
                               ": " + log_tail(log));
        }
        std::this_thread::sleep_for(kStartPoll);
    }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (socket_path.string().size() >= sizeof addr.sun_path) {
        throw SandboxError("zygote socket path too long: " + socket_path.string());
    }
    std::strcpy(addr.sun_path, socket_path.c_str());
    zygote->control_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!zygote->control_ ||
        ::connect(zygote->control_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        throw SandboxError("connect " + socket_path.string() + ": " + errno_text());
    }
    // The filter every session installs on itself before its first own code.
    const std::string bpf = compile_seccomp_bpf(make_seccomp_profile(RuntimeKind::runc));
    send_request(zygote->control_.get(), std::string(protocol::kSeccompRequest) + " " + bpf, {});
    const json reply = receive_reply(zygote->control_.get(), kStepTimeout);
    zygote->interpreter_pid_ = reply.value(protocol::kReplyPid, -1);
    if (reply.contains(protocol::kReplyRefused)) {
        const json& refused = reply[protocol::kReplyRefused];
        const std::string why = refused.is_string() ? refused.get<std::string>() : refused.dump();
        throw ForkingRefused("this host does not let a zygote's fork contain itself: " + why);
    }
    // A pool worker that started it may run at a low priority; its forks take
    // the priority of the thread that asks for each (see fork), which they
    // can lower but not raise: the zygote itself runs at 0.
    box.renice(0);
    spdlog::info("zygote of image {} ready: container {}, interpreter pid {}", image.name,
                 box.container_id(), zygote->interpreter_pid_);
    return zygote;
}

Zygote::~Zygote() {
    if (box_) box_->destroy();
    reap_child(interpreter_pid_);  // orphaned to us once its shim died
}

void Zygote::retire() {
    std::lock_guard lock(mutex_);
    control_.reset();
    // The interpreter has no PID namespace to end with its init: it ends by
    // its parent-death signal when the shim does.
    box_->kill();
    box_->reap_init();
    reap_child(interpreter_pid_);  // orphaned to us once its shim died
}

bool Zygote::alive() {
    std::lock_guard lock(mutex_);
    return box_ && box_->read_lifeline() && control_;
}

std::unique_ptr<RuncSandbox> Zygote::fork(const std::string& session_id,
                                          const SandboxLimits& limits,
                                          const RuntimeSettings& settings) {
    std::lock_guard lock(mutex_);
    if (!control_) throw SandboxError("zygote of image " + image_.name + " is gone");
    const auto t0 = std::chrono::steady_clock::now();
    auto ms_since = [&t0] {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
            .count();
    };
    std::unique_ptr<RuncSandbox> box = RuncSandbox::prepare(session_id, image_, limits, settings);
    box->forked_ = true;
    box->keep_ = shared_from_this();
    const fs::path dir = box->dir();
    write_runtime_file(dir, kForkedRuntime);
    box->cgroup_dirs_ = create_session_cgroups(box->container_id(), box_->container_id());
    apply_cgroup_limits(*box, limits);
    // A v1 hierarchy's cgroup the fork joins itself, by writing 0 to the
    // `tasks` file the server opened for it: a task moving itself skips the
    // kernel's global threadgroup lock, whose first taking after a pause waits
    // for an RCU grace period (6-15 ms here, once per fork). A write is judged
    // by the credentials it was opened with (root's). The v2 cgroup (the
    // unified hierarchy, or the only one) the server joins for the session's
    // init, while that init mounts (see below).
    std::vector<UniqueFd> v1_tasks;
    std::vector<fs::path> v2_dirs;
    for (const auto& dir : box->cgroup_dirs_) {
        if (fs::exists(dir / "cgroup.controllers")) {
            v2_dirs.push_back(dir);
            continue;
        }
        UniqueFd tasks(::open((dir / "tasks").c_str(), O_WRONLY | O_CLOEXEC));
        if (!tasks) throw SandboxError("open " + (dir / "tasks").string() + ": " + errno_text());
        v1_tasks.push_back(std::move(tasks));
    }
    // While the request is sent and the zygote forks (see the function).
    std::jthread early_lock;
    if (!v2_dirs.empty()) {
        early_lock = take_threadgroup_lock_early(v2_dirs.front().parent_path().parent_path());
    }
    box->open_counters();
    // A pool refill starts at a low CPU weight, as a booted one (RuntimeSettings).
    if (settings.start_cpu_shares > 0) box->set_cpu_weight(settings.start_cpu_shares);

    int report_pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, report_pair) != 0) {
        throw SandboxError("report socketpair: " + errno_text());
    }
    UniqueFd report(report_pair[0]), report_child(report_pair[1]);
    const int on = 1;
    ::setsockopt(report.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
    int lifeline_pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, lifeline_pair) != 0) {
        throw SandboxError("lifeline socketpair: " + errno_text());
    }
    box->lifeline_.reset(lifeline_pair[0]);
    UniqueFd lifeline_child(lifeline_pair[1]);
    const SessionDir paths(dir);
    const fs::path log = paths.shim_log();
    UniqueFd log_fd(::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600));
    if (!log_fd) throw SandboxError("open " + log.string() + ": " + errno_text());
    const std::uint64_t quiet = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    UniqueFd ipc = detached_tree(paths.ipc(), quiet);
    UniqueFd input = detached_tree(paths.input(), quiet | MOUNT_ATTR_RDONLY);
    UniqueFd output = detached_tree(paths.output(), quiet);

    errno = 0;
    int nice = ::getpriority(PRIO_PROCESS, 0);  // this thread's (Linux)
    if (errno != 0) nice = 0;
    const json request = {{"session", session_id},
                          {"env", sandbox_environment(image_)},
                          {"hostname", "sandbox"},
                          {"limits",
                           {{"disk_mb", limits.disk_mb},
                            {"shm_mb", limits.shm_mb},
                            {"nofile", std::min(limits.nofile, zygote_nofile())},
                            {"nproc", limits.pids * tuning::kRuncNprocFactor},
                            {"nice", nice}}},
                          {"cgroups", v1_tasks.size()}};
    if (v1_tasks.size() > static_cast<size_t>(protocol::kMaxCgroupFds)) {
        throw SandboxError("zygote fork: " + std::to_string(v1_tasks.size()) +
                           " v1 cgroup hierarchies, more than a fork request carries (" +
                           std::to_string(protocol::kMaxCgroupFds) + ")");
    }
    // In the order the zygote names them (sandbox_protocol.hpp).
    std::vector<int> passed(protocol::kForkFdCount, -1);
    passed[protocol::position(protocol::ForkFd::report)] = report_child.get();
    passed[protocol::position(protocol::ForkFd::lifeline)] = lifeline_child.get();
    passed[protocol::position(protocol::ForkFd::log)] = log_fd.get();
    passed[protocol::position(protocol::ForkFd::ipc)] = ipc.get();
    passed[protocol::position(protocol::ForkFd::input)] = input.get();
    passed[protocol::position(protocol::ForkFd::output)] = output.get();
    for (const auto& fd : v1_tasks) passed.push_back(fd.get());
    try {
        send_request(control_.get(), request.dump(), passed);
        const json reply = receive_reply(control_.get(), kStepTimeout);
        (void)reply;
    } catch (const SandboxError&) {
        control_.reset();  // a zygote that fails its protocol is not used again
        throw;
    }
    // The child holds its own copies now.
    report_child.reset();
    lifeline_child.reset();
    log_fd.reset();
    ipc.reset();
    input.reset();
    output.reset();
    v1_tasks.clear();

    const double requested_ms = ms_since();
    double userns_ms = 0, mapped_ms = 0, init_ms = 0, cgrouped_ms = 0;
    pid_t forked = -1;
    // The fork's next step waits for one word from the server.
    const auto tell = [&report](std::string_view word) {
        if (::send(report.get(), word.data(), word.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(word.size())) {
            throw SandboxError("zygote fork: report: " + errno_text());
        }
    };
    try {
        const Report userns = receive_report(report.get(), "the user namespace");
        forked = userns.pid;
        userns_ms = ms_since();
        if (userns.text != protocol::kReportUserns || forked <= 0) {
            throw SandboxError("zygote fork: unexpected report '" + userns.text + "'");
        }
        const IdMapping& ids = box->host_ids();
        const std::string map =
            "0 " + std::to_string(ids.host_base) + " " + std::to_string(ids.size);
        const fs::path proc = "/proc/" + std::to_string(forked);
        write_value(proc / "uid_map", map);
        write_value(proc / "gid_map", map);
        tell(protocol::kAnswerMapped);
        mapped_ms = ms_since();
        const Report init = receive_report(report.get(), "the session's init");
        pid_t init_pid = -1;
        const std::string init_word = std::string(protocol::kReportInit) + " ";
        const char* digits = init.text.data() + std::min(init_word.size(), init.text.size());
        const auto parsed = std::from_chars(digits, init.text.data() + init.text.size(), init_pid);
        if (init.pid != forked || !init.text.starts_with(init_word) || parsed.ec != std::errc() ||
            parsed.ptr != init.text.data() + init.text.size() || init_pid <= 0) {
            throw SandboxError("zygote fork: unexpected report '" + init.text + "'");
        }
        box->init_pid_ = init_pid;
        init_ms = ms_since();
        // The init is setting up its mounts meanwhile; it unshares its cgroup
        // namespace (rooted here) only once told.
        for (const auto& cgroup : v2_dirs) {
            write_value(cgroup / "cgroup.procs", std::to_string(init_pid));
        }
        tell(protocol::kAnswerCgrouped);
        cgrouped_ms = ms_since();
        const Report ready = receive_report(report.get(), "the contained session");
        if (ready.text != protocol::kReportReady || ready.pid != box->init_pid_) {
            throw SandboxError("zygote fork: unexpected report '" + ready.text + "' from pid " +
                               std::to_string(ready.pid));
        }
    } catch (const SandboxError& e) {
        if (forked > 0) ::kill(forked, SIGKILL);
        throw SandboxError(std::string(e.what()) + "; log: " + log_tail(log));
    }
    {
        std::ofstream out(dir / "init.pid");
        out << box->init_pid_;
    }
    spdlog::debug(
        "session {} forked in {:.1f} ms: prepared and requested {:.1f}, user namespace {:.1f}, "
        "mapped {:.1f}, namespaces {:.1f}, v2 cgroup {:.1f}, contained {:.1f}",
        session_id, ms_since(), requested_ms, userns_ms, mapped_ms, init_ms, cgrouped_ms,
        ms_since());
    return box;
}

}  // namespace cellblock
