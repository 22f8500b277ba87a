// Host id ranges, one per sandbox, leased from a pool shared by every
// cellblock process on the host (servers with any state dir, kernel mode).
//
// The kernel counts several limits per host uid whatever the namespace:
// session keyrings (kernel.keys.maxkeys), RLIMIT_NPROC, inotify instances
// and watches, POSIX message queue bytes. Sandboxes that shared one range
// shared those quotas, so one could exhaust what the others need.
#pragma once

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

struct HostIdPool {
    // One lease file per range, flock'ed by its holder for the sandbox's
    // lifetime: the kernel drops the lock when the holder dies, whatever way.
    std::filesystem::path lease_dir = "/run/cellblock-ids";
    // Range 0 starts one range above 1 << 30: 1 << 30 itself is the range
    // every sandbox shared before ranges were leased, which an older
    // cellblock on the same host may still use.
    std::uint32_t first_id = (1u << 30) + 65536;
    std::uint32_t range_size = 65536;
    // Up to 2^32 - 65536: (uid_t)-1 is never a valid id, so the last range stops short of it.
    std::uint32_t ranges = 49150;
    IdMapping range(std::uint32_t index) const {
        return {first_id + index * range_size, range_size};
    }
};

// Host uids and gids (0-based values from /proc) that some process runs
// with, or that the kernel still keeps keys for (/proc/key-users): a range
// containing any of them is not handed out.
std::set<std::uint32_t> host_ids_in_use();

// A held range. Released (the lock dropped) on destruction; the lease file
// stays, so that two processes never lock two different inodes of one name.
class HostIdLease {
  public:
    HostIdLease() = default;
    HostIdLease(UniqueFd fd, std::uint32_t index, IdMapping ids)
        : fd_(std::move(fd)), index_(index), ids_(ids) {}

    bool held() const { return static_cast<bool>(fd_); }
    std::uint32_t index() const { return index_; }
    const IdMapping& ids() const { return ids_; }
    void release() { fd_.reset(); }  // drops the flock

  private:
    UniqueFd fd_;  // the lease file, flock'ed
    std::uint32_t index_ = 0;
    IdMapping ids_;
};

// Leases the first free range of the pool: its lease file not locked by a
// live process, no process running with an id in it, no key charged to an
// id in it, and the holder recorded by its last lease (a session dir) gone,
// so nothing of an earlier sandbox remains when the range is used again.
// `holder` (the new sandbox's session dir) is written into the lease file.
// Throws std::runtime_error naming the pool when every range is taken.
HostIdLease lease_host_ids(const HostIdPool& pool, const std::filesystem::path& holder);

// A restarted server adopting a live sandbox (docs/restarts.md): takes the
// lease of `ids` back, provided its file is free and still names `holder`.
// Throws std::runtime_error otherwise.
HostIdLease relet_host_ids(const HostIdPool& pool, const IdMapping& ids,
                           const std::filesystem::path& holder);

// Crash recovery: kills every host process running with an id of `ids`, a
// range the registry says a dead owner's session had, provided its lease is
// free and still names that session's dir as its holder (so the range has not
// been handed to anyone since). Returns the pids signalled.
std::vector<int> kill_leftovers_in(const HostIdPool& pool, const IdMapping& ids,
                                   const std::filesystem::path& holder);

}  // namespace cellblock
