// The BPF program a zygote's fork installs on itself: compiled by libseccomp
// from the session profile, loaded here into a child process, and checked by
// the calls it makes (no root needed: no_new_privs suffices to load a filter).
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/zygote.hpp"

namespace cellblock {
namespace {

// Runs `body` in a child under the filter; returns its exit status (the
// body's result), or -1 if the filter could not be loaded.
int under_filter(const std::string& bpf, int (*body)()) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        sock_fprog program{static_cast<unsigned short>(bpf.size() / sizeof(sock_filter)),
                           reinterpret_cast<sock_filter*>(const_cast<char*>(bpf.data()))};
        if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
            ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program, 0, 0) != 0) {
            ::_exit(255);
        }
        ::_exit(body());
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) == 255) return -1;
    return WEXITSTATUS(status);
}

TEST(SeccompBpf, TheSessionProfileDeniesWhatRuncWouldDeny) {
    const std::string bpf = compile_seccomp_bpf(make_seccomp_profile(RuntimeKind::runc));
    ASSERT_FALSE(bpf.empty());
    ASSERT_EQ(bpf.size() % sizeof(sock_filter), 0u);
    // Denied by name: EPERM, as Docker's profile says.
    EXPECT_EQ(under_filter(bpf, [] { return ::unshare(CLONE_NEWUSER) == -1 ? errno : 0; }), EPERM);
    EXPECT_EQ(under_filter(bpf, [] { return ::syscall(SYS_ptrace, 0, 0, 0, 0) == -1 ? errno : 0; }),
              EPERM);
    // A namespace flag on clone: refused (ENOSYS, the default, as the
    // masked-equal rule does not match).
    EXPECT_NE(under_filter(bpf,
                           [] {
                               return ::syscall(SYS_clone, CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0) == -1
                                          ? errno
                                          : 0;
                           }),
              0);
    // clone3: ENOSYS, so glibc falls back to clone.
    EXPECT_EQ(under_filter(bpf, [] { return ::syscall(SYS_clone3, 0, 0) == -1 ? errno : 0; }),
              ENOSYS);
    // Allowed calls work, fork included.
    EXPECT_EQ(under_filter(bpf,
                           [] {
                               if (::getpid() <= 0) return 1;
                               const pid_t child = ::fork();
                               if (child == 0) ::_exit(0);
                               int status = 1;
                               ::waitpid(child, &status, 0);
                               return status == 0 ? 0 : 2;
                           }),
              0);
    // socket(AF_VSOCK): no rule allows it, so the default answers (ENOSYS).
    EXPECT_EQ(under_filter(bpf, [] { return ::syscall(SYS_socket, 40, 1, 0) == -1 ? errno : 0; }),
              ENOSYS);
}

TEST(SeccompBpf, UnsupportedActionsAreRefused) {
    nlohmann::json profile = make_seccomp_profile(RuntimeKind::runc);
    profile["syscalls"].push_back({{"names", {"getpid"}}, {"action", "SCMP_ACT_TRACE"}});
    EXPECT_THROW(compile_seccomp_bpf(profile), SandboxError);
}

}  // namespace
}  // namespace cellblock
