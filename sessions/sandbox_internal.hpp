// What sandbox.cpp, lifeline.cpp, gvisor.cpp, reaper.cpp, the OS concerns'
// files (sandbox_cgroups.cpp, sandbox_mounts.cpp, host_ids.cpp's id maps) and
// the zygote's fork share: small file helpers, naming, the runtime's command
// line, and each concern's host-side verbs. Private to sessions/.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cellblock/errno_text.hpp"
#include "cellblock/runc_sandbox.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;

std::string read_text(const fs::path& path);
std::uint64_t read_u64(const fs::path& path);
std::string log_tail(const fs::path& log);
// Mounts (sandbox_mounts.cpp).
void mount_tmpfs(const fs::path& target, int size_mb, std::uint32_t owner,
                 const char* mode = "0700");
void unmount_if_mounted(const fs::path& target);
// A detached copy of a session directory's mount (open_tree) with
// `attributes` (MOUNT_ATTR_*), for a zygote's fork to move in.
UniqueFd detached_tree(const fs::path& dir, std::uint64_t attributes);
std::string container_id_for(const std::string& session_id);
std::vector<std::string> runtime_argv(const RuntimeSettings& s, std::vector<std::string> args);
fs::path runtime_file(const fs::path& dir);
// Writes `runtime` (the runtime's name, or kForkedRuntime) into runtime_file(dir).
void write_runtime_file(const fs::path& dir, const std::string& runtime);
// Writes `value` to a kernel file (cgroup, /proc/PID/uid_map) in one write(2),
// as those files require; throws SandboxError naming the file and errno.
void write_value(const fs::path& file, const std::string& value);
// Waits up to a second for `pid`, a child of this process (or an orphan
// whose subreaper it is) that was killed, and reaps it; one that takes longer
// to die is reaped by a thread that waits for it.
void reap_child(pid_t pid);
// What runtime_file says of a session forked from a zygote.
inline constexpr const char* kForkedRuntime = "zygote";
// The lifeline's listening socket at `path`, `owner`'s, of `mode`.
int listen_lifeline(const fs::path& path, std::uint32_t owner, mode_t mode = 0600);
bool process_gone(pid_t pid);
// Which connection accept_lifeline takes: the first (a start: the shim
// connects before the kernel exists), or, once the kernel runs (an
// adoption), only the init's (SO_PEERCRED; runc, crun) or only one that
// first writes `proof`, a whole line with its '\n' (runsc:
// sandbox_protocol::adopt_line).
struct LifelinePeer {
    bool only_init = false;
    std::string proof;
};
// The shim's connection; -1 if the sandbox ended or the time passed first.
// A connection that is not `peer` is closed and the wait goes on.
int accept_lifeline(int listener, pid_t init_pid, std::chrono::milliseconds timeout,
                    const LifelinePeer& peer = {});
// Removes the cgroups (rmdir once empty); those whose last processes take
// longer than half a second to go are retried by a thread until they are
// empty (await_cgroup_removals waits for it).
void remove_cgroup_dirs(std::vector<fs::path> dirs);
void remove_cgroups(const std::string& container_id);
// How many cgroups the thread still waits to remove.
std::size_t cgroups_pending_removal();
// A forked session's own cgroup in every hierarchy (sandbox_cgroups.cpp),
// beside its zygote's; and the early taking of the threadgroup lock that
// the fork's move into its v2 cgroup would otherwise wait for.
std::vector<fs::path> create_session_cgroups(const std::string& container_id,
                                             const std::string& zygote_id);
std::jthread take_threadgroup_lock_early(const fs::path& v2_root);
// The leased host ids become `pid`'s user namespace's 0..size (host_ids.cpp):
// uid_map and gid_map, written once each.
void write_id_maps(pid_t pid, const IdMapping& ids);
void remove_session(RuntimeSettings settings, const std::string& session_id, const fs::path& dir);

// gVisor (gvisor.cpp).
// gVisor's Sentry forks its ptrace stubs; when the Sentry dies they are
// orphaned to the nearest subreaper (this process) and must be reaped here.
// The Sentry and gofer pids of live sandboxes are registered: their own
// reap_init waits for them, and it must be the one to (it kills them by pid).
struct RunscChildren {
    std::mutex mutex;
    std::set<pid_t> owned;  // Sentries and gofers of Sandbox objects not yet reaped
    int starting = 0;       // runsc runs whose pids are not registered yet
};
RunscChildren& runsc_children();
void reap_runsc_orphans();
pid_t find_child_gofer(const fs::path& bundle);

}  // namespace cellblock::sandbox_detail
