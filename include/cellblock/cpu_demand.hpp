// What every cellblock server on a host asks of the sandboxes' shared
// parent cgroup (`cellblock`, one per host): its weight is computed from
// the sum over all servers (sandboxes_weight in cpu_fairness.hpp), not from
// whichever server wrote last.
//
// Each server publishes its own figures in a file of its own under a shared
// directory, flock'ed for the server's lifetime: the kernel drops the lock
// when the server dies, whatever way, so a file nobody locks is a dead
// server's and is removed by whoever sees it. A file is made under a
// temporary name, locked, then renamed into place, so no reader ever sees
// a live server's file unlocked.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "cellblock/unique_fd.hpp"

namespace cellblock {

inline constexpr const char* kCpuDemandDir = "/run/cellblock-cpu";

struct CpuDemand {
    std::size_t interactive = 0;  // sessions that used CPU lately in short executions
    std::size_t hogging = 0;      // sessions in long executions, demoted or yielding
    std::size_t servers = 0;      // live servers that published (this one included)
};

class HostCpuDemand {
  public:
    // Makes `dir` (0700) if needed and publishes zeros. Throws
    // std::runtime_error naming the step that failed.
    explicit HostCpuDemand(std::filesystem::path dir = kCpuDemandDir);
    ~HostCpuDemand();  // removes this server's file
    HostCpuDemand(const HostCpuDemand&) = delete;
    HostCpuDemand& operator=(const HostCpuDemand&) = delete;

    // This server's figures, written when they change.
    void publish(std::size_t interactive, std::size_t hogging);
    // Every live server's figures summed, this one's included; dead
    // servers' files are removed on the way.
    CpuDemand totals();

    const std::filesystem::path& file() const { return file_; }

  private:
    std::filesystem::path dir_;
    std::filesystem::path file_;
    UniqueFd fd_;
    CpuDemand own_;
};

}  // namespace cellblock
