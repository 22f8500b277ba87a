// The image build's child processes (mmdebstrap, the image's own code in a
// confined chroot) and the signals that stop a build.
#include "image_builder_internal.hpp"

namespace cellblock::image_detail {

std::string read_file_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    return {std::istreambuf_iterator<char>(in), {}};
}

void write_file_bytes(const fs::path& path, const std::string& data, mode_t mode) {
    // A symlink the packages left at that path is replaced, never followed.
    std::error_code ec;
    fs::remove(path, ec);
    const UniqueFd fd(
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode));
    if (!fd) throw std::runtime_error("write " + path.string() + ": " + errno_text());
    std::size_t done = 0;
    while (done < data.size()) {
        const ssize_t n = ::write(fd.get(), data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw std::runtime_error("write " + path.string() + ": " + errno_text());
        done += static_cast<std::size_t>(n);
    }
    ::fchmod(fd.get(), mode);
}

double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

void check_stop(const std::string& step) {
    if (const int sig = g_stop_signal.load()) {
        throw std::runtime_error(step + ": stopped by signal " + std::to_string(sig) + " (" +
                                 strsignal(sig) + ")");
    }
}

Finished run_child(const std::vector<std::string>& argv, std::ostream* progress,
                   const std::vector<std::string>& env_list, const fs::path& root,
                   Clock::time_point started) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe: " + errno_text());
    UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::vector<char*> env;
    for (const auto& e : env_list) env.push_back(const_cast<char*>(e.c_str()));
    env.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork: " + errno_text());
    // The child leads a process group of its own (mmdebstrap's dpkg and apt
    // are in it), which a stop that outlasts kStopGrace kills whole; a
    // terminal's Ctrl-C reaches this process, which tells the child.
    if (pid > 0) ::setpgid(pid, pid);
    if (pid == 0) {
        ::setpgid(0, 0);
        const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        ::dup2(devnull, STDIN_FILENO);
        ::dup2(write_end.get(), STDOUT_FILENO);
        ::dup2(write_end.get(), STDERR_FILENO);
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
    write_end.reset();
    Finished result;
    std::deque<std::string> tail;
    std::string pending;
    // A stop: the child is told (SIGTERM); mmdebstrap then finishes the step
    // it is in, which took up to 5 minutes on a loaded host, so past
    // kStopGrace its whole group is killed. Whatever it left (a half-made
    // root, its /proc, /sys and /dev mounts) is the temp dir's, which
    // remove_tree unmounts and removes.
    std::optional<Clock::time_point> told;
    std::optional<Clock::time_point> killed;
    auto stop_child = [&] {
        if (!g_stop_signal.load()) return;
        const auto now = Clock::now();
        if (!told) {
            ::kill(pid, SIGTERM);
            told = now;
        } else if (!killed && now - *told >= kStopGrace) {
            if (progress) {
                *progress << "  " << argv[0] << " still ran " << kStopGrace.count()
                          << " s after the stop: killed\n"
                          << std::flush;
            }
            ::kill(-pid, SIGKILL);
            ::kill(pid, SIGKILL);
            killed = now;
        }
    };
    char buf[4096];
    for (;;) {
        stop_child();
        // A process of the group that escaped the kill may hold the pipe:
        // the output is not waited for long after the kill.
        if (killed && Clock::now() - *killed > std::chrono::seconds(5)) break;
        pollfd pfd{read_end.get(), POLLIN, 0};
        const int ready = ::poll(&pfd, 1, told ? 500 : 1000);
        if (ready < 0 && errno != EINTR) break;
        if (ready <= 0) continue;
        const ssize_t n = ::read(read_end.get(), buf, sizeof buf);
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
    read_end.reset();
    int status = 0;
    for (;;) {
        stop_child();
        const pid_t waited = ::waitpid(pid, &status, told ? WNOHANG : 0);
        if (waited == pid || (waited < 0 && errno != EINTR)) break;
        if (waited == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
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

}  // namespace cellblock::image_detail
