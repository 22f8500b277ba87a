// Hibernated sessions' snapshots on the host (docs/hibernation.md):
// STATE_DIR/snapshots/<session>/ (0700) holds `snapshot`, what the session's
// kernel wrote (opaque bytes, only ever handed back to the same session),
// and `input/`, a copy of its /data/input (which the server wrote). Nothing
// here reads a snapshot's content, and every file a sandbox could have
// written is opened without following links and taken only if regular.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace cellblock {

// The name of the snapshot file in a sandbox's output dir (written by the
// kernel) and in the next sandbox's input dir (read by the kernel).
inline constexpr const char* kSnapshotFile = ".cellblock-snapshot";

// A step of keeping or placing a snapshot failed; what() names the step.
class SnapshotError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class SnapshotStore {
  public:
    // Makes `root` (0700) if it is missing.
    explicit SnapshotStore(std::filesystem::path root);

    // Moves the snapshot the kernel wrote in `output_dir` into the store and
    // copies `input_dir`'s files beside it; returns the bytes kept. On
    // failure nothing of the session's is left in the store.
    std::uint64_t keep(const std::string& session_id, const std::filesystem::path& output_dir,
                       const std::filesystem::path& input_dir);
    // Gives a new sandbox of the session its input files and the snapshot.
    void place(const std::string& session_id, const std::filesystem::path& input_dir) const;
    // The snapshot leaves the store (resumed, or the session closed).
    void remove(const std::string& session_id) const;
    bool holds(const std::string& session_id) const;
    std::uint64_t bytes(const std::string& session_id) const;
    const std::filesystem::path& root() const { return root_; }

  private:
    std::filesystem::path dir(const std::string& session_id) const;
    std::filesystem::path root_;
};

}  // namespace cellblock
