// The keeper: what cleans up after a crashed server that no server follows
// (docs/restarts.md, phase 2). The sandboxes end themselves when their
// grace passes; their session dirs, mounts, cgroups and registry rows are the
// host's to remove, and no process of theirs may do it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace cellblock {

struct KeeperOptions {
    std::filesystem::path state_dir;
    std::filesystem::path libexec_dir;
    pid_t server_pid = 0;
    std::uint64_t server_start = 0;  // process_start_ticks of server_pid
    int grace_ms = 0;                // the server's --adopt-grace
    // A Swarm server's engine (--swarm-docker-host): its services are what
    // it left, removed past the grace like a runc server's sandboxes.
    std::string swarm_docker_host;
};

// Starts `cellblock keep` for this process (a server) as a process of its
// own (a session of its own, not this one's child), which outlives it. One
// keeper watches a state dir at a time: a server re-executed by SIGHUP keeps
// its first one (the same pid); the keeper of a server that follows a crash
// waits for the last one, which ends when it sees the new server. Logs and
// goes on if it cannot start one.
void spawn_keeper(const KeeperOptions& options);

// `cellblock keep`: waits for the server to end; if nothing of its sandboxes
// is left, or a server takes the state dir within the grace (and a margin),
// exits. Otherwise takes the state dir's lock and reaps what is left as the
// next start would: the sessions' processes, sandboxes, mounts, cgroups and
// dirs, their live rows, and marks them closed in the registry (those handed
// over by SIGHUP/SIGUSR2 stay for the next start). Returns the exit status.
int run_keeper(const KeeperOptions& options);

}  // namespace cellblock
