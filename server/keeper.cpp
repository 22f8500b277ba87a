#include "keeper.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "cellblock/host_ids.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/session_store.hpp"
#include "cellblock/swarm_backend.hpp"
#include "cellblock/unique_fd.hpp"
#include "manager_paths.hpp"
#include "server.hpp"

namespace cellblock {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kPoll = std::chrono::milliseconds(500);
// Past the grace: the shims look for a server every 100 ms, and the last of
// them ends its sandbox a moment after its grace.
constexpr auto kMargin = std::chrono::seconds(3);

fs::path keeper_lock_file(const fs::path& state_dir) { return state_dir / "keeper.lock"; }

// Anything a sandbox of the dead server left: a session (or zygote) dir, or
// a Swarm server's service. An engine that does not answer is no answer.
bool sandboxes_left(const RuntimeSettings& settings, const SwarmSettings* swarm) {
    std::error_code ec;
    if (fs::directory_iterator(settings.sessions_dir(), ec) != fs::directory_iterator()) {
        return true;
    }
    try {
        return swarm && !swarm_services_left(*swarm, false).empty();
    } catch (const std::exception&) {
        return true;
    }
}

void reap(const RuntimeSettings& settings, const SwarmSettings* swarm) {
    if (swarm) {
        try {
            for (const auto& name : swarm_services_left(*swarm, true)) {
                spdlog::info("cellblock keep: removed swarm service {}", name);
            }
        } catch (const std::exception& e) {
            spdlog::error(
                "cellblock keep: swarm services: {} (the next server on {} removes "
                "them)",
                e.what(), settings.state_dir.string());
        }
    }
    SessionStore store(settings.state_dir / "cellblock.db");
    for (const auto& s : store.sessions(true, 1000000)) {
        if (s.host_id_count == 0) continue;
        const auto killed = kill_leftovers_in(settings.host_ids, {s.host_id_base, s.host_id_count},
                                              settings.sessions_dir() / s.id);
        if (!killed.empty()) {
            spdlog::info("cellblock keep: session {}: killed {} leftover process(es)", s.id,
                         killed.size());
        }
    }
    for (const auto& id : reap_abandoned_sessions(settings)) {
        spdlog::info("cellblock keep: reaped the sandbox of session {}", id);
    }
    await_cgroup_removals(std::chrono::seconds(10));
    // Sessions handed over (SIGHUP, SIGUSR2) wait for the next start as they
    // are; the adoption records of the others go with their sandboxes.
    std::set<std::string> handed;
    for (const auto& row : store.handovers()) {
        if (row.name.rfind("live/", 0) == 0) {
            store.remove_handover(row.name);
        } else if (row.name != "@server") {
            handed.insert(row.name);
        }
    }
    const std::string why = "no server took it back within --adopt-grace";
    for (const auto& id : store.close_all_open("server_restart", unix_now(), handed)) {
        store.add_event({id, unix_now(), "closed", "not adopted: " + why});
        spdlog::info("cellblock keep: session {} marked closed: server_restart ({})", id, why);
    }
}

}  // namespace

void spawn_keeper(const KeeperOptions& o) {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) {
        spdlog::warn("no keeper for this server: /proc/self/exe: {}", ec.message());
        return;
    }
    // Made here, not by the keeper: a keeper starting as its server stops
    // must not put a file back into a state dir being removed.
    if (!UniqueFd(
            ::open(keeper_lock_file(o.state_dir).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600))) {
        spdlog::warn("no keeper for this server: {}: {}", keeper_lock_file(o.state_dir).string(),
                     std::strerror(errno));
        return;
    }
    const pid_t server = ::getpid();
    std::vector<std::string> args = {self.string(),    "keep",
                                     "--state-dir",    o.state_dir.string(),
                                     "--libexec-dir",  o.libexec_dir.string(),
                                     "--server-pid",   std::to_string(server),
                                     "--server-start", std::to_string(process_start_ticks(server)),
                                     "--grace-ms",     std::to_string(o.grace_ms)};
    if (!o.swarm_docker_host.empty()) {
        args.insert(args.end(), {"--swarm-docker-host", o.swarm_docker_host});
    }
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    // Twice forked: the keeper is no child of the server's (nothing to reap
    // here) and leads a session of its own (a signal to the server's group
    // does not reach it). Only async-signal-safe calls between fork and exec.
    const pid_t child = ::fork();
    if (child < 0) {
        spdlog::warn("no keeper for this server: fork: {}", std::strerror(errno));
        return;
    }
    if (child == 0) {
        ::setsid();
        if (::fork() != 0) ::_exit(0);
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    int status = 0;
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
}

int run_keeper(const KeeperOptions& o) {
    // The server blocks its signals for its signalfd, and exec keeps the
    // mask: a keeper must end on SIGTERM like any process.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    RuntimeSettings settings;
    settings.state_dir = o.state_dir;
    settings.libexec_dir = o.libexec_dir;
    std::optional<SwarmSettings> swarm;
    if (!o.swarm_docker_host.empty()) {
        swarm.emplace();
        swarm->docker_host = o.swarm_docker_host;
        swarm->state_dir = o.state_dir;
    }
    const SwarmSettings* on_swarm = swarm ? &*swarm : nullptr;
    // One keeper per state dir, holding keeper.lock for its life; the file
    // names the server it watches. A server that re-executed itself (SIGHUP,
    // the same pid) has its keeper already. A server that follows a crashed
    // one waits for the last keeper, which ends when it sees this server.
    // Its server made the file; gone, the state dir is being removed.
    const UniqueFd keeper_lock(::open(keeper_lock_file(o.state_dir).c_str(), O_RDWR | O_CLOEXEC));
    if (!keeper_lock) return errno == ENOENT ? 0 : 1;
    const std::string watched =
        std::to_string(o.server_pid) + " " + std::to_string(o.server_start) + "\n";
    if (::flock(keeper_lock.get(), LOCK_EX | LOCK_NB) != 0) {
        char held[64] = {};
        const ssize_t n = ::pread(keeper_lock.get(), held, sizeof held - 1, 0);
        if (n > 0 && std::string(held, static_cast<std::size_t>(n)) == watched) return 0;
        while (::flock(keeper_lock.get(), LOCK_EX) != 0 && errno == EINTR) {
        }
    }
    if (::ftruncate(keeper_lock.get(), 0) != 0 ||
        ::pwrite(keeper_lock.get(), watched.data(), watched.size(), 0) < 0) {
        spdlog::warn("cellblock keep: {}: {}", keeper_lock_file(o.state_dir).string(),
                     std::strerror(errno));
    }

    while (o.server_start != 0 && process_start_ticks(o.server_pid) == o.server_start) {
        std::this_thread::sleep_for(kPoll);
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(o.grace_ms) + kMargin;
    bool waited = false;
    while (true) {
        std::error_code ec;
        // A server on the state dir adopts or reaps; nothing left: all done.
        if (!fs::exists(o.state_dir, ec) || server_lock_holder(o.state_dir) ||
            !sandboxes_left(settings, on_swarm)) {
            return 0;
        }
        if (Clock::now() >= deadline) break;
        if (!waited) {
            spdlog::info(
                "cellblock keep: server {} ended; its sandboxes wait {} ms for a server to "
                "adopt them, then are reaped",
                o.server_pid, o.grace_ms);
            waited = true;
        }
        std::this_thread::sleep_for(kPoll);
    }
    UniqueFd lock;
    try {
        lock = hold_server_lock(o.state_dir);
    } catch (const std::exception&) {
        return 0;  // a server started this instant: it reaps
    }
    spdlog::info("cellblock keep: no server came back within the grace; reaping what is left");
    try {
        reap(settings, on_swarm);
    } catch (const std::exception& e) {
        spdlog::error("cellblock keep: {}", e.what());
        return 1;
    }
    return 0;
}

}  // namespace cellblock
