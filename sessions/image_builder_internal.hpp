// What image_builder.cpp, image_store.cpp, image_files.cpp and
// build_process.cpp share: the build's signals and child processes, the
// store's temp dirs and lock, and the file operations on a root. Private to
// sessions/.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iomanip>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "cellblock/oci_bundle.hpp"

#include "cellblock/errno_text.hpp"
#include "cellblock/image.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock::image_detail {
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string read_file_bytes(const fs::path& path);

void write_file_bytes(const fs::path& path, const std::string& data, mode_t mode);

double unix_now();

// Signals (build_process.cpp).
// A build stops at SIGINT, SIGTERM or SIGHUP: the child is told, killed with
// its process group if it still runs kStopGrace later, the temp dir removed.
inline constexpr std::chrono::seconds kStopGrace{10};
extern std::atomic<int> g_stop_signal;
extern "C" void on_stop_signal(int sig);

class StopSignals {
  public:
    StopSignals() {
        g_stop_signal.store(0);
        struct sigaction sa {};
        sa.sa_handler = on_stop_signal;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = 0;  // no SA_RESTART: a blocking read returns EINTR
        for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
    }
    ~StopSignals() {
        for (std::size_t i = 0; i < kSignals.size(); ++i)
            ::sigaction(kSignals[i], &old_[i], nullptr);
    }
    StopSignals(const StopSignals&) = delete;
    StopSignals& operator=(const StopSignals&) = delete;

  private:
    static constexpr std::array<int, 3> kSignals{SIGINT, SIGTERM, SIGHUP};
    std::array<struct sigaction, 3> old_{};
};

void check_stop(const std::string& step);

// Processes (build_process.cpp).
struct Finished {
    int exit_code = -1;
    std::string output;  // all of it when captured; the last lines when streamed
};

// Runs argv (optionally chrooted into `root`) with stdin from /dev/null and a
// small fixed environment. Its output is captured, or, with `progress`,
// streamed there line by line (prefixed with the elapsed time) and its last
// 40 lines kept. A stop signal is passed on to the child as SIGTERM.
Finished run_child(const std::vector<std::string>& argv, std::ostream* progress,
                   const std::vector<std::string>& env_list, const fs::path& root = {},
                   Clock::time_point started = Clock::now());

const std::vector<std::string>& tool_env();

// Files (image_files.cpp).
// Unmounts everything at or below `dir` (deepest first), then removes it: a
// build killed mid-way may leave mmdebstrap's /proc, /sys or /dev binds in
// its root, and removing through a bind of /dev would reach the host's.
void remove_tree(const fs::path& dir);

// The temp dir of a build: removed unless the build moved it into place.
class TempDir {
  public:
    explicit TempDir(fs::path path) : path_(std::move(path)) {}
    ~TempDir() {
        if (path_.empty()) return;
        try {
            remove_tree(path_);
        } catch (...) {
        }
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const fs::path& path() const { return path_; }
    void release() { path_.clear(); }

  private:
    fs::path path_;
};

// An exclusive lock on the store's lock file, for moving names and versions.
class StoreLock {
  public:
    explicit StoreLock(const fs::path& root)
        : fd_(::open((root / "lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600)) {
        if (!fd_ || ::flock(fd_.get(), LOCK_EX) != 0) {
            throw std::runtime_error("image store lock " + (root / "lock").string() + ": " +
                                     errno_text());
        }
    }

  private:
    UniqueFd fd_;  // the lock is released when it closes
};

void make_store_dirs(const ImageStore& store);

// Bytes of the regular files under `dir`, each hard-linked file once.
std::uint64_t tree_size(const fs::path& dir);

// What seal_root changed, for the progress output.
struct Sealed {
    std::size_t device_nodes = 0;  // removed
    std::size_t set_id_files = 0;  // setuid/setgid cleared
};

// Takes every write bit away (but from `keep`, the image's /tmp: it keeps
// 1777, as a tmpfs is mounted there with its mount point's mode), and takes
// out what a session must never find in a root: device nodes (a tarball can
// carry any major:minor, and the sandbox's root is not mounted nodev; the
// sandbox gets its own /dev) and setuid/setgid bits (no_new_privs already
// ignores them). Symlinks are never followed.
Sealed seal_root(const fs::path& dir, const fs::path& keep);

std::ostream& operator<<(std::ostream& out, const Sealed& sealed);

std::string format_size(std::uint64_t bytes);

fs::path make_temp_dir(const ImageStore& store, const std::string& name);

StoredImage read_stored(const fs::path& dir);

// The installed packages of a root, "name:arch=version", sorted.
std::vector<std::string> installed_packages(const fs::path& root);

// Each component of `rel` under `root` a real directory. An imported root is
// hostile: a symlink there (`./etc -> /etc`) would send every later write
// under it to the host, so a symlink, file or node in the way is removed and
// a directory made in its place. Nothing under `root` is written through a
// path before this has run on it.
void make_real_dirs(const fs::path& root, const fs::path& rel);

// Whether every component of `rel` under `root` exists and none is a symlink.
bool reached_without_symlinks(const fs::path& root, const fs::path& rel);

// Mount points, a generated /etc/passwd, group, hosts, hostname and
// nsswitch.conf (as for the host image), an empty resolv.conf and a 1777 /tmp.
// Every directory this writes into is made real first (make_real_dirs).
void prepare_stored_root(const Image& image, const fs::path& root);

// The check binds the host's /dev/null over the image's (Python opens it at
// start): a sealed root has none (seal_root removes device nodes), so an
// empty file stands in as the mount point. The root's /dev must be a real
// directory; a symlink there would point the bind outside the root.
void dev_null_mount_point(const fs::path& root);

// The kernel's interpreter imports ipykernel and the preload modules in the
// new root: a definition without python3-ipykernel fails here, not in a session.
void check_kernel(const Image& image, const fs::path& root, std::ostream& progress);

// Moves a finished temp dir into the store under its content id (unless that
// version is there already) and points the name at it.
StoredImage commit_version(const ImageStore& store, TempDir& tmp, const std::string& name,
                           const std::string& id, std::ostream& progress);

std::vector<std::string> mmdebstrap_argv(const BuildSpec& spec, const fs::path& rootfs,
                                         const fs::path& cache);

json stored_definition(const Image& image);

}  // namespace cellblock::image_detail
