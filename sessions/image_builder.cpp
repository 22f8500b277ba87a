#include "cellblock/image_builder.hpp"

#include <fcntl.h>
#include <grp.h>
#include <openssl/evp.h>
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
#include <set>
#include <sstream>

#include "cellblock/oci_bundle.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

std::string read_file_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    return {std::istreambuf_iterator<char>(in), {}};
}

void write_file_bytes(const fs::path& path, const std::string& data, mode_t mode) {
    // A symlink the packages left at that path is replaced, never followed.
    std::error_code ec;
    fs::remove(path, ec);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0) throw std::runtime_error("write " + path.string() + ": " + errno_text());
    std::size_t done = 0;
    while (done < data.size()) {
        const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const std::string why = errno_text();
            ::close(fd);
            throw std::runtime_error("write " + path.string() + ": " + why);
        }
        done += static_cast<std::size_t>(n);
    }
    ::fchmod(fd, mode);
    ::close(fd);
}

double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// ------------------------------------------------------------------ signals

// A build stops at SIGINT, SIGTERM or SIGHUP: the child is told, the temp dir removed.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

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

void check_stop(const std::string& step) {
    if (const int sig = g_stop_signal.load()) {
        throw std::runtime_error(step + ": stopped by signal " + std::to_string(sig) + " (" +
                                 strsignal(sig) + ")");
    }
}

// ------------------------------------------------------------------ processes

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
                   Clock::time_point started = Clock::now()) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe: " + errno_text());
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::vector<char*> env;
    for (const auto& e : env_list) env.push_back(const_cast<char*>(e.c_str()));
    env.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork: " + errno_text());
    if (pid == 0) {
        const int devnull = ::open("/dev/null", O_RDONLY);
        ::dup2(devnull, STDIN_FILENO);
        ::dup2(pipe_fds[1], STDOUT_FILENO);
        ::dup2(pipe_fds[1], STDERR_FILENO);
        if (!root.empty()) {
            // The image's own code (an imported root is not trusted): in its
            // own mount, network (empty) and IPC namespaces, its root bound
            // read-only, nodev and nosuid (a tarball may carry device nodes
            // and setuid files, and the code must not plant symlinks for the
            // steps after it), a private tmpfs on its /tmp, the host's
            // /dev/null over the image's, confined to the root, as nobody,
            // never gaining privileges again.
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            const std::string dev_null = (root / "dev" / "null").string();
            const std::string tmp = (root / "tmp").string();
            struct stat st {};
            if (::unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC) != 0 ||
                ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
                ::mount(root.c_str(), root.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0 ||
                ::mount(nullptr, root.c_str(), nullptr,
                        MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NODEV | MS_NOSUID, nullptr) != 0 ||
                ::lstat(tmp.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
                ::mount("tmpfs", tmp.c_str(), "tmpfs", MS_NODEV | MS_NOSUID,
                        "size=268435456,mode=1777") != 0)
                _exit(126);
            if (::lstat(dev_null.c_str(), &st) == 0 && !S_ISLNK(st.st_mode))
                ::mount("/dev/null", dev_null.c_str(), nullptr, MS_BIND, nullptr);
            const rlimit nproc{256, 256};
            if (::chroot(root.c_str()) != 0 || ::chdir("/") != 0 || ::setgroups(0, nullptr) != 0 ||
                ::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0 ||
                ::setrlimit(RLIMIT_NPROC, &nproc) != 0 ||
                ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
                _exit(126);
        }
        ::execvpe(args[0], args.data(), env.data());
        _exit(127);
    }
    ::close(pipe_fds[1]);
    Finished result;
    std::deque<std::string> tail;
    std::string pending;
    bool told = false;
    char buf[4096];
    for (;;) {
        if (g_stop_signal.load() && !told) {
            ::kill(pid, SIGTERM);
            told = true;
        }
        const ssize_t n = ::read(pipe_fds[0], buf, sizeof buf);
        if (n == 0) break;
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (!progress) {
            result.output.append(buf, static_cast<std::size_t>(n));
            continue;
        }
        pending.append(buf, static_cast<std::size_t>(n));
        std::size_t nl;
        while ((nl = pending.find_first_of("\r\n")) != std::string::npos) {
            std::string line = pending.substr(0, nl);
            pending.erase(0, nl + 1);
            if (line.empty()) continue;
            const double secs = std::chrono::duration<double>(Clock::now() - started).count();
            *progress << "  [" << std::fixed << std::setprecision(1) << std::setw(6) << secs
                      << " s] " << line << "\n"
                      << std::flush;
            tail.push_back(std::move(line));
            if (tail.size() > 40) tail.pop_front();
        }
    }
    ::close(pipe_fds[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        if (g_stop_signal.load() && !told) {
            ::kill(pid, SIGTERM);
            told = true;
        }
    }
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (progress) {
        if (!pending.empty()) tail.push_back(pending);
        for (const auto& line : tail) result.output += line + "\n";
    }
    return result;
}

const std::vector<std::string>& tool_env() {
    static const std::vector<std::string> env{
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8",
        "DEBIAN_FRONTEND=noninteractive"};
    return env;
}

// ------------------------------------------------------------------ files

// Unmounts everything at or below `dir` (deepest first), then removes it: a
// build killed mid-way may leave mmdebstrap's /proc, /sys or /dev binds in
// its root, and removing through a bind of /dev would reach the host's.
void remove_tree(const fs::path& dir) {
    const std::string prefix = dir.string();
    std::vector<std::string> mounts;
    {
        std::ifstream info("/proc/self/mountinfo");
        std::string line;
        while (std::getline(info, line)) {
            std::istringstream ss(line);
            std::string id, parent, devs, root, point;
            ss >> id >> parent >> devs >> root >> point;
            if (point == prefix || point.rfind(prefix + "/", 0) == 0) mounts.push_back(point);
        }
    }
    std::sort(mounts.begin(), mounts.end(),
              [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
    for (const auto& point : mounts) ::umount2(point.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) throw std::runtime_error("remove " + dir.string() + ": " + ec.message());
}

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
    explicit StoreLock(const fs::path& root) {
        fd_ = ::open((root / "lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
        if (fd_ < 0 || ::flock(fd_, LOCK_EX) != 0) {
            throw std::runtime_error("image store lock " + (root / "lock").string() + ": " +
                                     errno_text());
        }
    }
    ~StoreLock() {
        if (fd_ >= 0) ::close(fd_);
    }
    StoreLock(const StoreLock&) = delete;
    StoreLock& operator=(const StoreLock&) = delete;

  private:
    int fd_ = -1;
};

void make_store_dirs(const ImageStore& store) {
    for (const char* sub : {"", "store", "names", "tmp", "cache", "cache/apt"}) {
        const fs::path dir = store.root() / sub;
        std::error_code ec;
        fs::create_directories(dir, ec);
        if (ec) throw std::runtime_error("mkdir " + dir.string() + ": " + ec.message());
    }
    // The sandbox's mapped root must reach store/<id>/rootfs; nothing else.
    ::chmod(store.root().c_str(), 0711);
    ::chmod((store.root() / "store").c_str(), 0711);
    ::chmod((store.root() / "names").c_str(), 0755);
    ::chmod((store.root() / "tmp").c_str(), 0700);
    ::chmod((store.root() / "cache").c_str(), 0700);
}

// Bytes of the regular files under `dir`, each hard-linked file once.
std::uint64_t tree_size(const fs::path& dir) {
    std::uint64_t total = 0;
    std::set<std::pair<dev_t, ino_t>> seen;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        struct stat st {};
        if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (st.st_nlink > 1 && !seen.insert({st.st_dev, st.st_ino}).second) continue;
        total += static_cast<std::uint64_t>(st.st_size);
    }
    return total;
}

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
Sealed seal_root(const fs::path& dir, const fs::path& keep) {
    std::error_code ec;
    std::vector<fs::path> paths{dir};
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        paths.push_back(it->path());
    }
    if (ec) throw std::runtime_error("walk " + dir.string() + ": " + ec.message());
    Sealed sealed;
    for (const auto& path : paths) {
        struct stat st {};
        if (::lstat(path.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) continue;
        if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) {
            if (::unlink(path.c_str()) != 0) {
                throw std::runtime_error("remove device node " + path.string() + ": " +
                                         errno_text());
            }
            ++sealed.device_nodes;
            continue;
        }
        mode_t mode = st.st_mode & 07777;
        if (mode & (S_ISUID | S_ISGID)) ++sealed.set_id_files;
        mode &= ~static_cast<mode_t>(S_ISUID | S_ISGID);
        if (path != keep) mode &= ~static_cast<mode_t>(0222);
        if (mode != (st.st_mode & 07777) && ::chmod(path.c_str(), mode) != 0) {
            throw std::runtime_error("chmod " + path.string() + ": " + errno_text());
        }
    }
    return sealed;
}

std::ostream& operator<<(std::ostream& out, const Sealed& sealed) {
    return out << "  sealed read-only: " << sealed.device_nodes << " device node(s) removed, "
               << sealed.set_id_files << " setuid/setgid bit(s) cleared\n";
}

std::string format_size(std::uint64_t bytes) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MB";
    return out.str();
}

fs::path make_temp_dir(const ImageStore& store, const std::string& name) {
    std::string templ =
        (store.root() / "tmp" / (std::to_string(::getpid()) + "." + name + ".XXXXXX")).string();
    if (!::mkdtemp(templ.data()))
        throw std::runtime_error("mkdtemp " + templ + ": " + errno_text());
    ::chmod(templ.c_str(), 0755);
    return templ;
}

StoredImage read_stored(const fs::path& dir) {
    StoredImage s;
    s.dir = dir;
    std::ifstream in(dir / "manifest.json");
    json m = json::parse(in, nullptr, false);
    if (m.is_discarded() || !m.is_object()) {
        throw std::runtime_error("image store: " + (dir / "manifest.json").string() +
                                 " is missing or not JSON");
    }
    s.manifest = m;
    s.name = m.value("name", "");
    s.content_id = m.value("content_id", "");
    return s;
}

// The installed packages of a root, "name:arch=version", sorted.
std::vector<std::string> installed_packages(const fs::path& root) {
    const Finished r =
        run_child({"dpkg-query", "--admindir=" + (root / "var/lib/dpkg").string(), "-W",
                   "-f=${db:Status-Abbrev}${Package}:${Architecture}=${Version}\\n"},
                  nullptr, tool_env());
    if (r.exit_code != 0)
        throw std::runtime_error("dpkg-query in " + root.string() + ": " + r.output);
    std::vector<std::string> out;
    std::istringstream lines(r.output);
    std::string line;
    while (std::getline(lines, line)) {
        if (line.rfind("ii ", 0) == 0) out.push_back(line.substr(3));
    }
    std::sort(out.begin(), out.end());
    return out;
}

// Each component of `rel` under `root` a real directory. An imported root is
// hostile: a symlink there (`./etc -> /etc`) would send every later write
// under it to the host, so a symlink, file or node in the way is removed and
// a directory made in its place. Nothing under `root` is written through a
// path before this has run on it.
void make_real_dirs(const fs::path& root, const fs::path& rel) {
    fs::path at = root;
    for (const auto& part : rel.relative_path()) {
        if (part.empty() || part == "." || part == "..") {
            throw std::runtime_error("image root: bad path " + rel.string());
        }
        at /= part;
        struct stat st {};
        if (::lstat(at.c_str(), &st) == 0) {
            if (S_ISDIR(st.st_mode)) continue;
            if (::unlink(at.c_str()) != 0) {
                throw std::runtime_error("image root: remove " + at.string() + ": " + errno_text());
            }
        } else if (errno != ENOENT) {
            throw std::runtime_error("image root: " + at.string() + ": " + errno_text());
        }
        if (::mkdir(at.c_str(), 0755) != 0) {
            throw std::runtime_error("image root: mkdir " + at.string() + ": " + errno_text());
        }
    }
}

// Whether every component of `rel` under `root` exists and none is a symlink.
bool reached_without_symlinks(const fs::path& root, const fs::path& rel) {
    fs::path at = root;
    for (const auto& part : rel.relative_path()) {
        at /= part;
        struct stat st {};
        if (::lstat(at.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) return false;
    }
    return true;
}

// Mount points, a generated /etc/passwd, group, hosts, hostname and
// nsswitch.conf (as for the host image), an empty resolv.conf and a 1777 /tmp.
// Every directory this writes into is made real first (make_real_dirs).
void prepare_stored_root(const Image& image, const fs::path& root) {
    SandboxSpec spec;
    spec.image = image;
    spec.image.rootfs = root.string();
    spec.rootfs = root;
    spec.ipc_dir = spec.input_dir = spec.output_dir = spec.libexec_dir = "/nonexistent";
    const json config = make_oci_config(spec);
    for (const char* dir :
         {"usr", "etc", "proc", "dev", "dev/shm", "sys", "run", "opt", "data", "tmp", "home"}) {
        make_real_dirs(root, dir);
    }
    for (const auto& mount : config.at("mounts")) {
        const fs::path destination = mount.at("destination").get<std::string>();
        make_real_dirs(root, destination.parent_path());
        struct stat st {};
        const fs::path target = root / destination.relative_path();
        if (::lstat(target.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) ::unlink(target.c_str());
    }
    for (const char* file : {"etc/passwd", "etc/group", "etc/hosts", "etc/hostname",
                             "etc/nsswitch.conf", "etc/resolv.conf"}) {
        std::error_code ec;
        fs::remove(root / file, ec);  // a symlink is replaced, never followed
    }
    prepare_host_rootfs(spec, config);
    write_file_bytes(root / "etc/resolv.conf", "", 0644);
    // Whatever the packages left in /tmp (remove_all does not follow symlinks).
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root / "tmp", ec)) fs::remove_all(entry, ec);
    ::chmod((root / "tmp").c_str(), 01777);
}

// The check binds the host's /dev/null over the image's (Python opens it at
// start): a sealed root has none (seal_root removes device nodes), so an
// empty file stands in as the mount point. The root's /dev must be a real
// directory; a symlink there would point the bind outside the root.
void dev_null_mount_point(const fs::path& root) {
    struct stat st {};
    if (::lstat((root / "dev").c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw std::runtime_error("check kernel: the image's /dev is not a directory");
    }
    const fs::path null = root / "dev" / "null";
    if (::lstat(null.c_str(), &st) == 0) {
        if (S_ISREG(st.st_mode) || S_ISCHR(st.st_mode)) return;
        throw std::runtime_error(
            "check kernel: the image's /dev/null is neither a file nor a "
            "device node");
    }
    write_file_bytes(null, "", 0644);
}

// The kernel's interpreter imports ipykernel and the preload modules in the
// new root: a definition without python3-ipykernel fails here, not in a session.
void check_kernel(const Image& image, const fs::path& root, std::ostream& progress) {
    const std::string& interpreter = image.kernel_argv.at(0);
    struct stat st {};
    if (::lstat((root / interpreter.substr(interpreter[0] == '/' ? 1 : 0)).c_str(), &st) != 0) {
        throw std::runtime_error("check kernel: " + interpreter +
                                 " does not exist in the image (is it in the packages?)");
    }
    const bool python_launcher = std::any_of(
        image.kernel_argv.begin(), image.kernel_argv.end(),
        [](const std::string& a) { return a.find("cellblock_ipykernel.py") != std::string::npos; });
    if (!python_launcher) return;
    dev_null_mount_point(root);
    std::string code = "import ipykernel.kernelapp";
    for (const auto& module : image.preload) code += "; import " + module;
    progress << "checking the kernel: " << interpreter << " -c '" << code << "'\n" << std::flush;
    const Finished r = run_child({interpreter, "-c", code}, nullptr,
                                 {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/nonexistent",
                                  "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "MPLBACKEND=agg"},
                                 root);
    if (r.exit_code != 0) {
        throw std::runtime_error("check kernel: `" + code + "` failed in the image (exit " +
                                 std::to_string(r.exit_code) + "): " + r.output);
    }
}

// Moves a finished temp dir into the store under its content id (unless that
// version is there already) and points the name at it.
StoredImage commit_version(const ImageStore& store, TempDir& tmp, const std::string& name,
                           const std::string& id, std::ostream& progress) {
    StoreLock lock(store.root());
    const fs::path final_dir = store.root() / "store" / id;
    if (fs::exists(final_dir / "manifest.json")) {
        progress << "version " << id.substr(0, 12)
                 << " is already stored (same definition, same packages): kept as it is\n";
        remove_tree(tmp.path());
        tmp.release();
    } else {
        if (fs::exists(final_dir)) remove_tree(final_dir);  // a half-removed version
        ::chmod(tmp.path().c_str(), 0555);
        if (::rename(tmp.path().c_str(), final_dir.c_str()) != 0) {
            throw std::runtime_error("rename " + tmp.path().string() + " to " + final_dir.string() +
                                     ": " + errno_text());
        }
        tmp.release();
    }
    const fs::path link = store.root() / "names" / name;
    const fs::path new_link =
        store.root() / "names" / ("." + name + ".new." + std::to_string(::getpid()));
    std::error_code ec;
    fs::remove(new_link, ec);
    fs::create_symlink(fs::path("..") / "store" / id, new_link, ec);
    if (ec) throw std::runtime_error("symlink " + new_link.string() + ": " + ec.message());
    if (::rename(new_link.c_str(), link.c_str()) != 0) {
        throw std::runtime_error("rename " + new_link.string() + ": " + errno_text());
    }
    return read_stored(final_dir);
}

std::vector<std::string> mmdebstrap_argv(const BuildSpec& spec, const fs::path& rootfs,
                                         const fs::path& cache) {
    std::vector<std::string> argv{"mmdebstrap", "--mode=root", "--variant=" + spec.variant,
                                  "--format=directory"};
    if (!spec.packages.empty()) {
        std::string include = "--include=";
        for (std::size_t i = 0; i < spec.packages.size(); ++i) {
            include += (i ? "," : "") + spec.packages[i];
        }
        argv.push_back(include);
    }
    // Downloaded packages are kept for the next build (mmdebstrap's own recipe).
    argv.push_back("--skip=essential/unlink");
    argv.push_back("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/");
    argv.push_back("--setup-hook=sync-in " + cache.string() + " /var/cache/apt/archives/");
    argv.push_back("--customize-hook=sync-out /var/cache/apt/archives " + cache.string());
    if (spec.strip_docs) {
        for (const char* opt :
             {"path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
              "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
              "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias"}) {
            argv.push_back(std::string("--dpkgopt=") + opt);
        }
    }
    argv.push_back(spec.suite);
    argv.push_back(rootfs.string());
    argv.push_back(spec.mirror);
    return argv;
}

json stored_definition(const Image& image) {
    json def = image.definition.is_object() && !image.definition.empty()
                   ? image.definition
                   : json{{"name", image.name}, {"kernel_argv", image.kernel_argv}};
    def["name"] = image.name;
    return def;
}

}  // namespace

// ------------------------------------------------------------------ hashing

std::string sha256_hex(std::string_view data) {
    std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
    unsigned int len = 0;
    if (EVP_Digest(data.data(), data.size(), md.data(), &len, EVP_sha256(), nullptr) != 1) {
        throw std::runtime_error("sha256: digest failed");
    }
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
        out.push_back(hex[md[i] >> 4]);
        out.push_back(hex[md[i] & 0x0f]);
    }
    return out;
}

std::string image_content_id(const json& definition,
                             const std::map<std::string, std::string>& file_digests,
                             const std::vector<std::string>& packages) {
    std::vector<std::string> sorted = packages;
    std::sort(sorted.begin(), sorted.end());
    // nlohmann's objects keep their keys sorted: dump() is canonical.
    const json hashed = {{"cellblock_image", 1},
                         {"definition", definition},
                         {"files", file_digests},
                         {"packages", sorted}};
    return sha256_hex(hashed.dump());
}

// ------------------------------------------------------------------ the store

ImageStore::ImageStore(fs::path root) : root_(std::move(root)) {}

std::string ImageStore::current_id(const std::string& name) const {
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') return "";
    std::error_code ec;
    const fs::path target = fs::read_symlink(root_ / "names" / name, ec);
    if (ec) return "";
    const std::string id = target.filename().string();
    return fs::exists(root_ / "store" / id / "manifest.json") ? id : "";
}

std::optional<StoredImage> ImageStore::current(const std::string& name) const {
    const std::string id = current_id(name);
    if (id.empty()) return std::nullopt;
    return read_stored(root_ / "store" / id);
}

std::vector<StoredImage> ImageStore::versions(const std::string& name) const {
    std::vector<StoredImage> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "store", ec)) {
        try {
            StoredImage s = read_stored(entry.path());
            if (s.name == name) out.push_back(std::move(s));
        } catch (const std::exception&) {
        }
    }
    return out;
}

std::vector<std::string> ImageStore::names() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "names", ec)) {
        const std::string name = entry.path().filename().string();
        if (!name.empty() && name[0] != '.' && current(name)) out.push_back(name);
    }
    std::sort(out.begin(), out.end());
    return out;
}

Image ImageStore::image(const StoredImage& stored) const {
    Image image = Image::load(stored.dir / "image.json");
    image.rootfs = stored.rootfs().string();
    image.content_id = stored.content_id;
    image.definition_dir.clear();
    return image;
}

Image resolve_image(const Image& image, const ImageStore& store) {
    if (image.rootfs != "store") return image;
    const auto stored = store.current(image.name);
    if (!stored) {
        throw ImageNotBuilt("image '" + image.name + "' is not built in " + store.root().string() +
                            ": run `cellblock image build " + image.name + "`");
    }
    return store.image(*stored);
}

std::vector<std::string> image_mount_points(const Image& image) {
    SandboxSpec spec;
    spec.image = image;
    spec.rootfs = "/nonexistent";
    const json config = make_oci_config(spec);
    std::vector<std::string> out;
    for (const auto& m : config.at("mounts")) out.push_back(m.at("destination"));
    return out;
}

// ------------------------------------------------------------------ build, import

StoredImage build_image(const Image& definition, const ImageStore& store, std::ostream& progress) {
    if (definition.build.is_null()) {
        throw std::runtime_error("image '" + definition.name +
                                 "' has no build section: nothing to build");
    }
    const BuildSpec spec = BuildSpec::from_json(definition.build);
    const auto started = Clock::now();
    StopSignals signals;
    make_store_dirs(store);
    sweep_abandoned_builds(store);

    // Extra files first: a missing source fails before a minute of mmdebstrap.
    std::map<std::string, std::string> file_data, file_digests;
    for (const auto& f : spec.files) {
        const std::string data =
            f.source.empty() ? f.content : read_file_bytes(definition.definition_dir / f.source);
        file_digests[f.path] = sha256_hex(data);
        file_data[f.path] = data;
    }

    TempDir tmp(make_temp_dir(store, definition.name));
    const fs::path rootfs = tmp.path() / "rootfs";
    progress << "building image " << definition.name << " (Debian " << spec.suite << ", "
             << spec.packages.size() << " package(s) and their dependencies) in "
             << tmp.path().string() << "\n"
             << std::flush;
    progress << "[1/5] mmdebstrap\n" << std::flush;
    const auto argv = mmdebstrap_argv(spec, rootfs, store.root() / "cache" / "apt");
    const Finished r = run_child(argv, &progress, tool_env(), {}, started);
    check_stop("mmdebstrap");
    if (r.exit_code != 0) {
        throw std::runtime_error("mmdebstrap exited with " + std::to_string(r.exit_code) +
                                 "; its last lines:\n" + r.output);
    }

    progress << "[2/5] extra files and the sandbox's skeleton (mount points, /etc/passwd)\n"
             << std::flush;
    for (const auto& f : spec.files) {
        const fs::path target = rootfs / f.path.substr(1);
        std::error_code ec;
        fs::create_directories(target.parent_path(), ec);
        if (ec)
            throw std::runtime_error("mkdir " + target.parent_path().string() + ": " +
                                     ec.message());
        write_file_bytes(target, file_data[f.path], static_cast<mode_t>(f.mode));
    }
    prepare_stored_root(definition, rootfs);
    check_stop("prepare");

    progress << "[3/5] checking the kernel\n" << std::flush;
    check_kernel(definition, rootfs, progress);
    prepare_stored_root(definition, rootfs);  // clears what the check left in /tmp
    check_stop("check kernel");

    progress << "[4/5] content id\n" << std::flush;
    const auto packages = installed_packages(rootfs);
    const json def = stored_definition(definition);
    const std::string id = image_content_id(def, file_digests, packages);
    const std::uint64_t size = tree_size(rootfs);
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    json manifest = {{"name", definition.name}, {"content_id", id},
                     {"source", "build"},       {"suite", spec.suite},
                     {"mirror", spec.mirror},   {"variant", spec.variant},
                     {"built_at", unix_now()},  {"build_seconds", seconds},
                     {"size_bytes", size},      {"package_count", packages.size()},
                     {"packages", packages},    {"files", file_digests}};
    write_file_bytes(tmp.path() / "manifest.json", manifest.dump(2) + "\n", 0444);
    write_file_bytes(tmp.path() / "image.json", def.dump(2) + "\n", 0444);
    progress << seal_root(rootfs, rootfs / "tmp") << std::flush;
    check_stop("read-only");

    progress << "[5/5] into place\n" << std::flush;
    StoredImage stored = commit_version(store, tmp, definition.name, id, progress);
    progress << "image " << definition.name << ": " << id << "\n  " << format_size(size) << ", "
             << packages.size() << " packages, built in " << std::fixed << std::setprecision(1)
             << seconds << " s\n  " << stored.rootfs().string() << " (read-only)\n"
             << std::flush;
    return stored;
}

Image default_import_definition(const std::string& name) {
    json j = {
        {"name", name},
        {"display_name", "Python 3 (" + name + ")"},
        {"language", "python"},
        {"runtime", "runc"},
        {"rootfs", "store"},
        {"kernel_argv",
         {"/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py", "-f", "{connection_file}"}},
        {"env",
         {{"MPLBACKEND", "module://matplotlib_inline.backend_inline"},
          {"PYDEVD_DISABLE_FILE_VALIDATION", "1"},
          {"PYTHONDONTWRITEBYTECODE", "1"}}}};
    return Image::from_json(j);
}

StoredImage import_image(const Image& definition, const fs::path& tarball, const ImageStore& store,
                         std::ostream& progress) {
    if (definition.rootfs != "store") {
        throw std::runtime_error("image '" + definition.name +
                                 "': only an image whose rootfs is 'store' can be imported");
    }
    const auto started = Clock::now();
    StopSignals signals;
    make_store_dirs(store);
    sweep_abandoned_builds(store);
    progress << "[1/4] hashing " << tarball.string() << "\n" << std::flush;
    const Finished digest =
        run_child({"sha256sum", "--", fs::absolute(tarball).string()}, nullptr, tool_env());
    if (digest.exit_code != 0 || digest.output.size() < 64) {
        throw std::runtime_error("read " + tarball.string() + ": " + digest.output);
    }
    const std::string tar_digest = digest.output.substr(0, 64);
    check_stop("hash");

    TempDir tmp(make_temp_dir(store, definition.name));
    const fs::path rootfs = tmp.path() / "rootfs";
    fs::create_directory(rootfs);
    ::chmod(rootfs.c_str(), 0755);
    progress << "[2/4] unpacking into " << rootfs.string() << "\n" << std::flush;
    const Finished r =
        run_child({"tar", "--extract", "--file", fs::absolute(tarball).string(), "--directory",
                   rootfs.string(), "--numeric-owner", "--same-permissions", "--no-overwrite-dir"},
                  &progress, tool_env(), {}, started);
    check_stop("unpack");
    if (r.exit_code != 0)
        throw std::runtime_error("tar exited with " + std::to_string(r.exit_code) + ":\n" +
                                 r.output);
    ::chmod(rootfs.c_str(), 0755);

    progress << "[3/4] the sandbox's skeleton and a kernel check\n" << std::flush;
    prepare_stored_root(definition, rootfs);
    check_kernel(definition, rootfs, progress);
    prepare_stored_root(definition, rootfs);
    check_stop("check kernel");
    std::vector<std::string> packages;
    // A dpkg database reached through a symlink could be the host's: not read.
    if (reached_without_symlinks(rootfs, "var/lib/dpkg/status")) {
        packages = installed_packages(rootfs);
    }
    const json def = stored_definition(definition);
    const std::string id = image_content_id(def, {{"rootfs.tar", tar_digest}}, packages);
    const std::uint64_t size = tree_size(rootfs);
    const json manifest = {
        {"name", definition.name},      {"content_id", id},
        {"source", "import"},           {"tarball", fs::absolute(tarball).string()},
        {"tarball_sha256", tar_digest}, {"built_at", unix_now()},
        {"size_bytes", size},           {"package_count", packages.size()},
        {"packages", packages}};
    write_file_bytes(tmp.path() / "manifest.json", manifest.dump(2) + "\n", 0444);
    write_file_bytes(tmp.path() / "image.json", def.dump(2) + "\n", 0444);
    progress << seal_root(rootfs, rootfs / "tmp") << std::flush;

    progress << "[4/4] into place\n" << std::flush;
    StoredImage stored = commit_version(store, tmp, definition.name, id, progress);
    progress << "image " << definition.name << ": " << id << "\n  " << format_size(size)
             << " imported\n"
             << std::flush;
    return stored;
}

// ------------------------------------------------------------------ rm, sweep

std::vector<int> processes_using(const StoredImage& stored) {
    // A sandbox's /proc/PID/root reads as "/" from here (it lives in its own
    // mount namespace after pivot_root): compare the directory itself.
    std::vector<int> out;
    struct stat root {};
    if (::stat(stored.rootfs().c_str(), &root) != 0) return out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string pid = entry.path().filename().string();
        if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
        struct stat st {};
        if (::stat((entry.path() / "root").c_str(), &st) == 0 && st.st_dev == root.st_dev &&
            st.st_ino == root.st_ino) {
            out.push_back(std::stoi(pid));
        }
    }
    return out;
}

int hold_stored_version(const fs::path& rootfs) {
    const fs::path manifest = rootfs.parent_path() / "manifest.json";
    const std::string id = rootfs.parent_path().filename().string();
    const int fd = ::open(manifest.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        throw std::runtime_error("image version " + id.substr(0, 12) + " is gone from the store (" +
                                 errno_text() + ")");
    }
    if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
        ::close(fd);
        throw std::runtime_error("image version " + id.substr(0, 12) +
                                 " is being removed (cellblock image rm)");
    }
    return fd;
}

std::vector<StoredImage> remove_image(const std::string& name, const ImageStore& store) {
    auto versions = store.versions(name);
    const bool named = store.current(name).has_value();
    if (!named && versions.empty()) {
        throw std::runtime_error("image '" + name + "' is not in the store " +
                                 store.root().string());
    }
    StoreLock lock(store.root());
    std::error_code ec;
    fs::remove(store.root() / "names" / name, ec);
    std::vector<StoredImage> kept;
    for (const auto& v : versions) {
        // In use: a sandbox holds the version (hold_stored_version), from
        // before its runtime starts, or a process runs on its root (a
        // sandbox whose server is gone).
        const int fd = ::open((v.dir / "manifest.json").c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if ((fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) || !processes_using(v).empty()) {
            if (fd >= 0) ::close(fd);
            kept.push_back(v);
            continue;
        }
        try {
            remove_tree(v.dir);  // still holding the lock: no sandbox starts on it meanwhile
        } catch (...) {
            if (fd >= 0) ::close(fd);
            throw;
        }
        if (fd >= 0) ::close(fd);
    }
    return kept;
}

void sweep_abandoned_builds(const ImageStore& store) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(store.root() / "tmp", ec)) {
        const std::string name = entry.path().filename().string();
        const auto dot = name.find('.');
        if (dot == std::string::npos) continue;
        const int pid = std::atoi(name.substr(0, dot).c_str());
        if (pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM)) continue;  // still building
        remove_tree(entry.path());
    }
}

}  // namespace cellblock
