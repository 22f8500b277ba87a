// The server key (docs/restarts.md): 32 random bytes in a file only its
// owner reads, outside the state dir, under which a server seals what it
// hands the next one (each session's client key and snapshot key). A copy
// of the state dir alone then opens nothing.
#pragma once

#include <filesystem>
#include <memory>

#include "snapshot_cipher.hpp"

namespace cellblock {

// Reads the key at `path`; with `create`, makes it first if it is missing
// (0600, its directory 0700 if that is missing too). Throws
// std::runtime_error naming the path and what is wrong: not a regular file,
// not owned by this user, readable by others, not 32 bytes.
std::unique_ptr<SnapshotKey> load_server_key(const std::filesystem::path& path, bool create);

}  // namespace cellblock
