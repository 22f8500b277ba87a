#include "cellblock/host_ids.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "sandbox_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

// Adds the numbers after "Uid:" / "Gid:" (real, effective, saved, fs) of one status file.
void add_status_ids(const fs::path& status, std::set<std::uint32_t>& ids) {
    std::ifstream in(status);
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("Uid:", 0) != 0 && line.rfind("Gid:", 0) != 0) continue;
        std::istringstream fields(line.substr(4));
        for (std::uint64_t id = 0; fields >> id;) ids.insert(static_cast<std::uint32_t>(id));
        if (line[0] == 'G') return;  // Gid follows Uid
    }
}

std::string read_holder(int fd) {
    char buf[4096];
    const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
    std::string text = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
    while (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
}

// Where sandboxes' host ids start: 1 << 30, the range every sandbox shared
// before ranges were leased, and every pool's ranges above it.
constexpr std::uint32_t kSandboxIdSpace = 1u << 30;

// Adds the host uids and gids the process of a /proc/PID directory runs
// with. The directory is owned by the process's effective uid and gid,
// dumpable or not (kept so for ps). Where both lie in the sandboxes' id
// space, the process is a sandbox's, all of whose ids are in its one range:
// the stat (~2 us) says enough. Anything else has its status file read
// (~17 us): with 500 sessions on a host, reading every one was ~25 ms.
void add_process_ids(const fs::path& proc_pid, std::set<std::uint32_t>& ids) {
    struct stat st {};
    if (::stat(proc_pid.c_str(), &st) != 0) return;  // gone meanwhile
    if (st.st_uid >= kSandboxIdSpace && st.st_gid >= kSandboxIdSpace) {
        ids.insert(st.st_uid);
        ids.insert(st.st_gid);
        return;
    }
    add_status_ids(proc_pid / "status", ids);
}

// Whether any uid or gid of the process lies in [first, first + count).
bool process_in_range(const fs::path& proc_pid, std::uint32_t first, std::uint32_t count) {
    std::set<std::uint32_t> ids;
    add_process_ids(proc_pid, ids);
    const auto it = ids.lower_bound(first);
    return it != ids.end() && *it - first < count;
}

fs::path lease_file(const HostIdPool& pool, std::uint32_t index) {
    return pool.lease_dir / (std::to_string(index) + ".lock");
}
}  // namespace

std::set<std::uint32_t> host_ids_in_use() {
    std::set<std::uint32_t> ids;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        add_process_ids(entry.path(), ids);
    }
    // Keys outlive their processes until the kernel's collector runs; a
    // range whose keys are still charged would start with less quota.
    std::ifstream keys("/proc/key-users");
    std::string line;
    while (std::getline(keys, line)) {
        std::istringstream fields(line);
        std::uint64_t uid = 0;
        if (fields >> uid) ids.insert(static_cast<std::uint32_t>(uid));
    }
    return ids;
}

HostIdLease lease_host_ids(const HostIdPool& pool, const fs::path& holder) {
    std::error_code ec;
    fs::create_directories(pool.lease_dir, ec);
    if (ec)
        throw std::runtime_error("host id leases " + pool.lease_dir.string() + ": " + ec.message());
    ::chmod(pool.lease_dir.c_str(), 0700);
    const std::set<std::uint32_t> in_use = host_ids_in_use();
    std::uint32_t busy = 0, leftovers = 0;
    for (std::uint32_t index = 0; index < pool.ranges; ++index) {
        const IdMapping ids = pool.range(index);
        const auto first_used = in_use.lower_bound(ids.host_base);
        if (first_used != in_use.end() && *first_used < ids.host_base + ids.size) {
            ++leftovers;
            continue;
        }
        const fs::path path = lease_file(pool, index);
        UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
        if (!fd) {
            throw std::runtime_error("host id lease " + path.string() + ": " +
                                     std::strerror(errno));
        }
        if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
            ++busy;
            continue;
        }
        // The last holder's session dir still there: its sandbox is not
        // cleaned up yet (its owner died and no reaper has run).
        const std::string previous = read_holder(fd.get());
        if (!previous.empty() && fs::exists(previous, ec)) {
            ++leftovers;
            continue;
        }
        const std::string text = holder.string() + "\n";
        if (::ftruncate(fd.get(), 0) != 0 ||
            ::pwrite(fd.get(), text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
            throw std::runtime_error("host id lease " + path.string() + ": " +
                                     std::strerror(errno));
        }
        return HostIdLease(std::move(fd), index, ids);
    }
    throw std::runtime_error("host id pool " + pool.lease_dir.string() + ": all " +
                             std::to_string(pool.ranges) + " ranges of " +
                             std::to_string(pool.range_size) + " ids are taken (" +
                             std::to_string(busy) + " leased, " + std::to_string(leftovers) +
                             " still used by processes, keys or sandboxes not cleaned up)");
}

HostIdLease relet_host_ids(const HostIdPool& pool, const IdMapping& ids, const fs::path& holder) {
    if (ids.host_base < pool.first_id || (ids.host_base - pool.first_id) % pool.range_size != 0 ||
        ids.size != pool.range_size) {
        throw std::runtime_error("host ids " + std::to_string(ids.host_base) +
                                 ".. are not a range of the pool");
    }
    const std::uint32_t index = (ids.host_base - pool.first_id) / pool.range_size;
    const fs::path path = lease_file(pool, index);
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
    if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        throw std::runtime_error("host id lease " + path.string() + ": not free");
    }
    if (read_holder(fd.get()) != holder.string()) {
        throw std::runtime_error("host id lease " + path.string() + " names another holder");
    }
    return HostIdLease(std::move(fd), index, pool.range(index));
}

std::vector<int> kill_leftovers_in(const HostIdPool& pool, const IdMapping& ids,
                                   const fs::path& holder) {
    std::vector<int> killed;
    if (ids.host_base < pool.first_id || (ids.host_base - pool.first_id) % pool.range_size != 0)
        return killed;  // not a range of this pool
    const std::uint32_t index = (ids.host_base - pool.first_id) / pool.range_size;
    const UniqueFd fd(::open(lease_file(pool, index).c_str(), O_RDWR | O_CLOEXEC));
    if (!fd) return killed;
    // Held while killing, so that no one leases the range meanwhile.
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0 && read_holder(fd.get()) == holder.string()) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator("/proc", ec)) {
            const std::string name = entry.path().filename().string();
            if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
            if (!process_in_range(entry.path(), ids.host_base, ids.size)) continue;
            const int pid = std::stoi(name);
            // A zombie is not "killed": it had ended, and waits for its reaper.
            if (sandbox_detail::process_gone(pid)) continue;
            if (::kill(pid, SIGKILL) == 0) killed.push_back(pid);
        }
    }
    return killed;
}

namespace sandbox_detail {

void write_id_maps(pid_t pid, const IdMapping& ids) {
    const std::string map = "0 " + std::to_string(ids.host_base) + " " + std::to_string(ids.size);
    const fs::path proc = "/proc/" + std::to_string(pid);
    write_value(proc / "uid_map", map);
    write_value(proc / "gid_map", map);
}

}  // namespace sandbox_detail
}  // namespace cellblock
