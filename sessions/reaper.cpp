// What a crashed or killed server left behind: session dirs, containers and
// cgroups, found and removed at the next start.
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

#include "cellblock/image_builder.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;

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
    // A session forked from a zygote (kForkedRuntime) has no container to delete.
    if (recorded != kForkedRuntime) {
        if (!recorded.empty()) settings.runtime = recorded;
        const auto result = run_process(runtime_argv(settings, {"delete", "--force", cid}));
        if (result.exit_code != 0 && result.output.find("does not exist") == std::string::npos &&
            result.output.find("not exist") == std::string::npos) {
            spdlog::warn("session {}: {} delete: {}", session_id, settings.runtime, result.output);
        }
    }
    unmount_if_mounted(dir / "ipc");
    unmount_if_mounted(dir / "output");
    unmount_if_mounted(dir / "log");
    remove_cgroups(cid);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) spdlog::warn("session {}: remove {}: {}", session_id, dir.string(), ec.message());
}

}  // namespace cellblock::sandbox_detail

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;

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
        // Held until the session is removed, so that no one else reaps it meanwhile.
        const UniqueFd lock(::open((entry.path() / "lock").c_str(), O_RDWR | O_CLOEXEC));
        if (lock && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // its owner is alive
        if (!lock) {
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
        reaped.push_back(session_id);
    }
    return reaped;
}

}  // namespace cellblock
