#include "session_snapshots.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/error_names.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::string megabytes(std::uint64_t bytes) {
    return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MB";
}

// What a copy does to the bytes: seal them into the store, or open them
// out of it. `label` names the file for the seal (snapshot_cipher.hpp).
struct Crypt {
    bool seal = true;
    const SnapshotKey* key = nullptr;
    std::string label;  // "<session>/<place in the snapshot>"
};

// The modes of what a copy makes, and its owner (none: the server's).
// Kept in the store: the server's alone (0600, 0700). Placed in a sandbox's
// input dir: readable by the sandbox's user, as uploads are (0644, 0755);
// in its output dir (an exact snapshot's): the sandbox's user's, as they were.
struct Modes {
    mode_t file, dir;
    uid_t uid = static_cast<uid_t>(-1);
    gid_t gid = static_cast<gid_t>(-1);
};
constexpr Modes kKept{0600, 0700}, kPlaced{0644, 0755};

// `to`, a new empty file of `modes.file` and owner (never through a link);
// SnapshotError, and nothing left, when it cannot be made.
UniqueFd make_new(const fs::path& to, const Modes& modes) {
    UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) throw SnapshotError(to.string() + ": " + errno_text(errno));
    if (::fchmod(out.get(), modes.file) != 0 ||
        (modes.uid != static_cast<uid_t>(-1) && ::fchown(out.get(), modes.uid, modes.gid) != 0)) {
        const int err = errno;
        ::unlink(to.c_str());
        throw SnapshotError("chmod or chown: " + errno_text(err));
    }
    return out;
}

// The regular file at `name` under `dir`, for reading (never through a
// link, never a FIFO that would block); SnapshotError naming `step`.
UniqueFd open_regular(int dir, const std::string& name, const std::string& step) {
    UniqueFd in(::openat(dir, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!in) throw SnapshotError(step + ": " + name + ": " + errno_text(errno));
    struct stat st {};
    if (::fstat(in.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw SnapshotError(step + ": " + name + " is not a regular file");
    }
    return in;
}

// `to`, a new file of `mode`, written by fill(fd) (which returns the plain
// bytes); on disk before this returns when `sync`. A failure removes it.
template <typename Fill>
std::uint64_t write_new(const fs::path& to, const Modes& modes, bool sync, Fill&& fill) {
    UniqueFd out = make_new(to, modes);
    try {
        const std::uint64_t bytes = fill(out.get());
        if (sync && ::fsync(out.get()) != 0) throw SnapshotError("fsync: " + errno_text(errno));
        return bytes;
    } catch (...) {
        ::unlink(to.c_str());
        throw;
    }
}

// A regular file at `name` under `dir` (never through a link, never a FIFO
// that would block) sealed or opened into `to`, a new file; returns the
// plain bytes. A failure removes what was written of `to`.
std::uint64_t copy_regular(int dir, const std::string& name, const fs::path& to,
                           const std::string& step, const Modes& modes, const Crypt& crypt) {
    UniqueFd in = open_regular(dir, name, step);
    try {
        // Kept: on disk before the sandbox goes. Placed: the new sandbox's
        // input lives no longer than the sandbox; an fsync there would only
        // add to the resume.
        return write_new(to, modes, crypt.seal, [&](int out) {
            return crypt.seal ? seal_stream(in.get(), out, *crypt.key, crypt.label)
                              : open_sealed_stream(in.get(), out, *crypt.key, crypt.label);
        });
    } catch (const std::exception& e) {
        throw SnapshotError(step + ": " + name + ": " + e.what());
    }
}

// A streamed keep's pause at the end of what the kernel wrote so far;
// SnapshotError once nobody waits for it or its time is up.
void wait_for_kernel(const SnapshotKeeping& keeping) {
    if (keeping.cancelled.load()) {
        throw SnapshotError(
            "taking the snapshot: abandoned (the save failed or the session ended)");
    }
    if (std::chrono::steady_clock::now() > keeping.deadline) {
        throw SnapshotError("taking the snapshot: the kernel did not finish writing it in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// The kernel's snapshot file, once the kernel made it (a regular file of
// one name, never through a link): a streamed keep begins before the save
// does.
UniqueFd open_when_made(const SnapshotKeeping& keeping) {
    for (;;) {
        // Read first: a file the kernel made before it answered is seen by
        // the try after `written` was read true.
        const bool written = keeping.written.load();
        UniqueFd in(::openat(keeping.output.get(), kSnapshotFile,
                             O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
        struct stat st {};
        if (in && ::fstat(in.get(), &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1) {
            return in;
        }
        if (written) {
            if (!in && errno == ENOENT) {
                throw SnapshotError("taking the snapshot: the kernel left no snapshot file");
            }
            // A link (ELOOP), a directory, a second name of another file.
            throw SnapshotError(std::string("taking the snapshot: ") + kSnapshotFile +
                                " is not a regular file of one name" +
                                (in ? "" : " (" + errno_text(errno) + ")"));
        }
        wait_for_kernel(keeping);
    }
}

// Reads the kernel's snapshot as it grows (a SealSource): a short read only
// once the kernel answered and the file's end is reached.
class GrowingFile {
  public:
    GrowingFile(SnapshotKeeping& keeping, int fd) : keeping_(keeping), fd_(fd) {}
    std::size_t operator()(unsigned char* data, std::size_t n) {
        std::size_t got = 0;
        while (got < n) {
            const ssize_t r = ::read(fd_, data + got, n - got);
            if (r < 0) {
                if (errno == EINTR) continue;
                throw SnapshotError("reading: " + errno_text(errno));
            }
            if (r > 0) {
                got += static_cast<std::size_t>(r);
                took(static_cast<std::uint64_t>(r));
                continue;
            }
            if (at_end_) break;
            // One more read once the kernel answered: what it wrote last.
            if (keeping_.written.load()) {
                at_end_ = true;
                continue;
            }
            wait_for_kernel(keeping_);
        }
        // A whole chunk: the seal adds its tag, and one more chunk follows
        // (the reserve holds the header and the last chunk's tag).
        if (got == n && n == kSealChunk) took(kSealTag);
        return got;
    }

  private:
    void took(std::uint64_t n) {
        if (keeping_.sealed.fetch_add(n) + n > keeping_.room) {
            throw StorageFull("the snapshot would take more than " + megabytes(keeping_.room + 1) +
                              ", " + keeping_.room_bound);
        }
    }

    SnapshotKeeping& keeping_;
    int fd_;
    bool at_end_ = false;
};

// Whether `fd` is the file at the snapshot's name now, `bytes` long: the
// one the kernel answered for.
bool still_the_snapshot(const SnapshotKeeping& keeping, int fd, std::uint64_t bytes) {
    struct stat ours {};
    struct stat named {};
    return ::fstat(fd, &ours) == 0 &&
           ::fstatat(keeping.output.get(), kSnapshotFile, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
           ours.st_dev == named.st_dev && ours.st_ino == named.st_ino &&
           static_cast<std::uint64_t>(ours.st_size) == bytes;
}

// Every regular file and directory under `dir` into `to` (made), links and
// anything else left out; `skip` (a name at the top) too. `crypt.label` is
// the place of `dir` in the snapshot, each file's label its place below.

// Calls visit(name, stat) for each entry of `dir` but ".", ".." and `skip`,
// never through a link; false when `dir` cannot be listed.
template <typename Visit>
bool for_each_entry(int dir, const std::string& skip, Visit&& visit) {
    UniqueFd listing(::dup(dir));
    DIR* d = listing ? ::fdopendir(listing.get()) : nullptr;
    if (!d) return false;
    listing.release();
    struct Closer {
        DIR* d;
        ~Closer() { ::closedir(d); }
    } closer{d};
    ::rewinddir(d);
    while (const dirent* entry = ::readdir(d)) {
        const std::string name = entry->d_name;
        if (name == "." || name == ".." || name == skip) continue;
        struct stat st {};
        if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        visit(name, st);
    }
    return true;
}

UniqueFd open_child_dir(int dir, const std::string& name) {
    return UniqueFd(::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
}

void copy_tree(int dir, const fs::path& to, const std::string& skip, const std::string& step,
               Modes modes, const Crypt& crypt, int depth = 0) {
    if (depth > 64) throw SnapshotError(step + ": directories nested past 64 levels");
    fs::create_directories(to);
    ::chmod(to.c_str(), modes.dir);
    if (modes.uid != static_cast<uid_t>(-1) && ::chown(to.c_str(), modes.uid, modes.gid) != 0) {
        throw SnapshotError(step + ": chown " + to.string() + ": " + errno_text(errno));
    }
    const bool listed =
        for_each_entry(dir, depth == 0 ? skip : "", [&](const std::string& name, const auto& st) {
            Crypt below = crypt;
            below.label += "/" + name;
            if (S_ISREG(st.st_mode)) {
                copy_regular(dir, name, to / name, step, modes, below);
            } else if (S_ISDIR(st.st_mode)) {
                if (UniqueFd child = open_child_dir(dir, name)) {
                    copy_tree(child.get(), to / name, skip, step, modes, below, depth + 1);
                }
            }
        });
    if (!listed) throw SnapshotError(step + ": listing: " + errno_text(errno));
}

// The bytes of the regular files under `dir` (as copy_tree takes them), sealed.
std::uint64_t tree_bytes(int dir, const std::string& skip, int depth = 0) {
    std::uint64_t bytes = 0;
    if (depth > 64) return bytes;
    for_each_entry(dir, depth == 0 ? skip : "", [&](const std::string& name, const auto& st) {
        if (S_ISREG(st.st_mode)) {
            bytes += sealed_size(static_cast<std::uint64_t>(st.st_size));
        } else if (S_ISDIR(st.st_mode)) {
            if (UniqueFd child = open_child_dir(dir, name)) {
                bytes += tree_bytes(child.get(), skip, depth + 1);
            }
        }
    });
    return bytes;
}

double unix_time_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

UniqueFd open_dir(const fs::path& path, const std::string& step) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) throw SnapshotError(step + ": " + path.string() + ": " + errno_text(errno));
    return fd;
}

}  // namespace

SnapshotStore::SnapshotStore(fs::path root, SnapshotCaps caps)
    : root_(std::move(root)), caps_(caps) {
    fs::create_directories(root_);
    fs::permissions(root_, fs::perms::owner_all, fs::perm_options::replace);
}

fs::path SnapshotStore::dir(const std::string& session_id) const {
    if (session_id.empty() || session_id.find('/') != std::string::npos || session_id[0] == '.') {
        throw SnapshotError("no snapshot can be named after session id '" + session_id + "'");
    }
    return root_ / session_id;
}

std::uint64_t SnapshotStore::others_bytes(const std::string& session_id) const {
    std::uint64_t others = 0;
    for (const auto& [id, kept] : kept_) {
        if (id != session_id) others += kept.info.bytes;
    }
    for (const auto& [id, keeping] : keeping_) {
        if (id != session_id) {
            others += keeping->reserved + keeping->sealed.load();
        }
    }
    return others;
}

namespace {

std::uint64_t disk_free(const fs::path& root) {
    struct statvfs vfs {};
    if (::statvfs(root.c_str(), &vfs) != 0) return UINT64_MAX;
    return static_cast<std::uint64_t>(vfs.f_bavail) * static_cast<std::uint64_t>(vfs.f_frsize);
}

}  // namespace

void SnapshotStore::check_caps(const std::string& session_id, std::uint64_t needed) const {
    if (needed > caps_.per_session) {
        throw StorageFull("the snapshot would take " + megabytes(needed) +
                          ", over the per-session cap of " + megabytes(caps_.per_session) +
                          " (serve --snapshot-max-mb)");
    }
    const std::uint64_t others = others_bytes(session_id);
    if (others + needed > caps_.total) {
        throw StorageFull("the snapshot would take " + megabytes(needed) +
                          " and the server's snapshots already hold " + megabytes(others) +
                          " of their cap of " + megabytes(caps_.total) +
                          " (serve --snapshots-max-mb)");
    }
}

void SnapshotStore::check_room(const std::string& session_id, std::uint64_t needed) const {
    check_caps(session_id, needed);
    const std::uint64_t free_bytes = disk_free(root_);
    if (free_bytes != UINT64_MAX && needed + caps_.keep_free > free_bytes) {
        throw StorageFull("the snapshot would take " + megabytes(needed) + " and the disk of " +
                          root_.string() + " has " + megabytes(free_bytes) + " free, " +
                          megabytes(caps_.keep_free) + " of which stay free");
    }
}

std::uint64_t SnapshotStore::room_for(const std::string& session_id, std::string& bound) const {
    std::uint64_t room = caps_.per_session;
    bound = "over the per-session cap of " + megabytes(caps_.per_session) +
            " (serve --snapshot-max-mb)";
    const std::uint64_t others = others_bytes(session_id);
    const std::uint64_t left = caps_.total - std::min(others, caps_.total);
    if (left < room) {
        room = left;
        bound = "and the server's snapshots already hold " + megabytes(others) +
                " of their cap of " + megabytes(caps_.total) + " (serve --snapshots-max-mb)";
    }
    const std::uint64_t free_bytes = disk_free(root_);
    if (free_bytes != UINT64_MAX && free_bytes - std::min(free_bytes, caps_.keep_free) < room) {
        room = free_bytes - std::min(free_bytes, caps_.keep_free);
        bound = "and the disk of " + root_.string() + " had " + megabytes(free_bytes) + " free, " +
                megabytes(caps_.keep_free) + " of which stay free";
    }
    return room;
}

std::uint64_t SnapshotStore::keep(const std::string& session_id, const fs::path& output_dir,
                                  const fs::path& input_dir) {
    const auto keeping = begin_keep(session_id, output_dir, input_dir);
    try {
        keeping->seal();
    } catch (...) {
        abandon(*keeping);
        throw;
    }
    return finish_keep(*keeping);
}

std::shared_ptr<SnapshotKeeping> SnapshotStore::start_keeping(const std::string& session_id,
                                                              const fs::path& output_dir,
                                                              const fs::path& input_dir) {
    if (keeping_.count(session_id)) {
        throw SnapshotError("taking the snapshot: a snapshot of this session is being kept");
    }
    auto keeping = std::make_shared<SnapshotKeeping>();
    keeping->session_id = session_id;
    keeping->to = dir(session_id);
    keeping->output = open_dir(output_dir, "taking the snapshot");
    keeping->input = open_dir(input_dir, "keeping /data/input");
    return keeping;
}

std::shared_ptr<SnapshotKeeping> SnapshotStore::begin_keep(const std::string& session_id,
                                                           const fs::path& output_dir,
                                                           const fs::path& input_dir) {
    auto keeping = start_keeping(session_id, output_dir, input_dir);
    struct stat st {};
    if (::fstatat(keeping->output.get(), kSnapshotFile, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
        throw SnapshotError("taking the snapshot: the kernel left no snapshot file");
    }
    const std::uint64_t needed = sealed_size(static_cast<std::uint64_t>(st.st_size)) +
                                 tree_bytes(keeping->input.get(), kSnapshotFile);
    check_room(session_id, needed);
    remove(session_id);
    keeping->key = std::make_shared<const SnapshotKey>();
    keeping->reserved = needed;
    keeping_[session_id] = keeping;
    return keeping;
}

std::shared_ptr<SnapshotKeeping> SnapshotStore::begin_exact_keep(const std::string& session_id,
                                                                 const fs::path& image_dir,
                                                                 const fs::path& output_dir,
                                                                 const fs::path& input_dir,
                                                                 std::string secrets) {
    auto keeping = start_keeping(session_id, output_dir, input_dir);
    keeping->image = open_dir(image_dir, "keeping the checkpoint");
    struct stat st {};
    if (::fstatat(keeping->image.get(), kCheckpointImage, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
        throw SnapshotError("keeping the checkpoint: the runtime left no image");
    }
    const std::uint64_t needed = sealed_size(static_cast<std::uint64_t>(st.st_size)) +
                                 tree_bytes(keeping->output.get(), "") +
                                 tree_bytes(keeping->input.get(), "") + sealed_size(secrets.size());
    check_room(session_id, needed);
    remove(session_id);
    keeping->key = std::make_shared<const SnapshotKey>();
    keeping->reserved = needed;
    keeping->secrets = std::move(secrets);
    keeping_[session_id] = keeping;
    return keeping;
}

std::shared_ptr<SnapshotKeeping> SnapshotStore::begin_streamed_keep(
    const std::string& session_id, const fs::path& output_dir, const fs::path& input_dir,
    std::chrono::steady_clock::duration wait) {
    auto keeping = start_keeping(session_id, output_dir, input_dir);
    // What is there is a failed save's, or the session's own: never this one.
    ::unlinkat(keeping->output.get(), kSnapshotFile, 0);
    const std::uint64_t inputs = tree_bytes(keeping->input.get(), kSnapshotFile);
    check_room(session_id, inputs + kSealOverhead);
    remove(session_id);
    keeping->key = std::make_shared<const SnapshotKey>();
    keeping->reserved = inputs + kSealOverhead;
    keeping->streamed = true;
    const std::uint64_t room = room_for(session_id, keeping->room_bound);
    keeping->room = room - std::min(room, inputs + kSealOverhead);
    keeping->deadline = std::chrono::steady_clock::now() + wait;
    keeping_[session_id] = keeping;
    return keeping;
}

namespace {

// A streamed keep's snapshot, sealed as the kernel writes it.
void seal_as_written(SnapshotKeeping& keeping, const Crypt& crypt) {
    const UniqueFd in = open_when_made(keeping);
    try {
        keeping.bytes = write_new(keeping.to / "snapshot", kKept, true, [&](int out) {
            return seal_from(GrowingFile(keeping, in.get()), out, *crypt.key, crypt.label);
        });
    } catch (const SnapshotError&) {
        throw;
    } catch (const std::exception& e) {
        throw SnapshotError(std::string("taking the snapshot: ") + e.what());
    }
    if (!still_the_snapshot(keeping, in.get(), keeping.bytes)) {
        // Replaced or resized by the session's own processes meanwhile: what
        // was read may not be what the kernel answered for. Not kept; the
        // session stays awake with everything.
        throw SnapshotError("taking the snapshot: " + std::string(kSnapshotFile) +
                            " was replaced or changed while it was read");
    }
}

// An exact keep's seal (begin_exact_keep): the runtime's image, then
// /data/output and /data/input, then the secrets.
void seal_exact(SnapshotKeeping& keeping, const Crypt& crypt) {
    const std::string& id = keeping.session_id;
    keeping.bytes = copy_regular(keeping.image.get(), kCheckpointImage, keeping.to / "snapshot",
                                 "keeping the checkpoint", kKept, crypt);
    copy_tree(keeping.output.get(), keeping.to / "output", "", "keeping /data/output", kKept,
              {true, keeping.key.get(), id + "/output"});
    copy_tree(keeping.input.get(), keeping.to / "input", "", "keeping /data/input", kKept,
              {true, keeping.key.get(), id + "/input"});
    const std::string sealed = seal(keeping.secrets, *keeping.key, id + "/exact");
    write_new(keeping.to / "exact", kKept, true, [&](int out) {
        std::size_t written = 0;
        while (written < sealed.size()) {
            const ssize_t n = ::write(out, sealed.data() + written, sealed.size() - written);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) throw SnapshotError("keeping the secrets: " + errno_text(errno));
            written += static_cast<std::size_t>(n);
        }
        return static_cast<std::uint64_t>(keeping.secrets.size());
    });
}

}  // namespace

void SnapshotKeeping::seal() {
    try {
        fs::create_directories(to);
        fs::permissions(to, fs::perms::owner_all, fs::perm_options::replace);
        const Crypt crypt{true, key.get(), session_id + "/snapshot"};
        if (image) {
            seal_exact(*this, crypt);
            return;
        }
        if (streamed) {
            seal_as_written(*this, crypt);
        } else {
            bytes = copy_regular(output.get(), kSnapshotFile, to / "snapshot",
                                 "taking the snapshot", kKept, crypt);
        }
        copy_tree(input.get(), to / "input", kSnapshotFile, "keeping /data/input", kKept,
                  {true, key.get(), session_id + "/input"});
        // A streamed keep's file goes with its sandbox, off the way (seal()
        // is timed); a copy fetched from a Swarm task's goes now.
        if (!streamed) ::unlinkat(output.get(), kSnapshotFile, 0);
    } catch (const SnapshotError&) {
        throw;
    } catch (const std::exception& e) {
        throw SnapshotError(std::string("keeping the snapshot: ") + e.what());
    }
}

std::uint64_t SnapshotStore::finish_keep(SnapshotKeeping& keeping) {
    keeping_.erase(keeping.session_id);
    if (removed_while_keeping_.erase(keeping.session_id)) {
        std::error_code ec;
        fs::remove_all(keeping.to, ec);
        throw SnapshotError("keeping the snapshot: the session was removed meanwhile");
    }
    Kept kept;
    kept.key = keeping.key;
    kept.info.kept_at = unix_time_now();
    kept.info.exact = static_cast<bool>(keeping.image);
    std::error_code ec;
    for (const auto& entry : fs::recursive_directory_iterator(keeping.to, ec)) {
        if (entry.is_regular_file(ec)) kept.info.bytes += entry.file_size(ec);
    }
    if (keeping.streamed) {
        // Its room was what the others left at its start; they kept since.
        try {
            check_caps(keeping.session_id, kept.info.bytes);
        } catch (const StorageFull&) {
            fs::remove_all(keeping.to, ec);
            throw;
        }
    }
    kept_[keeping.session_id] = std::move(kept);
    return keeping.bytes;
}

void SnapshotStore::abandon_unfinished() {
    std::error_code ec;
    for (const auto& [id, keeping] : keeping_) fs::remove_all(dir(id), ec);
    keeping_.clear();
    removed_while_keeping_.clear();
}

void SnapshotStore::abandon(SnapshotKeeping& keeping) {
    // The session stays awake: no snapshot of its own left in its files.
    if (keeping.streamed) ::unlinkat(keeping.output.get(), kSnapshotFile, 0);
    keeping_.erase(keeping.session_id);
    removed_while_keeping_.erase(keeping.session_id);
    std::error_code ec;
    fs::remove_all(keeping.to, ec);
}

std::string why_not_kept(const std::exception& error) {
    if (dynamic_cast<const StorageFull*>(&error)) {
        return std::string(ename::StorageFull) + ": " + error.what();
    }
    return error.what();
}

void log_kept(const std::string& session_id, std::uint64_t bytes, const nlohmann::json& report,
              double ms) {
    spdlog::info("session {}: snapshot kept ({} bytes, {} value(s), {} lost), sealed in {:.0f} ms",
                 session_id, bytes, report.value("saved", 0),
                 report.value("lost", nlohmann::json::array()).size(), ms);
}

bool SnapshotStore::keep_from(const std::string& session_id, const fs::path& output_dir,
                              const fs::path& input_dir, const nlohmann::json& report,
                              std::string& why) {
    try {
        const auto started = std::chrono::steady_clock::now();
        const std::uint64_t bytes = keep(session_id, output_dir, input_dir);
        log_kept(
            session_id, bytes, report,
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
                .count());
        return true;
    } catch (const std::exception& e) {
        why = why_not_kept(e);
    }
    return false;
}

void SnapshotStore::place(const std::string& session_id, const fs::path& input_dir) const {
    begin_place(session_id, input_dir)->open();
}

std::unique_ptr<SnapshotPlacing> SnapshotStore::begin_place(const std::string& session_id,
                                                            const fs::path& input_dir) const {
    const auto kept = kept_.find(session_id);
    if (kept == kept_.end()) {
        throw SnapshotError("placing the snapshot: this server holds no key for session " +
                            session_id + "'s snapshot");
    }
    auto placing = std::make_unique<SnapshotPlacing>();
    placing->session_id = session_id;
    placing->key = kept->second.key;
    placing->to = input_dir;
    const fs::path from = dir(session_id);
    placing->from = open_dir(from, "placing the snapshot");
    placing->input = open_dir(from / "input", "placing /data/input");
    return placing;
}

std::unique_ptr<SnapshotPlacing> SnapshotStore::begin_exact_place(const std::string& session_id,
                                                                  const fs::path& image_dir,
                                                                  const fs::path& output_dir,
                                                                  const fs::path& input_dir,
                                                                  uid_t uid, gid_t gid) const {
    const auto kept = kept_.find(session_id);
    if (kept == kept_.end() || !kept->second.info.exact) {
        throw SnapshotError(
            "placing the checkpoint: this server holds no exact snapshot of session " + session_id);
    }
    auto placing = begin_place(session_id, input_dir);
    placing->image_to = image_dir;
    placing->output_to = output_dir;
    placing->output_uid = uid;
    placing->output_gid = gid;
    return placing;
}

std::string SnapshotPlacing::secrets() const {
    const std::string step = "placing the checkpoint's secrets";
    const UniqueFd in = open_regular(from.get(), "exact", step);
    std::string sealed;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(in.get(), buf, sizeof buf)) > 0)
        sealed.append(buf, static_cast<std::size_t>(n));
    if (n < 0) throw SnapshotError(step + ": " + errno_text(errno));
    try {
        return open_sealed(sealed, *key, session_id + "/exact");
    } catch (const std::exception& e) {
        throw SnapshotError(step + ": " + e.what());
    }
}

std::optional<std::uint64_t> SnapshotPlacing::follow() {
    const std::string step = "placing the snapshot";
    UniqueFd in = open_regular(from.get(), "snapshot", step);
    std::optional<std::uint64_t> size;
    try {
        size = followable_plain_size(in.get());
        if (!size) return std::nullopt;
        placed = make_new(to / kSnapshotFile, kPlaced);
    } catch (const std::exception& e) {
        throw SnapshotError(step + ": snapshot: " + e.what());
    }
    sealed = std::move(in);
    return size;
}

void SnapshotPlacing::open() const {
    try {
        const auto started = std::chrono::steady_clock::now();
        std::uint64_t bytes = 0;
        if (!image_to.empty()) {
            // Exact: the runtime reads the image from the server's dir; the
            // output files go back to the sandbox's user.
            bytes = copy_regular(from.get(), "snapshot", image_to / kCheckpointImage,
                                 "placing the checkpoint", kKept,
                                 {false, key.get(), session_id + "/snapshot"});
            const UniqueFd output = open_child_dir(from.get(), "output");
            if (!output) throw SnapshotError("placing /data/output: " + errno_text(errno));
            copy_tree(output.get(), output_to, "", "placing /data/output",
                      {0644, 0755, output_uid, output_gid},
                      {false, key.get(), session_id + "/output"});
        } else if (placed) {
            // Followed: the kernel waits on these bytes, the input files after.
            try {
                bytes =
                    open_sealed_stream(sealed.get(), placed.get(), *key, session_id + "/snapshot");
            } catch (const std::exception& e) {
                throw SnapshotError(std::string("placing the snapshot: snapshot: ") + e.what());
            }
        }
        copy_tree(input.get(), to, "", "placing /data/input", kPlaced,
                  {false, key.get(), session_id + "/input"});
        if (!placed && image_to.empty()) {
            bytes = copy_regular(from.get(), "snapshot", to / kSnapshotFile, "placing the snapshot",
                                 kPlaced, {false, key.get(), session_id + "/snapshot"});
        }
        spdlog::info(
            "session {}: snapshot opened into its new sandbox ({} bytes) in {:.0f} ms", session_id,
            bytes,
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
                .count());
    } catch (const SnapshotError&) {
        throw;
    } catch (const std::exception& e) {
        throw SnapshotError(std::string("placing the snapshot: ") + e.what());
    }
}

void SnapshotStore::remove(const std::string& session_id) {
    kept_.erase(session_id);
    if (keeping_.count(session_id)) {
        // Being written on another thread: its files go when it ends.
        removed_while_keeping_.insert(session_id);
        return;
    }
    std::error_code ec;
    fs::remove_all(dir(session_id), ec);
}

std::optional<fs::path> SnapshotStore::remove_later(const std::string& session_id) {
    kept_.erase(session_id);
    if (keeping_.count(session_id)) {
        removed_while_keeping_.insert(session_id);
        return std::nullopt;
    }
    const fs::path from = dir(session_id);
    const fs::path gone = root_ / (".removed-" + session_id + "-" + std::to_string(++removed_));
    std::error_code ec;
    fs::rename(from, gone, ec);
    if (ec) {
        fs::remove_all(from, ec);  // gone already, or not renamable: here and now
        return std::nullopt;
    }
    return gone;
}

void SnapshotStore::clear(const std::set<std::string>& except) {
    std::error_code ec;
    for (const auto& left : fs::directory_iterator(root_, ec)) {
        if (!except.count(left.path().filename().string())) fs::remove_all(left.path(), ec);
    }
    for (auto it = kept_.begin(); it != kept_.end();) {
        it = except.count(it->first) ? std::next(it) : kept_.erase(it);
    }
}

std::string SnapshotStore::key_bytes(const std::string& session_id) const {
    const auto kept = kept_.find(session_id);
    if (kept == kept_.end()) throw SnapshotError("no snapshot of session " + session_id);
    return std::string(reinterpret_cast<const char*>(kept->second.key->bytes()),
                       SnapshotKey::kBytes);
}

void SnapshotStore::adopt(const std::string& session_id, std::string_view key, SnapshotInfo info) {
    struct stat st {};
    const fs::path file = dir(session_id) / "snapshot";
    if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw SnapshotError("the snapshot " + file.string() + " is missing");
    }
    Kept kept;
    kept.key = std::make_shared<const SnapshotKey>(key);
    kept.info = info;
    kept.info.exact = ::lstat((dir(session_id) / "exact").c_str(), &st) == 0;
    kept_[session_id] = std::move(kept);
}

bool SnapshotStore::holds(const std::string& session_id) const {
    return kept_.count(session_id) > 0;
}

std::uint64_t SnapshotStore::bytes(const std::string& session_id) const {
    const auto info = this->info(session_id);
    return info ? info->bytes : 0;
}

std::optional<SnapshotInfo> SnapshotStore::info(const std::string& session_id) const {
    const auto kept = kept_.find(session_id);
    if (kept == kept_.end()) return std::nullopt;
    return kept->second.info;
}

std::uint64_t SnapshotStore::total_bytes() const {
    std::uint64_t total = 0;
    for (const auto& entry : kept_) total += entry.second.info.bytes;
    return total;
}

}  // namespace cellblock
