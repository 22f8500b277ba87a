#include "session_snapshots.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

std::string errno_text(int err) { return std::strerror(err); }

// A regular file at `name` under `dir` (never through a link, never a FIFO
// that would block) copied to `to`, a new file; returns its size.
std::uint64_t copy_regular(int dir, const std::string& name, const fs::path& to,
                           const std::string& step, mode_t mode) {
    UniqueFd in(::openat(dir, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!in) throw SnapshotError(step + ": " + name + ": " + errno_text(errno));
    struct stat st {};
    if (::fstat(in.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw SnapshotError(step + ": " + name + " is not a regular file");
    }
    UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) throw SnapshotError(step + ": " + to.string() + ": " + errno_text(errno));
    if (::fchmod(out.get(), mode) != 0) throw SnapshotError(step + ": chmod: " + errno_text(errno));
    std::uint64_t copied = 0;
    for (;;) {
        const ssize_t n = ::copy_file_range(in.get(), nullptr, out.get(), nullptr, 1 << 30, 0);
        if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL) && copied == 0) {
            char buffer[1 << 16];
            for (;;) {
                const ssize_t r = ::read(in.get(), buffer, sizeof buffer);
                if (r < 0)
                    throw SnapshotError(step + ": reading " + name + ": " + errno_text(errno));
                if (r == 0) break;
                for (ssize_t off = 0; off < r;) {
                    const ssize_t w =
                        ::write(out.get(), buffer + off, static_cast<size_t>(r - off));
                    if (w < 0) throw SnapshotError(step + ": writing: " + errno_text(errno));
                    off += w;
                }
                copied += static_cast<std::uint64_t>(r);
            }
            break;
        }
        if (n < 0) throw SnapshotError(step + ": copying " + name + ": " + errno_text(errno));
        if (n == 0) break;
        copied += static_cast<std::uint64_t>(n);
    }
    if (::fsync(out.get()) != 0) throw SnapshotError(step + ": fsync: " + errno_text(errno));
    return copied;
}

// Every regular file and directory under `dir` into `to` (made), links and
// anything else left out; `skip` (a name at the top) too.
// Kept in the store: the server's alone (0600, 0700). Placed in a sandbox's
// input dir: readable by the sandbox's user, as uploads are (0644, 0755).
struct Modes {
    mode_t file, dir;
};
constexpr Modes kKept{0600, 0700}, kPlaced{0644, 0755};

void copy_tree(int dir, const fs::path& to, const std::string& skip, const std::string& step,
               Modes modes, int depth = 0) {
    if (depth > 64) throw SnapshotError(step + ": directories nested past 64 levels");
    fs::create_directories(to);
    ::chmod(to.c_str(), modes.dir);
    UniqueFd listing(::dup(dir));
    DIR* d = listing ? ::fdopendir(listing.get()) : nullptr;
    if (!d) throw SnapshotError(step + ": listing: " + errno_text(errno));
    listing.release();
    struct Closer {
        DIR* d;
        ~Closer() { ::closedir(d); }
    } closer{d};
    ::rewinddir(d);
    while (const dirent* entry = ::readdir(d)) {
        const std::string name = entry->d_name;
        if (name == "." || name == ".." || (depth == 0 && name == skip)) continue;
        struct stat st {};
        if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        if (S_ISREG(st.st_mode)) {
            copy_regular(dir, name, to / name, step, modes.file);
        } else if (S_ISDIR(st.st_mode)) {
            UniqueFd child(
                ::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
            if (child) copy_tree(child.get(), to / name, skip, step, modes, depth + 1);
        }
    }
}

UniqueFd open_dir(const fs::path& path, const std::string& step) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) throw SnapshotError(step + ": " + path.string() + ": " + errno_text(errno));
    return fd;
}

}  // namespace

SnapshotStore::SnapshotStore(fs::path root) : root_(std::move(root)) {
    fs::create_directories(root_);
    fs::permissions(root_, fs::perms::owner_all, fs::perm_options::replace);
}

fs::path SnapshotStore::dir(const std::string& session_id) const {
    if (session_id.empty() || session_id.find('/') != std::string::npos || session_id[0] == '.') {
        throw SnapshotError("no snapshot can be named after session id '" + session_id + "'");
    }
    return root_ / session_id;
}

std::uint64_t SnapshotStore::keep(const std::string& session_id, const fs::path& output_dir,
                                  const fs::path& input_dir) {
    const fs::path to = dir(session_id);
    std::error_code ec;
    fs::remove_all(to, ec);
    try {
        fs::create_directories(to);
        fs::permissions(to, fs::perms::owner_all, fs::perm_options::replace);
        const UniqueFd output = open_dir(output_dir, "taking the snapshot");
        const std::uint64_t bytes = copy_regular(output.get(), kSnapshotFile, to / "snapshot",
                                                 "taking the snapshot", kKept.file);
        const UniqueFd input = open_dir(input_dir, "keeping /data/input");
        copy_tree(input.get(), to / "input", kSnapshotFile, "keeping /data/input", kKept);
        ::unlinkat(output.get(), kSnapshotFile, 0);
        return bytes;
    } catch (...) {
        fs::remove_all(to, ec);
        throw;
    }
}

void SnapshotStore::place(const std::string& session_id, const fs::path& input_dir) const {
    const fs::path from = dir(session_id);
    const UniqueFd kept = open_dir(from, "placing the snapshot");
    const UniqueFd input = open_dir(from / "input", "placing /data/input");
    copy_tree(input.get(), input_dir, "", "placing /data/input", kPlaced);
    copy_regular(kept.get(), "snapshot", input_dir / kSnapshotFile, "placing the snapshot",
                 kPlaced.file);
}

void SnapshotStore::remove(const std::string& session_id) const {
    std::error_code ec;
    fs::remove_all(dir(session_id), ec);
}

bool SnapshotStore::holds(const std::string& session_id) const {
    std::error_code ec;
    return fs::is_regular_file(dir(session_id) / "snapshot", ec);
}

std::uint64_t SnapshotStore::bytes(const std::string& session_id) const {
    std::error_code ec;
    const auto n = fs::file_size(dir(session_id) / "snapshot", ec);
    return ec ? 0 : n;
}

}  // namespace cellblock
