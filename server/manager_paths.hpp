// Where a server keeps what a manager client needs to find it.
#pragma once

#include <filesystem>

namespace cellblock {

inline std::filesystem::path server_file(const std::filesystem::path& state_dir) {
    return state_dir / "server.json";
}

inline std::filesystem::path default_serve_state_dir() { return "/var/lib/cellblock"; }

}  // namespace cellblock
