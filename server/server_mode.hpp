// `cellblock serve`: many sandboxed sessions, a manager socket to create,
// list, inspect and close them, a warm pool, and the SQLite registry.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "cellblock/cpu_demand.hpp"
#include "cellblock/cpu_fairness.hpp"
#include "cellblock/sched_slice.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/swarm_backend.hpp"
#include "kernel_mode.hpp"

namespace cellblock {

struct ServeOptions {
    ServerPaths paths;  // state_dir: /var/lib/cellblock by default
    std::string manager_endpoint = "tcp://127.0.0.1:*";
    std::string default_image = "host";
    std::map<std::string, int> pool;  // image -> warm sandboxes to keep
    int pool_workers = 2;
    bool audit_code_hash_only = false;
    // The nice value of the server's loop and I/O threads (relay_priority.hpp).
    int relay_nice = -10;
    // The sandboxes' parent cgroup weighs what its active sessions weigh
    // (cpu_fairness.hpp, sandboxes_weight); false leaves it at the host's
    // default, one process's worth for all of them.
    bool weigh_sandboxes = true;
    // Sessions holding the CPU (yielding or demoted) become idle cgroups,
    // and so does the sandboxes' parent while they hold it and the host's
    // own processes do not contend (cpu_fairness.hpp; docs/performance.md,
    // "cpu.idle"). Off by default: measured, not yet the default.
    bool cpu_idle = false;
    // EEVDF's slice, in microseconds, of the server's threads and of an
    // interactive session's tasks; a session holding the CPU gets the
    // kernel's default back (sched_slice.hpp). 0: the kernel's default for all.
    std::uint32_t interactive_slice_us = kInteractiveSliceUs;
    // The CPUs a loud session is kept to (a cpuset list, made by
    // loud_cpu_list from --loud-cpus); empty: every session on every CPU.
    std::string loud_cpus;
    // When the sessions holding the CPU are kept to those CPUs
    // (--loud-cpus-for): while one of them grows its memory as a bomb does,
    // or always.
    LoudCpusFor loud_cpus_for = LoudCpusFor::growing;
    // Where the host's servers publish what their sessions ask of that
    // parent (cpu_demand.hpp): servers sharing a host share this too.
    std::filesystem::path cpu_demand_dir = kCpuDemandDir;
    // How the relay speaks to the kernels' sockets (kernel_socket.hpp).
    RelayTransport kernel_transport = RelayTransport::zmtp;
    RelayTransport client_transport = RelayTransport::zmtp;
    ServerPolicy policy;
    // Where sessions' sandboxes are placed (docs/scale-out.md): "runc" on
    // this host, or "swarm" (one Swarm service per session, `swarm` below).
    std::string backend = "runc";
    SwarmSettings swarm;
    // The egress gateway (docs/network.md): started when policy.maxima.network
    // is gateway, i.e. when --egress-allow named what sessions may reach.
    EgressSettings egress;
    // --metrics: where the Prometheus and health endpoints listen
    // (metrics_http.hpp, "PORT" or "ADDR:PORT"); empty: none.
    std::string metrics_address;
    // Hibernated sessions' snapshots (docs/hibernation.md, "Storage"): the
    // most one session's may take, and all of them together, in MB.
    std::uint64_t snapshot_max_mb = 16384;
    std::uint64_t snapshots_max_mb = 262144;
    // A planned restart (docs/restarts.md): the key the handover is sealed
    // under (outside the state dir, made on first use), and how long SIGHUP
    // waits for busy sessions to finish before it closes them.
    std::filesystem::path key_file = "/etc/cellblock/server.key";
    double takeover_wait_s = 60;
    // After a crash (docs/restarts.md, phase 2): how long each session's
    // sandbox outlives this server, waiting for the next start on the same
    // state dir to adopt it; 0: sandboxes end with the server.
    double adopt_grace_s = 180;
    // What SIGHUP runs again once the sessions are handed over: this
    // program's path (read at start, so an upgrade installed over it runs)
    // and its arguments.
    std::string self_exe;
    std::vector<std::string> command_line;
};

// Runs until SIGTERM/SIGINT; returns the process exit code. SIGHUP hands
// the sessions over and execs `self_exe` with `command_line`.
int run_server(const ServeOptions& options);

}  // namespace cellblock
