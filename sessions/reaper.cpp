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
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/image_builder.hpp"
#include "cellblock/session_dir.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;

namespace {

// Removes what it can of `dirs` at once; returns those still there.
std::vector<fs::path> rmdir_present(const std::vector<fs::path>& dirs) {
    std::vector<fs::path> left;
    for (const auto& dir : dirs) {
        if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) left.push_back(dir);
    }
    return left;
}

// Cgroups whose last processes outlived remove_cgroups' short wait (a killed
// PID-namespace init ends only once the kernel has torn down every process in
// it, seconds while dozens of sandboxes close at once on a loaded host). One
// thread retries them until they are empty, so that nothing is left behind
// for the next server start to find.
class CgroupSweeper {
  public:
    void add(std::vector<fs::path> dirs) {
        std::lock_guard lock(mutex_);
        const auto until = std::chrono::steady_clock::now() + kGiveUpAfter;
        for (auto& dir : dirs) pending_.push_back({std::move(dir), until});
        if (!running_) {
            running_ = true;
            std::thread([this] { sweep(); }).detach();
        }
        changed_.notify_all();
    }

    std::size_t pending() {
        std::lock_guard lock(mutex_);
        return pending_.size();
    }

    bool drain(std::chrono::milliseconds timeout) {
        std::unique_lock lock(mutex_);
        return changed_.wait_for(lock, timeout, [this] { return pending_.empty(); });
    }

  private:
    struct Pending {
        fs::path dir;
        std::chrono::steady_clock::time_point give_up;
    };
    static constexpr auto kGiveUpAfter = std::chrono::minutes(10);
    static constexpr auto kRetryEvery = std::chrono::milliseconds(100);

    void sweep() {
        std::unique_lock lock(mutex_);
        while (!pending_.empty()) {
            changed_.wait_for(lock, kRetryEvery);
            const auto now = std::chrono::steady_clock::now();
            std::erase_if(pending_, [now](const Pending& p) {
                if (::rmdir(p.dir.c_str()) == 0 || errno == ENOENT) return true;
                if (now < p.give_up) return false;
                spdlog::warn("cgroup {} still holds processes after {} min; left in place",
                             p.dir.string(), kGiveUpAfter.count());
                return true;
            });
            changed_.notify_all();
        }
        running_ = false;
    }

    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<Pending> pending_;
    bool running_ = false;
};

CgroupSweeper& cgroup_sweeper() {
    // Never destroyed: its detached thread may outlive static destruction.
    static auto* sweeper = new CgroupSweeper;
    return *sweeper;
}

}  // namespace

void remove_cgroup_dirs(std::vector<fs::path> dirs) {
    // A cgroup is removed with rmdir once empty; retry briefly while the last
    // processes are being torn down, then hand what is left to the sweeper.
    for (int i = 0; i < 50 && !dirs.empty(); ++i) {
        if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        dirs = rmdir_present(dirs);
    }
    if (!dirs.empty()) cgroup_sweeper().add(std::move(dirs));
}

void remove_cgroups(const std::string& container_id) {
    remove_cgroup_dirs(sandbox_cgroup_dirs(container_id));
}

std::size_t cgroups_pending_removal() { return cgroup_sweeper().pending(); }

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
    const SessionDir paths(dir);
    for (const fs::path& mount : paths.mounts()) unmount_if_mounted(mount);
    remove_cgroups(cid);
    // The lock goes last: a remover killed midway leaves a dir whose lock no
    // one holds, which the next reaper takes at once. Without its lock the
    // dir would look like one still being made, and wait out its age.
    std::error_code list_ec;
    for (const auto& entry : fs::directory_iterator(dir, list_ec)) {
        if (entry.path() == paths.lock()) continue;
        std::error_code ec;
        fs::remove_all(entry.path(), ec);
    }
    std::error_code ec;
    fs::remove(paths.lock(), ec);
    if (!fs::remove(dir, ec) && ec && ec != std::errc::no_such_file_or_directory) {
        spdlog::warn("session {}: remove {}: {}", session_id, dir.string(), ec.message());
    }
}

}  // namespace cellblock::sandbox_detail

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;

bool await_cgroup_removals(std::chrono::milliseconds timeout) {
    return cgroup_sweeper().drain(timeout);
}

std::vector<fs::path> remove_orphan_cgroups(std::chrono::seconds min_age) {
    std::vector<fs::path> removed;
    const std::vector<fs::path> parents = sandboxes_cgroup_parents();
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

namespace {

// A session dir with no lock is one being made (mkdir, then its lock) only
// while it holds nothing but the lock's staging file.
bool being_made(const fs::path& dir) {
    const SessionDir paths(dir);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
        if (entry.path() != paths.lock_staging()) return false;
    }
    return true;
}

}  // namespace

std::vector<std::string> reap_abandoned_sessions(const RuntimeSettings& settings) {
    std::vector<std::string> reaped;
    std::error_code ec;
    if (!fs::exists(settings.sessions_dir(), ec)) return reaped;
    for (const auto& entry : fs::directory_iterator(settings.sessions_dir(), ec)) {
        const std::string session_id = entry.path().filename().string();
        // Held until the session is removed, so that no one else reaps it meanwhile.
        const UniqueFd lock(::open(SessionDir(entry.path()).lock().c_str(), O_RDWR | O_CLOEXEC));
        if (lock && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // its owner is alive
        if (!lock && being_made(entry.path())) {
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
