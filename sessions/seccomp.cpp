// The seccomp concern, both of its forms: the profile every sandbox gets (an
// allowlist of x86_64 system calls, the OCI config's `linux.seccomp`, which
// runc or runsc installs for a booted sandbox), and the same profile compiled
// to a BPF program with libseccomp, which a zygote's fork installs itself
// (kernel-shim/cellblock_containment.py) and a Swarm task's shim is handed.
// One profile, two installers: a call denied to one kind of sandbox is
// denied to every kind.
#include <fcntl.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/zygote.hpp"
#include "sandbox_internal.hpp"
#include "seccomp_syscalls.hpp"

namespace cellblock {
using nlohmann::json;

// Linux 6.4's; newer than some build hosts' headers.
constexpr std::uint64_t kPrSetMemoryMerge = 67;
// prctl's two options outside its small numbers ("Yama", "SVMA").
constexpr std::uint64_t kPrSetPtracer = 0x59616d61;
constexpr std::uint64_t kPrSetVma = 0x53564d41;

json make_seccomp_profile(RuntimeKind kind, SandboxRole role, bool allow_memory_merge) {
    // Docker's default profile denies these to an unprivileged container; so do
    // we, plus the calls that let same-uid code hijack another process, and
    // inotify: the kernel charges a sandbox's inotify instances to the user
    // that made its user namespace (root, through runc), so one session could
    // spend the 128 that every session and root's own daemons share.
    static const std::vector<std::string> denied = {
        "acct", "add_key", "bpf", "chroot", "clock_adjtime", "clock_settime", "create_module",
        "delete_module", "fanotify_init", "finit_module", "fsconfig", "fsmount", "fsopen", "fspick",
        "get_kernel_syms", "init_module", "inotify_init", "inotify_init1", "io_uring_enter",
        "io_uring_register", "io_uring_setup", "ioperm", "iopl", "kcmp", "kexec_file_load",
        "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr", "move_mount",
        "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open",
        "pidfd_getfd", "pivot_root", "process_madvise", "process_vm_readv", "process_vm_writev",
        "ptrace", "query_module", "quotactl", "quotactl_fd", "reboot", "request_key",
        "setdomainname", "sethostname", "setns",
        // i386's socket multiplexer: its
        // arguments are in memory, where
        // seccomp cannot see AF_VSOCK.
        "socketcall", "settimeofday", "swapoff", "swapon", "_sysctl", "syslog", "umount2",
        "unshare", "uselib", "userfaultfd", "ustat", "vhangup"};
    // An allowlist: every x86_64 system call the build's kernel headers know,
    // less the denied ones, and nothing else. A call newer than the headers,
    // or one only the i386 ABI has, gets ENOSYS instead of reaching the kernel.
    // The profile is x86_64's, whose numbers these headers are.
    const std::uint64_t namespace_flags = CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP |
                                          CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                                          CLONE_NEWPID | CLONE_NEWNET;
    std::set<std::string> denied_set(denied.begin(), denied.end());
    if (role == SandboxRole::zygote) {
        for (const char* call : {"unshare", "mount", "umount2", "move_mount", "sethostname"})
            denied_set.erase(call);
    }
    std::vector<std::string> allowed;
    for (const auto& name : x86_64_syscall_names()) {
        if (denied_set.count(name) || name == "clone" || name == "clone3" || name == "socket") {
            continue;
        }
        if (!allow_memory_merge && (name == "madvise" || name == "prctl")) continue;
        allowed.push_back(name);
    }
    json syscalls = json::array();
    syscalls.push_back({{"names", allowed}, {"action", "SCMP_ACT_ALLOW"}});
    // clone without any namespace flag (seccomp compares (flags & mask) == 0).
    syscalls.push_back({{"names", {"clone"}},
                        {"action", "SCMP_ACT_ALLOW"},
                        {"args",
                         {{{"index", 0},
                           {"value", namespace_flags},
                           {"valueTwo", 0},
                           {"op", "SCMP_CMP_MASKED_EQ"}}}}});
    // The kernel reads the arguments compared below as a C int, their low 32
    // bits only: a rule like `!= AF_VSOCK` on the whole register let
    // `AF_VSOCK | 1 << 32` through as AF_VSOCK (a vsock socket was made so).
    // So each such call is allowed only for an enumerated set of whole values
    // (SCMP_CMP_EQ: the high word 0, as every caller passing an int leaves
    // it), refused with EPERM for the one it must not have, and anything else
    // (any high word) gets the default ENOSYS. Not socket's refusal: on i386
    // libseccomp also writes socket's rules as socketcall(SYS_SOCKET) ones,
    // where a refusal after the allowances collides with them (EEXIST: runc
    // then refuses the whole profile), so AF_VSOCK gets the default ENOSYS.
    const auto int_argument = [&](const char* call, int index, std::uint64_t refused,
                                  std::uint64_t below, std::vector<std::uint64_t> also,
                                  bool refusal_rule) {
        const auto argument_is = [&](std::uint64_t value) {
            return json::array({{{"index", index}, {"value", value}, {"op", "SCMP_CMP_EQ"}}});
        };
        for (std::uint64_t value = 0; value < below; ++value) {
            if (value != refused) also.push_back(value);
        }
        for (std::uint64_t value : also) {
            syscalls.push_back(
                {{"names", {call}}, {"action", "SCMP_ACT_ALLOW"}, {"args", argument_is(value)}});
        }
        if (!refusal_rule) return;
        syscalls.push_back({{"names", {call}},
                            {"action", "SCMP_ACT_ERRNO"},
                            {"errnoRet", EPERM},
                            {"args", argument_is(refused)}});
    };
    // socket of any family the headers know but AF_VSOCK, which reaches the
    // hypervisor's host side.
    int_argument("socket", 0, AF_VSOCK, AF_MAX, {}, /*refusal_rule=*/false);
    if (!allow_memory_merge) {
        // Everything but joining same-page merging (see the header): the
        // advice and options there are and room for newer ones (MADV_GUARD_*
        // are 102 and 103), PR_SET_PTRACER and PR_SET_VMA.
        int_argument("madvise", 2, MADV_MERGEABLE, 128, {}, true);
        int_argument("prctl", 0, kPrSetMemoryMerge, 128, {kPrSetPtracer, kPrSetVma}, true);
    }
    // The denied calls say EPERM, as under Docker's profile.
    syscalls.push_back({{"names", std::vector<std::string>(denied_set.begin(), denied_set.end())},
                        {"action", "SCMP_ACT_ERRNO"},
                        {"errnoRet", EPERM}});
    // glibc falls back from clone3 to clone on ENOSYS; clone's flags can be filtered.
    if (kind != RuntimeKind::runsc) {
        syscalls.push_back(
            {{"names", {"clone3"}}, {"action", "SCMP_ACT_ERRNO"}, {"errnoRet", ENOSYS}});
    } else {
        // gVisor (runsc 2022) applies every SCMP_ACT_ERRNO, the default one
        // too, as EPERM whatever errnoRet says: glibc would then not fall back
        // to clone and no thread could start. Its Sentry has no clone3 and
        // answers ENOSYS itself, so the call is let through to it.
        syscalls.push_back({{"names", {"clone3"}}, {"action", "SCMP_ACT_ALLOW"}});
    }
    return {{"defaultAction", "SCMP_ACT_ERRNO"},
            {"defaultErrnoRet", ENOSYS},
            {"architectures", {"SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"}},
            {"syscalls", syscalls}};
}

namespace {

std::uint32_t scmp_action(const json& rule) {
    const std::string action = rule.at("action");
    if (action == "SCMP_ACT_ALLOW") return SCMP_ACT_ALLOW;
    if (action == "SCMP_ACT_ERRNO")
        return SCMP_ACT_ERRNO(static_cast<std::uint16_t>(rule.value("errnoRet", EPERM)));
    throw SandboxError("seccomp: action " + action + " is not supported here");
}

scmp_compare scmp_op(const std::string& op) {
    if (op == "SCMP_CMP_NE") return SCMP_CMP_NE;
    if (op == "SCMP_CMP_EQ") return SCMP_CMP_EQ;
    if (op == "SCMP_CMP_MASKED_EQ") return SCMP_CMP_MASKED_EQ;
    throw SandboxError("seccomp: comparison " + op + " is not supported here");
}

}  // namespace

std::string compile_seccomp_bpf(const json& profile) {
    const std::uint32_t default_action =
        scmp_action({{"action", profile.at("defaultAction")},
                     {"errnoRet", profile.value("defaultErrnoRet", EPERM)}});
    scmp_filter_ctx ctx = seccomp_init(default_action);
    if (!ctx) throw SandboxError("seccomp_init failed");
    std::unique_ptr<void, void (*)(void*)> owner(ctx, [](void* c) { seccomp_release(c); });
    // runc's defaults: no_new_privs is the caller's business, and a rule
    // that cannot be added for one architecture (a call i386 lacks) is skipped.
    seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0);
    for (const auto& arch : profile.value("architectures", json::array())) {
        const std::string name = arch;
        const std::uint32_t token = name == "SCMP_ARCH_X86"   ? SCMP_ARCH_X86
                                    : name == "SCMP_ARCH_X32" ? SCMP_ARCH_X32
                                                              : SCMP_ARCH_NATIVE;
        const int r = seccomp_arch_add(ctx, token);
        if (r != 0 && r != -EEXIST) throw SandboxError("seccomp_arch_add " + name + " failed");
    }
    for (const auto& rule : profile.at("syscalls")) {
        const std::uint32_t action = scmp_action(rule);
        if (action == default_action) continue;  // libseccomp refuses it; runc skips it too
        std::vector<scmp_arg_cmp> args;
        for (const auto& arg : rule.value("args", json::array())) {
            args.push_back({arg.at("index").get<unsigned>(), scmp_op(arg.at("op")),
                            arg.at("value").get<std::uint64_t>(),
                            arg.value("valueTwo", std::uint64_t{0})});
        }
        for (const auto& name : rule.at("names")) {
            const int nr = seccomp_syscall_resolve_name(name.get<std::string>().c_str());
            if (nr == __NR_SCMP_ERROR) continue;  // unknown to libseccomp: the default applies
            const int r = seccomp_rule_add_array(ctx, action, nr,
                                                 static_cast<unsigned>(args.size()), args.data());
            if (r != 0 && r != -EEXIST) {
                throw SandboxError("seccomp rule for " + name.get<std::string>() + ": " +
                                   std::strerror(-r));
            }
        }
    }
    const int out = ::memfd_create("cellblock-seccomp", MFD_CLOEXEC);
    if (out < 0) throw SandboxError("memfd_create: " + errno_text());
    UniqueFd memfd(out);
    if (seccomp_export_bpf(ctx, memfd.get()) != 0) throw SandboxError("seccomp_export_bpf failed");
    const off_t size = ::lseek(memfd.get(), 0, SEEK_END);
    std::string bpf(static_cast<size_t>(size), '\0');
    if (::pread(memfd.get(), bpf.data(), bpf.size(), 0) != size) {
        throw SandboxError("seccomp: reading the program back failed");
    }
    return bpf;
}

}  // namespace cellblock
