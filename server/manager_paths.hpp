// Where a server keeps what a manager client needs to find it, and how a
// client tells a live server from a file a dead one left behind.
#pragma once

#include <fcntl.h>
#include <sys/types.h>

#include <filesystem>
#include <optional>

#include "cellblock/unique_fd.hpp"

namespace cellblock {

inline std::filesystem::path server_file(const std::filesystem::path& state_dir) {
    return state_dir / "server.json";
}

// The live server holds a POSIX write lock on this file (the kernel drops it
// when the server dies, even by SIGKILL; server.json may stay behind).
inline std::filesystem::path server_lock_file(const std::filesystem::path& state_dir) {
    return state_dir / "server.lock";
}

// The pid of the server holding STATE_DIR's lock, or nothing: no server runs
// there. Tests the lock without taking it (F_GETLK), so it never gets in the
// way of a server starting.
inline std::optional<pid_t> server_lock_holder(const std::filesystem::path& state_dir) {
    const UniqueFd fd(::open(server_lock_file(state_dir).c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return std::nullopt;
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    if (::fcntl(fd.get(), F_GETLK, &lock) != 0 || lock.l_type == F_UNLCK) return std::nullopt;
    return lock.l_pid;
}

inline std::filesystem::path default_serve_state_dir() { return "/var/lib/cellblock"; }

}  // namespace cellblock
