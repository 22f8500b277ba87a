// The fixed numbers of a sandbox that are not a session's limits, named once:
// what the OCI config, the cgroup writes, the pool and the mounts agree on.
// A session's own numbers are SandboxLimits and SessionLimits; these are the
// host's side of them.
#pragma once

#include <chrono>
#include <cstdint>

namespace cellblock::tuning {

// CFS: the period set at start (OCI config, apply_cgroup_limits) and by every
// later quota change; a quota under the kernel's floor of 1 ms is raised to it.
inline constexpr std::int64_t kCpuPeriodUs = 100000;
// How long a zygote may take to import the kernel and the image's preload.
inline constexpr std::chrono::seconds kZygoteStartTimeout{120};
inline constexpr std::int64_t kMinCpuQuotaUs = 1000;
// cgroup v1 cpu.shares: a session's kernel, and a pool refill booting in the
// background (cgroup v2's cpu.weight is scaled from these: 1024 -> 100).
inline constexpr int kNormalCpuShares = 1024;
inline constexpr int kBackgroundCpuShares = 64;
// Host-side tmpfs of every session dir: the kernel's ipc sockets and
// connection file, and the shim's log (at most 64 KiB of kernel stderr).
inline constexpr int kIpcTmpfsMb = 4;
inline constexpr int kLogTmpfsMb = 1;
// Under runsc the host's pids.max counts the Sentry's and gofer's threads, not
// the sandbox's tasks (those are bounded inside by RLIMIT_NPROC): a session's
// pids become pids * factor + base on the host.
inline constexpr int kRunscHostPidsFactor = 16;
inline constexpr int kRunscHostPidsBase = 256;
// Under runc RLIMIT_NPROC counts the host uid of the sandbox's range: a loose
// bound of pids * this (the cgroup's pids.max is the real one).
inline constexpr int kRuncNprocFactor = 4;

}  // namespace cellblock::tuning
