// cellblock-gateway: the egress gateway process (gateway.hpp). Started by
// `cellblock serve` with its control socket as fd 3; it drops to an
// unprivileged uid, forbids itself new privileges, installs its seccomp
// profile and serves until the server goes.
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "gateway.hpp"

namespace {

constexpr int kControlFd = 3;

void fail(const std::string& what) {
    const std::string line = "cellblock-gateway: " + what + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    ::_exit(1);
}

// What the gateway may not do once it runs: start programs, trace or read
// other processes, change mounts, namespaces or credentials, load kernel
// code, or create processes (threads only). A deny list over the calls a
// resolver and a relay never need: getaddrinfo loads NSS modules and reads
// /etc, which an allow list would have to follow across libc versions.
void install_seccomp() {
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    if (!ctx) fail("seccomp_init failed");
    const int eperm = SCMP_ACT_ERRNO(EPERM);
    for (const char* name : {"execve",
                             "execveat",
                             "ptrace",
                             "process_vm_readv",
                             "process_vm_writev",
                             "mount",
                             "umount2",
                             "pivot_root",
                             "chroot",
                             "unshare",
                             "setns",
                             "move_mount",
                             "open_tree",
                             "fsopen",
                             "fsmount",
                             "fsconfig",
                             "fspick",
                             "mount_setattr",
                             "bpf",
                             "perf_event_open",
                             "kexec_load",
                             "kexec_file_load",
                             "init_module",
                             "finit_module",
                             "delete_module",
                             "keyctl",
                             "add_key",
                             "request_key",
                             "userfaultfd",
                             "personality",
                             "setuid",
                             "setgid",
                             "setreuid",
                             "setregid",
                             "setresuid",
                             "setresgid",
                             "setgroups",
                             "setfsuid",
                             "setfsgid",
                             "capset",
                             "fork",
                             "vfork",
                             "reboot",
                             "swapon",
                             "swapoff",
                             "syslog",
                             "acct",
                             "settimeofday",
                             "clock_settime",
                             "adjtimex",
                             "quotactl",
                             "name_to_handle_at",
                             "open_by_handle_at",
                             "iopl",
                             "ioperm",
                             "kcmp",
                             "pidfd_getfd",
                             "memfd_secret",
                             "io_uring_setup",
                             "sethostname",
                             "setdomainname"}) {
        const int nr = seccomp_syscall_resolve_name(name);
        if (nr == __NR_SCMP_ERROR) continue;  // not on this architecture
        if (seccomp_rule_add(ctx, eperm, nr, 0) != 0) fail(std::string("seccomp rule ") + name);
    }
    // Threads only: clone without CLONE_THREAD is a new process. clone3 hides
    // its flags in memory a filter cannot read, so it answers ENOSYS and libc
    // falls back to clone.
    if (seccomp_rule_add(ctx, eperm, SCMP_SYS(clone), 1,
                         SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0)) != 0) {
        fail("seccomp rule clone");
    }
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0) != 0) {
        fail("seccomp rule clone3");
    }
    if (seccomp_load(ctx) != 0) fail("seccomp_load failed");
    seccomp_release(ctx);
}

}  // namespace

int main(int argc, char** argv) {
    long uid = -1, gid = -1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        if (flag == "--uid") {
            uid = std::strtol(argv[i + 1], nullptr, 10);
        } else if (flag == "--gid") {
            gid = std::strtol(argv[i + 1], nullptr, 10);
        } else {
            fail("usage: cellblock-gateway [--uid UID --gid GID] (control socket on fd 3)");
        }
    }
    if (::fcntl(kControlFd, F_GETFD) == -1) fail("no control socket on fd 3");
    ::fcntl(kControlFd, F_SETFD, FD_CLOEXEC);
    if (::geteuid() == 0) {
        if (uid <= 0 || gid <= 0) fail("running as root: --uid and --gid name the user to become");
        if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
            ::setresuid(uid, uid, uid) != 0) {
            fail(std::string("cannot drop to uid ") + std::to_string(uid) + ": " +
                 std::strerror(errno));
        }
        if (::setuid(0) == 0) fail("could become root again after dropping privileges");
    }
    // After the uid change (which clears it): end with the server.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("no_new_privs failed");
    install_seccomp();
    ::signal(SIGPIPE, SIG_IGN);
    // _exit: connection threads may still run, and a leak check at exit
    // (ASan builds) would need ptrace, which the profile forbids.
    ::_exit(cellblock::gateway::serve(kControlFd));
}
