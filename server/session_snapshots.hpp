// Hibernated sessions' snapshots on the host (docs/hibernation.md):
// STATE_DIR/snapshots/<session>/ (0700) holds `snapshot`, what the session's
// kernel wrote (opaque bytes, only ever handed back to the same session),
// and `input/`, a copy of its /data/input (which the server wrote). Every
// file is sealed with the session's own key, held only in this store's
// memory (snapshot_cipher.hpp). Nothing here reads a snapshot's content,
// and every file a sandbox could have written is opened without following
// links and taken only if regular.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cellblock/sandbox.hpp"
#include "cellblock/unique_fd.hpp"
#include "snapshot_cipher.hpp"

namespace cellblock {

// The name of the snapshot file in a sandbox's output dir (written by the
// kernel) and in the next sandbox's input dir (read by the kernel).
inline constexpr const char* kSnapshotFile = ".cellblock-snapshot";

// The file `runsc checkpoint --image-path` writes (the exact level,
// docs/hibernation.md), in its dir and when placed back for the restore.
inline constexpr const char* kCheckpointImage = "checkpoint.img";

// A step of keeping or placing a snapshot failed; what() names the step.
class SnapshotError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// A snapshot would pass a cap or the disk's free space; what() has the
// numbers. The session stays awake.
class StorageFull : public SnapshotError {
  public:
    using SnapshotError::SnapshotError;
};

// How much the store may hold (serve's --snapshot-max-mb, --snapshots-max-mb).
struct SnapshotCaps {
    std::uint64_t per_session = std::uint64_t{16} << 30;
    std::uint64_t total = std::uint64_t{256} << 30;
    // Left free on the disk holding the store, for everything else there.
    std::uint64_t keep_free = std::uint64_t{512} << 20;
};

// A keep under way (SnapshotStore::begin_keep, begin_streamed_keep): its
// sealing, seal(), may run on any thread; it touches only what it holds,
// and the loop's thread only its atomics.
struct SnapshotKeeping {
    std::string session_id;
    std::filesystem::path to;  // the session's dir in the store
    UniqueFd output, input;    // the sandbox's output and input dirs
    std::shared_ptr<const SnapshotKey> key;
    std::uint64_t bytes = 0;     // the snapshot's own, once sealed
    std::uint64_t reserved = 0;  // of the store's caps, while it is kept
    // Begun before the kernel writes its snapshot (begin_streamed_keep):
    // seal() takes the file as it grows, so that sealing and writing to disk
    // go on while the kernel still writes. It reads until `written` says the
    // kernel answered (the file is whole); `cancelled` says nobody waits.
    // The kernel's file is left to go with its sandbox (unlinking 500 MB of
    // fresh page cache took 75 ms of the hibernation).
    // At most `room` plain bytes (StorageFull past them), not past `deadline`.
    bool streamed = false;
    std::uint64_t room = 0;
    std::string room_bound;  // what set `room`, for StorageFull's text
    std::chrono::steady_clock::time_point deadline{};
    std::atomic<bool> written{false}, cancelled{false};
    std::atomic<std::uint64_t> sealed{0};  // plain bytes so far
    // The exact level (begin_exact_keep): the dir the runtime wrote its
    // image in (the server's, not the sandbox's); then /data/output is kept
    // too (a host mount: not in the image), and `secrets`, what the wake
    // needs and the sandbox must not see.
    UniqueFd image;
    std::string secrets;
    // Seals the snapshot and the input files into `to`; SnapshotError.
    void seal();
};

// A place under way (SnapshotStore::begin_place): open() may run on any
// thread.
struct SnapshotPlacing {
    UniqueFd from, input;      // the session's dir in the store, and its input/
    std::filesystem::path to;  // the new sandbox's input dir
    // An exact snapshot's (begin_exact_place): where its image goes (a dir
    // of the server's), and its /data/output files, made the sandbox's
    // user's (as they were).
    std::filesystem::path image_to, output_to;
    uid_t output_uid = 0;
    gid_t output_gid = 0;
    std::string session_id;
    std::shared_ptr<const SnapshotKey> key;
    UniqueFd sealed, placed;  // follow()'s: the kept snapshot, and its new file in `to`
    // Makes the snapshot's file in `to` (empty, of its final mode) and
    // returns the size it will have, so that the new kernel may read it
    // while open() writes it, each chunk checked before it is written
    // (snapshot_cipher.hpp); std::nullopt, and nothing made, for a snapshot
    // sealed in format 1 (checked only at its end: opened whole before the
    // kernel is told). SnapshotError.
    std::optional<std::uint64_t> follow();
    // Opens every file into `to` (the snapshot first when followed);
    // SnapshotError when one fails its check.
    void open() const;
    // An exact snapshot's secrets (begin_exact_keep); SnapshotError.
    std::string secrets() const;
};

struct SnapshotInfo {
    std::uint64_t bytes = 0;  // on disk: the snapshot and the input files, sealed
    double kept_at = 0;       // unix time
    bool exact = false;       // the runtime's image (begin_exact_keep), not the kernel's
};

// What a keep that threw says to the session's history and its
// HibernateFailed: StorageFull named as such, else the step that failed.
std::string why_not_kept(const std::exception& error);
// The log line of a kept snapshot (`report`: the kernel's, as report_of in
// session_sleep.cpp cleaned it).
void log_kept(const std::string& session_id, std::uint64_t bytes, const nlohmann::json& report,
              double ms);

class SnapshotStore {
  public:
    // Makes `root` (0700) if it is missing.
    explicit SnapshotStore(std::filesystem::path root, SnapshotCaps caps = {});

    // Moves the snapshot the kernel wrote in `output_dir` into the store and
    // copies `input_dir`'s files beside it, all sealed under a new key of the
    // session's; returns the snapshot's own bytes. StorageFull, before
    // anything is written, when it would pass a cap or the disk's free
    // space. On failure nothing of the session's is left in the store.
    std::uint64_t keep(const std::string& session_id, const std::filesystem::path& output_dir,
                       const std::filesystem::path& input_dir);
    // keep() in three steps, for a seal off the loop's thread: begin_keep
    // checks the room (StorageFull) and reserves it, the returned keeping's
    // seal() writes, and finish_keep (with the snapshot's bytes) or abandon
    // ends it, on the thread that began it. A remove() of the session meanwhile
    // makes finish_keep throw SnapshotError and leaves nothing.
    std::shared_ptr<SnapshotKeeping> begin_keep(const std::string& session_id,
                                                const std::filesystem::path& output_dir,
                                                const std::filesystem::path& input_dir);
    // begin_keep() before the kernel writes anything (what is at the
    // snapshot's name in `output_dir` goes first): the keeping's seal() reads
    // the file as the kernel writes it (SnapshotKeeping). It may take what the caps and the disk
    // leave free at its start; finish_keep checks the caps again with the bytes it took. `wait`
    // bounds its wait for the kernel.
    std::shared_ptr<SnapshotKeeping> begin_streamed_keep(const std::string& session_id,
                                                         const std::filesystem::path& output_dir,
                                                         const std::filesystem::path& input_dir,
                                                         std::chrono::steady_clock::duration wait);
    std::uint64_t finish_keep(SnapshotKeeping& keeping);
    // The exact level (docs/hibernation.md): what `runsc checkpoint` wrote
    // in `image_dir` (kCheckpointImage), the sandbox's /data/output and
    // /data/input (host mounts the image does not hold), and `secrets`
    // (what the wake needs and the sandbox must not see: the kernel's key,
    // the shim's), each sealed as keep() seals; finished as begin_keep's.
    // The image is left in `image_dir` for the caller to remove with it.
    // StorageFull, before anything is written, as begin_keep.
    std::shared_ptr<SnapshotKeeping> begin_exact_keep(const std::string& session_id,
                                                      const std::filesystem::path& image_dir,
                                                      const std::filesystem::path& output_dir,
                                                      const std::filesystem::path& input_dir,
                                                      std::string secrets);
    void abandon(SnapshotKeeping& keeping);
    // The files of every keep begun and never finished go (a server that
    // stops waits for its seals, then drops them: their sessions are closed).
    void abandon_unfinished();
    // keep() from a sandbox the kernel saved in (`report`: what
    // cellblock_snapshot said, for the log), for a relay's put_to_sleep: false
    // with `why` when the sandbox keeps no files here or keeping failed
    // ("StorageFull: <the numbers>" past a cap).
    bool keep_from(const std::string& session_id, const std::filesystem::path& output_dir,
                   const std::filesystem::path& input_dir, const nlohmann::json& report,
                   std::string& why);
    // Gives a new sandbox of the session its input files and the snapshot,
    // opened; SnapshotError when a file fails its check (nothing is left
    // half written).
    void place(const std::string& session_id, const std::filesystem::path& input_dir) const;
    // place() with its opening off this thread: SnapshotError at once when
    // the store holds no such snapshot.
    std::unique_ptr<SnapshotPlacing> begin_place(const std::string& session_id,
                                                 const std::filesystem::path& input_dir) const;
    // An exact snapshot's place: the placing's open() writes the image into
    // `image_dir` (kCheckpointImage, 0600), /data/output's files into
    // `output_dir` as the user `uid`:`gid`, /data/input's into `input_dir`;
    // secrets() reads what begin_exact_keep was given. SnapshotError at once
    // when the store holds no exact snapshot of the session.
    std::unique_ptr<SnapshotPlacing> begin_exact_place(const std::string& session_id,
                                                       const std::filesystem::path& image_dir,
                                                       const std::filesystem::path& output_dir,
                                                       const std::filesystem::path& input_dir,
                                                       uid_t uid, gid_t gid) const;
    // The snapshot leaves the store (resumed, or the session closed).
    void remove(const std::string& session_id);
    // remove() for a caller that deletes the files off its thread: the
    // session's dir is renamed out of the way at once (a name no session
    // has, cleared at the next start) and returned, to be removed by the
    // caller; nullopt when there is nothing, or a keep under way removes it.
    std::optional<std::filesystem::path> remove_later(const std::string& session_id);
    // The remove() of everything in the store; `root` stays. With `except`,
    // those sessions' dirs stay (handed over by the last server, adopted next).
    void clear(const std::set<std::string>& except = {});
    // A handover (docs/restarts.md): the session's key, for the next server
    // to seal under its own; and that server taking the snapshot back with
    // it. adopt() throws SnapshotError when the store has no such snapshot.
    std::string key_bytes(const std::string& session_id) const;
    void adopt(const std::string& session_id, std::string_view key, SnapshotInfo info);
    bool holds(const std::string& session_id) const;
    std::uint64_t bytes(const std::string& session_id) const;
    std::optional<SnapshotInfo> info(const std::string& session_id) const;
    std::uint64_t total_bytes() const;  // of every session's kept files
    const SnapshotCaps& caps() const { return caps_; }
    const std::filesystem::path& root() const { return root_; }

  private:
    std::filesystem::path dir(const std::string& session_id) const;
    void check_room(const std::string& session_id, std::uint64_t needed) const;
    void check_caps(const std::string& session_id, std::uint64_t needed) const;
    // What the caps and the disk leave free for a session's snapshot.
    std::uint64_t room_for(const std::string& session_id, std::string& bound) const;
    std::uint64_t others_bytes(const std::string& session_id) const;
    std::shared_ptr<SnapshotKeeping> start_keeping(const std::string& session_id,
                                                   const std::filesystem::path& output_dir,
                                                   const std::filesystem::path& input_dir);

    std::filesystem::path root_;
    SnapshotCaps caps_;
    struct Kept {
        std::shared_ptr<const SnapshotKey> key;
        SnapshotInfo info;
    };
    std::map<std::string, Kept> kept_;
    // Keeps under way (what each holds of the caps: reserved, or sealed so
    // far); and those whose session was removed meanwhile (their files go
    // when they end).
    std::map<std::string, std::shared_ptr<SnapshotKeeping>> keeping_;
    std::set<std::string> removed_while_keeping_;
    std::uint64_t removed_ = 0;  // names remove_later's dirs
};

}  // namespace cellblock
