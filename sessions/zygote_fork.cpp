// The host's half of a zygote's fork (zygote.hpp, docs/zygote.md), as the
// named steps of Zygote::ForkInProgress. The containment steps the fork takes
// are in kernel-shim/cellblock_zygote.py; this side gives it what only the
// host can: the session's id maps, its cgroups, its directories as detached
// mounts, and checks each step against the pid the kernel attached to the
// report.
#include "cellblock/zygote.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/fd_passing.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/sandbox_tuning.hpp"
#include "cellblock/session_dir.hpp"
#include "sandbox_internal.hpp"
#include "zygote_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;
using namespace zygote_detail;
namespace protocol = sandbox_protocol;

namespace {

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

}  // namespace

// One fork, as the steps the server takes for it. Each step owns what it
// opened until a later one hands it on: the child's ends of the channels go
// to the zygote with the request, the session's ends to the sandbox.
class Zygote::ForkInProgress {
  public:
    ForkInProgress(Zygote& zygote, const std::string& session_id, const SandboxLimits& limits,
                   const RuntimeSettings& settings)
        : zygote_(zygote), session_id_(session_id), limits_(limits), settings_(settings) {}

    // The session's directory, as a booted sandbox's, marked as forked.
    void prepare() {
        box_ = RuncSandbox::prepare(session_id_, zygote_.image_, limits_, settings_);
        box_->forked_ = true;
        box_->keep_ = zygote_.shared_from_this();
        box_->zygote_box_ = zygote_.box_.get();
        write_runtime_file(box_->dir(), kForkedRuntime);
    }

    // The session's cgroups, limited. A v1 hierarchy's cgroup the fork joins
    // itself, by writing 0 to the `tasks` file the server opened for it: a
    // task moving itself skips the kernel's global threadgroup lock, whose
    // first taking after a pause waits for an RCU grace period (6-15 ms here,
    // once per fork). A write is judged by the credentials it was opened with
    // (root's). The v2 cgroup (the unified hierarchy, or the only one) the
    // server joins for the session's init, while that init mounts
    // (join_v2_cgroup).
    void make_cgroups() {
        box_->cgroup_dirs_ =
            create_session_cgroups(box_->container_id(), zygote_.box_->container_id());
        apply_cgroup_limits(*box_, limits_);
        for (const auto& dir : box_->cgroup_dirs_) {
            if (fs::exists(dir / "cgroup.controllers")) {
                v2_dirs_.push_back(dir);
                continue;
            }
            UniqueFd tasks(::open((dir / "tasks").c_str(), O_WRONLY | O_CLOEXEC));
            if (!tasks) {
                throw SandboxError("open " + (dir / "tasks").string() + ": " + errno_text());
            }
            v1_tasks_.push_back(std::move(tasks));
        }
        if (v1_tasks_.size() > static_cast<size_t>(protocol::kMaxCgroupFds)) {
            throw SandboxError("zygote fork: " + std::to_string(v1_tasks_.size()) +
                               " v1 cgroup hierarchies, more than a fork request carries (" +
                               std::to_string(protocol::kMaxCgroupFds) + ")");
        }
        // While the request is sent and the zygote forks (see the function).
        if (!v2_dirs_.empty()) {
            early_lock_ = take_threadgroup_lock_early(v2_dirs_.front().parent_path().parent_path());
        }
        box_->open_counters();
        // A pool refill starts at a low CPU weight, as a booted one (RuntimeSettings).
        if (settings_.start_cpu_shares > 0) box_->set_cpu_weight(settings_.start_cpu_shares);
    }

    // The report channel (the fork's steps, each with its sender's pid), the
    // lifeline, the shim's log, and the session's directories as detached mounts.
    void open_channels() {
        int report_pair[2];
        if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, report_pair) != 0) {
            throw SandboxError("report socketpair: " + errno_text());
        }
        report_.reset(report_pair[0]);
        child_.report.reset(report_pair[1]);
        const int on = 1;
        ::setsockopt(report_.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
        int lifeline_pair[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, lifeline_pair) != 0) {
            throw SandboxError("lifeline socketpair: " + errno_text());
        }
        box_->lifeline_.reset(lifeline_pair[0]);
        child_.lifeline.reset(lifeline_pair[1]);
        const SessionDir paths(box_->dir());
        log_ = paths.shim_log();
        child_.log.reset(::open(log_.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600));
        if (!child_.log) throw SandboxError("open " + log_.string() + ": " + errno_text());
        const std::uint64_t quiet = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
        child_.ipc = detached_tree(paths.ipc(), quiet);
        child_.input = detached_tree(paths.input(), quiet | MOUNT_ATTR_RDONLY);
        child_.output = detached_tree(paths.output(), quiet);
    }

    // Asks the zygote to fork, handing it the child's ends; the child holds
    // its own copies once the zygote has answered. A zygote that fails its
    // protocol is not used again.
    void request() {
        errno = 0;
        int nice = ::getpriority(PRIO_PROCESS, 0);  // this thread's (Linux)
        if (errno != 0) nice = 0;
        const json request = {{"session", session_id_},
                              {"env", sandbox_environment(zygote_.image_)},
                              {"hostname", "sandbox"},
                              {"limits",
                               {{"disk_mb", limits_.disk_mb},
                                {"shm_mb", limits_.shm_mb},
                                {"nofile", std::min(limits_.nofile, zygote_nofile())},
                                {"nproc", limits_.pids * tuning::kRuncNprocFactor},
                                {"nice", nice}}},
                              {"cgroups", v1_tasks_.size()},
                              {protocol::kAdoptGraceRequest, settings_.adopt_grace_ms}};
        // In the order the zygote names them (sandbox_protocol.hpp).
        std::vector<int> passed(protocol::kForkFdCount, -1);
        passed[protocol::position(protocol::ForkFd::report)] = child_.report.get();
        passed[protocol::position(protocol::ForkFd::lifeline)] = child_.lifeline.get();
        passed[protocol::position(protocol::ForkFd::log)] = child_.log.get();
        passed[protocol::position(protocol::ForkFd::ipc)] = child_.ipc.get();
        passed[protocol::position(protocol::ForkFd::input)] = child_.input.get();
        passed[protocol::position(protocol::ForkFd::output)] = child_.output.get();
        for (const auto& fd : v1_tasks_) passed.push_back(fd.get());
        try {
            send_request(zygote_.control_.get(), request.dump(), passed);
            (void)receive_reply(zygote_.control_.get(), kStepTimeout);
        } catch (const SandboxError&) {
            zygote_.control_.reset();
            throw;
        }
        child_ = {};
        v1_tasks_.clear();
        requested_ms_ = ms_since_start();
    }

    // The fork's own steps, each answered: its user namespace (mapped to the
    // session's host ids), its init (joined to the v2 cgroup), contained. A
    // fork that fails a step is killed; the error carries the shim's log.
    void watch() {
        try {
            map_ids(await_user_namespace());
            box_->init_pid_ = await_init();
            join_v2_cgroup();
            await_contained();
        } catch (const SandboxError& e) {
            if (forked_ > 0) ::kill(forked_, SIGKILL);
            throw SandboxError(std::string(e.what()) + "; log: " + log_tail(log_));
        }
    }

    std::unique_ptr<RuncSandbox> finish() {
        std::ofstream(box_->dir() / "init.pid") << box_->init_pid_;
        spdlog::debug(
            "session {} forked in {:.1f} ms: prepared and requested {:.1f}, user namespace "
            "{:.1f}, mapped {:.1f}, namespaces {:.1f}, v2 cgroup {:.1f}, contained {:.1f}",
            session_id_, ms_since_start(), requested_ms_, userns_ms_, mapped_ms_, init_ms_,
            cgrouped_ms_, ms_since_start());
        return std::move(box_);
    }

  private:
    // The fork's first report: the pid of the process that made its user namespace.
    pid_t await_user_namespace() {
        const Report userns = receive_report(report_.get(), "the user namespace");
        forked_ = userns.pid;
        userns_ms_ = ms_since_start();
        if (userns.text != protocol::kReportUserns || forked_ <= 0) {
            throw SandboxError("zygote fork: unexpected report '" + userns.text + "'");
        }
        return forked_;
    }

    // The session's host ids become its user namespace's 0..size.
    void map_ids(pid_t forked) {
        write_id_maps(forked, box_->host_ids());
        tell(protocol::kAnswerMapped);
        mapped_ms_ = ms_since_start();
    }

    // The session's init, as the forked process reports it (from its own pid).
    pid_t await_init() {
        const Report init = receive_report(report_.get(), "the session's init");
        pid_t init_pid = -1;
        const std::string init_word = std::string(protocol::kReportInit) + " ";
        const char* digits = init.text.data() + std::min(init_word.size(), init.text.size());
        const auto parsed = std::from_chars(digits, init.text.data() + init.text.size(), init_pid);
        if (init.pid != forked_ || !init.text.starts_with(init_word) || parsed.ec != std::errc() ||
            parsed.ptr != init.text.data() + init.text.size() || init_pid <= 0) {
            throw SandboxError("zygote fork: unexpected report '" + init.text + "'");
        }
        init_ms_ = ms_since_start();
        return init_pid;
    }

    // The init is setting up its mounts meanwhile; it unshares its cgroup
    // namespace (rooted here) only once told.
    void join_v2_cgroup() {
        for (const auto& cgroup : v2_dirs_) {
            write_value(cgroup / "cgroup.procs", std::to_string(box_->init_pid_));
        }
        tell(protocol::kAnswerCgrouped);
        cgrouped_ms_ = ms_since_start();
    }

    // The last report, from the init itself: the session runs contained.
    void await_contained() {
        const Report ready = receive_report(report_.get(), "the contained session");
        if (ready.text != protocol::kReportReady || ready.pid != box_->init_pid_) {
            throw SandboxError("zygote fork: unexpected report '" + ready.text + "' from pid " +
                               std::to_string(ready.pid));
        }
    }

    // The fork's next step waits for one word from the server.
    void tell(std::string_view word) {
        if (::send(report_.get(), word.data(), word.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(word.size())) {
            throw SandboxError("zygote fork: report: " + errno_text());
        }
    }

    double ms_since_start() const {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                         started_)
            .count();
    }

    // The child's ends, passed with the request (protocol::ForkFd).
    struct ChildEnds {
        UniqueFd report, lifeline, log, ipc, input, output;
    };

    Zygote& zygote_;
    const std::string& session_id_;
    const SandboxLimits& limits_;
    const RuntimeSettings& settings_;
    const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
    std::unique_ptr<RuncSandbox> box_;
    std::vector<fs::path> v2_dirs_;
    std::vector<UniqueFd> v1_tasks_;
    std::jthread early_lock_;
    UniqueFd report_;
    ChildEnds child_;
    fs::path log_;
    pid_t forked_ = -1;
    double requested_ms_ = 0, userns_ms_ = 0, mapped_ms_ = 0, init_ms_ = 0, cgrouped_ms_ = 0;
};

std::unique_ptr<RuncSandbox> Zygote::fork(const std::string& session_id,
                                          const SandboxLimits& limits,
                                          const RuntimeSettings& settings) {
    std::lock_guard lock(mutex_);
    if (!control_) throw SandboxError("zygote of image " + image_.name + " is gone");
    ForkInProgress fork(*this, session_id, limits, settings);
    fork.prepare();
    fork.make_cgroups();
    fork.open_channels();
    fork.request();
    fork.watch();
    return fork.finish();
}

}  // namespace cellblock
