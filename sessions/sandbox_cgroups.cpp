// A sandbox's cgroups (v1 and v2): usage counters, CPU quota and weight,
// nice, task counts.
#include "sandbox_internal.hpp"

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

#include "cellblock/cpu_fairness.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/sandbox_tuning.hpp"
#include "cellblock/sched_slice.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;

bool cgroup_v2() { return fs::exists(fs::path(kCgroupRoot) / "cgroup.controllers"); }

std::vector<fs::path> cgroup_hierarchies() {
    if (cgroup_v2()) return {kCgroupRoot};
    std::vector<fs::path> hierarchies;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(kCgroupRoot, ec)) {
        std::error_code type_ec;
        if (!entry.is_directory(type_ec) || entry.is_symlink(type_ec)) continue;
        hierarchies.push_back(entry.path());
    }
    return hierarchies;
}

std::vector<fs::path> sandboxes_cgroup_parents() {
    std::vector<fs::path> parents;
    for (const auto& hierarchy : cgroup_hierarchies())
        parents.push_back(hierarchy / kSandboxesCgroup);
    return parents;
}

std::vector<fs::path> sandbox_cgroup_dirs(const std::string& container_id) {
    std::vector<fs::path> dirs;
    const bool v2 = cgroup_v2();
    for (const auto& parent : sandboxes_cgroup_parents()) {
        const fs::path dir = parent / container_id;
        if (v2 || fs::exists(dir)) dirs.push_back(dir);
    }
    return dirs;
}

namespace {

// v2's cpu.weight is 1..10000 with 100 the default; v1's shares 2..262144, 1024.
std::string weight_text(int shares, bool v2) {
    return std::to_string(v2 ? std::clamp(shares * 100L / tuning::kNormalCpuShares, 1L, 10000L)
                             : std::clamp<long>(shares, 2, kMaxCpuShares));
}

}  // namespace

namespace {

// The CPU controller's directory of a top-level cgroup `group` (v1: whichever
// mount holds the cpu controller; v2: the unified tree), whether it exists or
// not; empty if the host has no CPU controller.
fs::path cpu_group_dir(const char* group, bool& v2) {
    const fs::path root = kCgroupRoot;
    v2 = cgroup_v2();
    if (v2) return root / group;
    for (const char* controller : {"cpu", "cpu,cpuacct"})
        if (fs::exists(root / controller / "cpu.shares")) return root / controller / group;
    return {};
}

// Writes `text` to the CPU controller's file of a top-level cgroup, named
// by whether the tree is v2.
bool write_cpu_file(const char* group, const char* v1_name, const char* v2_name,
                    const std::string& text) {
    bool v2 = false;
    const fs::path dir = cpu_group_dir(group, v2);
    if (dir.empty()) return false;
    const UniqueFd fd(::open((dir / (v2 ? v2_name : v1_name)).c_str(), O_WRONLY | O_CLOEXEC));
    return fd && ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size());
}

bool write_cpu_weight(const char* group, int shares) {
    return write_cpu_file(group, "cpu.shares", "cpu.weight", weight_text(shares, cgroup_v2()));
}

}  // namespace

bool set_sandboxes_cpu_weight(int shares) { return write_cpu_weight(kSandboxesCgroup, shares); }

bool set_sandboxes_cpu_idle(bool idle) {
    return write_cpu_file(kSandboxesCgroup, "cpu.idle", "cpu.idle", idle ? "1" : "0");
}

bool set_servers_cpu_weight(int shares) { return write_cpu_weight(kServersCgroup, shares); }

std::string join_servers_cgroup() {
    bool v2 = false;
    const fs::path dir = cpu_group_dir(kServersCgroup, v2);
    if (dir.empty()) return "no CPU controller";
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
        return "mkdir " + dir.string() + ": " + errno_text();
    const UniqueFd fd(::open((dir / "cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC));
    const std::string self = std::to_string(::getpid());
    if (!fd || ::write(fd.get(), self.data(), self.size()) != static_cast<ssize_t>(self.size()))
        return "join " + (dir / "cgroup.procs").string() + ": " + errno_text();
    return "";
}

void RuncSandbox::open_counters() {
    auto open_first = [&](std::initializer_list<const char*> names, int flags) {
        for (const auto& dir : cgroup_dirs_) {
            for (const char* name : names) {
                UniqueFd fd(::open((dir / name).c_str(), flags | O_CLOEXEC));
                if (fd) return fd;
            }
        }
        return UniqueFd();
    };
    // v1 names first, then v2's.
    counters_.memory_peak = open_first({"memory.max_usage_in_bytes", "memory.peak"}, O_RDONLY);
    counters_.memory_usage = open_first({"memory.usage_in_bytes", "memory.current"}, O_RDONLY);
    counters_.oom_control = open_first({"memory.oom_control", "memory.events"}, O_RDONLY);
    counters_.cpu_usage = open_first({"cpuacct.usage"}, O_RDONLY);
    counters_.pids_current = open_first({"pids.current"}, O_RDONLY);
    counters_.cpu_weight = open_first({"cpu.shares"}, O_WRONLY);
    if (!counters_.cpu_weight) {
        counters_.cpu_weight = open_first({"cpu.weight"}, O_WRONLY);
        counters_.cpu_weight_v2 = static_cast<bool>(counters_.cpu_weight);
    }
    counters_.cpu_idle = open_first({"cpu.idle"}, O_WRONLY);
    counters_.cpu_quota = open_first({"cpu.cfs_quota_us"}, O_WRONLY);
    if (!counters_.cpu_quota) {
        counters_.cpu_quota = open_first({"cpu.max"}, O_WRONLY);
        counters_.cpu_quota_v2 = static_cast<bool>(counters_.cpu_quota);
    }
}

void RuncSandbox::close_counters() {
    for (UniqueFd* fd : {&counters_.memory_peak, &counters_.memory_usage, &counters_.oom_control,
                         &counters_.cpu_usage, &counters_.cpu_weight, &counters_.cpu_quota,
                         &counters_.cpu_idle, &counters_.pids_current}) {
        fd->reset();
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

// Calls fn with every thread of the sandbox (the first of its cgroups that
// lists them) until fn returns false; false when no cgroup could be read.
template <typename Fn>
bool each_task(const std::vector<fs::path>& dirs, Fn fn) {
    for (const auto& dir : dirs) {
        std::ifstream tasks(dir / (fs::exists(dir / "tasks") ? "tasks" : "cgroup.threads"));
        if (!tasks) continue;
        for (long tid = 0; tasks >> tid;)
            if (!fn(static_cast<pid_t>(tid))) break;
        return true;
    }
    return false;
}

}  // namespace

SandboxUsage RuncSandbox::usage() const {
    SandboxUsage u;
    if (destroyed_) return u;
    char buf[512];
    u.memory_peak_bytes = parse_u64(pread_text(counters_.memory_peak.get(), buf));
    u.memory_bytes = parse_u64(pread_text(counters_.memory_usage.get(), buf));
    u.oom_kills = keyed_u64(pread_text(counters_.oom_control.get(), buf), "oom_kill");
    u.cpu_ns = parse_u64(pread_text(counters_.cpu_usage.get(), buf));
    return u;
}

void RuncSandbox::renice(int nice) {
    if (destroyed_) return;
    each_task(cgroup_dirs_, [&](pid_t tid) {
        ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
        return true;
    });
}

void RuncSandbox::set_slice(std::uint32_t us) {
    if (destroyed_) return;
    // A task that exited meanwhile is no failure; one refused is logged once.
    int refused = 0, error = 0;
    each_task(cgroup_dirs_, [&](pid_t tid) {
        if (!set_sched_slice(tid, us) && errno != ESRCH) {
            ++refused;
            error = errno;
        }
        return true;
    });
    if (refused)
        spdlog::debug("session {}: slice {} us refused for {} tasks: {}", session_id(), us, refused,
                      std::strerror(error));
}

std::int64_t RuncSandbox::task_count() const {
    if (destroyed_ || !counters_.pids_current) return -1;
    char buf[512];
    const std::string_view text = pread_text(counters_.pids_current.get(), buf);
    return text.empty() ? -1 : static_cast<std::int64_t>(parse_u64(text));
}

int RuncSandbox::runnable_tasks(int at_most) const {
    if (destroyed_) return -1;
    int runnable = 0;
    const bool listed = each_task(cgroup_dirs_, [&](pid_t tid) {
        std::ifstream stat("/proc/" + std::to_string(tid) + "/stat");
        std::string line;
        if (!std::getline(stat, line)) return true;  // exited meanwhile
        // "pid (comm) S ...": the comm may hold spaces and parentheses.
        const auto close = line.rfind(')');
        return !(close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'R' &&
                 ++runnable >= at_most);
    });
    return listed ? runnable : -1;
}

bool RuncSandbox::set_cpu_quota(double cpus) {
    if (destroyed_ || !counters_.cpu_quota) return false;
    constexpr long period = tuning::kCpuPeriodUs;
    const long quota = std::max<long>(tuning::kMinCpuQuotaUs, std::lround(cpus * period));
    // cpus <= 0: no quota at all.
    const std::string value = cpus > 0                 ? std::to_string(quota)
                              : counters_.cpu_quota_v2 ? "max"
                                                       : "-1";
    const std::string text = counters_.cpu_quota_v2 ? value + " " + std::to_string(period) : value;
    return ::pwrite(counters_.cpu_quota.get(), text.data(), text.size(), 0) ==
           static_cast<ssize_t>(text.size());
}

bool RuncSandbox::set_cpu_weight(int shares) {
    if (destroyed_ || !counters_.cpu_weight) return false;
    const std::string text = weight_text(shares, counters_.cpu_weight_v2);
    return ::pwrite(counters_.cpu_weight.get(), text.data(), text.size(), 0) ==
           static_cast<ssize_t>(text.size());
}

namespace {

// The CPUs the cgroup above `dir` may hand out (v1's and v2's names), as
// cpuset.cpus takes them; "" where neither can be read.
std::string parent_cpus(const fs::path& dir) {
    for (const char* name : {"cpuset.effective_cpus", "cpuset.cpus.effective"}) {
        std::string text = read_text(dir.parent_path() / name);
        while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
        if (!text.empty()) return text;
    }
    return "";
}

}  // namespace

bool RuncSandbox::set_cpus(const std::string& cpus) {
    if (destroyed_) return false;
    // Opened at each change, not kept like the counters: only --loud-cpus
    // and an adoption write it, at a session's changes of CPU setting
    // (0.15-0.3 ms each). The same name in v1 and v2 (there only with the
    // cpuset controller on).
    for (const auto& dir : cgroup_dirs_) {
        const UniqueFd fd(::open((dir / "cpuset.cpus").c_str(), O_WRONLY | O_CLOEXEC));
        if (!fd) continue;
        // "": the parent's, not what the sandbox held at its start (a sandbox
        // adopted from a server that had narrowed it must not keep that).
        const std::string text = cpus.empty() ? parent_cpus(dir) : cpus;
        return !text.empty() &&
               ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size());
    }
    return false;
}

bool RuncSandbox::set_cpu_idle(bool idle) {
    if (destroyed_ || !counters_.cpu_idle) return false;
    return ::pwrite(counters_.cpu_idle.get(), idle ? "1" : "0", 1, 0) == 1;
}

void RuncSandbox::apply_limits(const SandboxLimits& limits) { apply_cgroup_limits(*this, limits); }

void apply_cgroup_limits(const RuncSandbox& sandbox, const SandboxLimits& limits) {
    const std::int64_t memory = static_cast<std::int64_t>(limits.memory_mb) << 20;
    const std::int64_t period = tuning::kCpuPeriodUs;
    const std::int64_t quota = static_cast<std::int64_t>(limits.cpus * period);
    const bool raising = limits.memory_mb > sandbox.limits().memory_mb;
    for (const auto& dir : sandbox_cgroup_dirs(sandbox.container_id())) {
        if (fs::exists(dir / "memory.limit_in_bytes")) {
            // memory+swap must stay >= memory: order the two writes by direction.
            const bool memsw = fs::exists(dir / "memory.memsw.limit_in_bytes");
            if (raising && memsw)
                write_value(dir / "memory.memsw.limit_in_bytes", std::to_string(memory));
            write_value(dir / "memory.limit_in_bytes", std::to_string(memory));
            if (!raising && memsw)
                write_value(dir / "memory.memsw.limit_in_bytes", std::to_string(memory));
        }
        if (fs::exists(dir / "memory.max")) {
            write_value(dir / "memory.max", std::to_string(memory));
            if (fs::exists(dir / "memory.swap.max")) write_value(dir / "memory.swap.max", "0");
        }
        if (fs::exists(dir / "pids.max")) {
            const RuntimeKind kind = runtime_kind(sandbox.runtime());
            write_value(dir / "pids.max", std::to_string(host_pids_limit(kind, limits.pids)));
        }
        if (fs::exists(dir / "cpu.cfs_quota_us")) {
            write_value(dir / "cpu.cfs_period_us", std::to_string(period));
            write_value(dir / "cpu.cfs_quota_us", std::to_string(quota));
        }
        if (fs::exists(dir / "cpu.max")) {
            write_value(dir / "cpu.max", std::to_string(quota) + " " + std::to_string(period));
        }
    }
}

namespace sandbox_detail {

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

}  // namespace sandbox_detail
}  // namespace cellblock
