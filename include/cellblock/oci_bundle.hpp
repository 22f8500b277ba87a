// The OCI bundle of a sandbox, built as a value from an image and a policy.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/image.hpp"
#include "cellblock/sandbox_protocol.hpp"

namespace cellblock {

// Paths inside every sandbox.
inline constexpr const char* kSandboxIpcDir = sandbox_protocol::kIpcDir;
// The shim's egress forwarder, on the sandbox's own loopback (shim.cpp).
inline constexpr const char* kSandboxEgressProxy = "http://127.0.0.1:3128";
inline constexpr const char* kSandboxConnectionFile = sandbox_protocol::kConnectionFile;
inline constexpr const char* kSandboxLibexec = "/opt/cellblock";
inline constexpr const char* kSandboxShim = sandbox_protocol::kShimPath;
inline constexpr const char* kSandboxHome = "/home/sandbox";
// Where pip installs a session's packages (PIP_TARGET, on PYTHONPATH): its home.
inline constexpr const char* kSandboxPackages = "/home/sandbox/.packages";
inline constexpr const char* kSandboxInputDir = "/data/input";
inline constexpr const char* kSandboxOutputDir = "/data/output";
inline constexpr std::uint32_t kSandboxUid = 1000;
// Where the shim finds the server's lifeline socket when the runtime cannot pass
// it an fd (runsc): the server listens there, accepts one connection, unlinks it.
inline constexpr const char* kLifelineEnv = sandbox_protocol::kLifelineEnv;
inline constexpr const char* kSandboxLifelineSocket = "/run/cellblock/lifeline.sock";
static_assert(
    std::string_view(kSandboxLifelineSocket).ends_with(sandbox_protocol::kLifelineSocketName));
// The cgroup every sandbox's own cgroup is made in, in each hierarchy (the
// bundle's cgroupsPath is /cellblock/<container id>; runc_sandbox.hpp has
// the rest of the layout).
inline constexpr const char* kSandboxesCgroup = "cellblock";
// A zygote's control socket (SessionDir::zygote_socket on the host).
inline constexpr const char* kSandboxZygoteSocket = "/run/cellblock/zygote.sock";

// The family of an OCI runtime, from the basename of its name or path: what
// the bundle and the runtime's command line depend on.
enum class RuntimeKind { runc, crun, runsc };
// "runc", "/usr/bin/runsc", "crun" → their kind; anything else is treated as runc.
RuntimeKind runtime_kind(const std::string& runtime);
// Whether the runtime can hand the init an inherited fd (runc/crun
// --preserve-fds); runsc 2022 cannot, so its shim connects to a socket instead.
bool runtime_passes_fds(RuntimeKind kind);
// The pids cgroup limit for a sandbox allowed `pids` processes and threads.
// runc/crun: `pids` itself. runsc: the cgroup holds gVisor's Sentry and gofer
// threads and, on the ptrace platform, about ten stub tasks per sandbox
// process, and the Sentry dies when it cannot make a thread; so there the
// cgroup is a generous backstop and `pids` is enforced inside, by gVisor, as
// RLIMIT_NPROC (the sandbox has one user, so that counts all its tasks).
int host_pids_limit(RuntimeKind kind, int pids);

// Container ids 0..size-1 map to host ids host_base..; container root is never
// host root. Each sandbox leases a range of its own (host_ids.hpp); the default
// base is the range every sandbox shared before, kept for values built in tests.
struct IdMapping {
    std::uint32_t host_base = 1u << 30;
    std::uint32_t size = 65536;
    std::uint32_t host_uid(std::uint32_t container_uid) const { return host_base + container_uid; }
};

// A session's sandbox, or the zygote its sessions are forked from
// (docs/zygote.md): the zygote's container has no user or PID namespace, runs
// as the first host id of its range without capabilities, keeps /proc
// and /sys unmasked (a forked session mounts its own and masks them; the kernel
// allows that only where fully visible ones exist) and lets its children create
// namespaces and mounts, which each session stops for itself with the
// session profile before any session code runs.
enum class SandboxRole { session, zygote };

struct SandboxSpec {
    SandboxRole role = SandboxRole::session;
    std::string container_id;
    Image image;
    SandboxLimits limits;
    IdMapping ids;
    std::filesystem::path rootfs;       // host path of the root filesystem
    std::filesystem::path ipc_dir;      // host dir mounted at /run/cellblock
    std::filesystem::path input_dir;    // host dir mounted read-only at /data/input
    std::filesystem::path output_dir;   // host dir mounted at /data/output
    std::filesystem::path libexec_dir;  // host dir with cellblock-shim, mounted at /opt/cellblock
    std::string cgroup_parent = kSandboxesCgroup;
    // RLIMIT_NPROC when not 0 (else from limits.pids). A zygote's: the
    // server's own hard limit. The user namespace of each fork is charged,
    // one level up, to the zygote's uid, bounded by the zygote's limit at the
    // time of the fork: that sum must not be what stops a session.
    std::uint64_t nproc = 0;
    std::string runtime = "runc";  // runc, crun, runsc (or a path to one)
    // A session's sandbox (or a zygote, whose forks' mounts are its own)
    // outlives its server this long, waiting to be adopted (kAdoptGraceEnv);
    // runtimes that pass the lifeline only.
    int adopt_grace_ms = 0;
};

// config.json for the spec: namespaces, user namespace mapping, read-only root,
// capped tmpfs mounts, binds, no capabilities, no_new_privs, seccomp, masked
// and read-only /proc paths, cgroup limits, rlimits, and the shim as init.
// For runsc the shim is told where its lifeline socket is (kLifelineEnv), the
// seccomp profile lets clone3 through to the Sentry (see make_seccomp_profile),
// and the pids limit moves inside (see host_pids_limit).
nlohmann::json make_oci_config(const SandboxSpec& spec);

// The kernel's command line with the connection file substituted.
std::vector<std::string> kernel_command(const Image& image);

// The environment of the sandbox's processes: fixed safe values plus the image's.
std::vector<std::string> sandbox_environment(const Image& image);

// Creates the skeleton root of a "host" image under spec.rootfs: mount points
// for every mount (runc cannot create them as the mapped user), symlinks of
// merged /usr, and a generated /etc (passwd, group, hosts, nsswitch.conf).
// The host's /etc is never copied.
void prepare_host_rootfs(const SandboxSpec& spec, const nlohmann::json& oci_config);

// The seccomp section: an allowlist of the x86_64 calls the build's headers
// know, less Docker's default denials plus ptrace, process_vm_*, pidfd_getfd,
// namespace-creating clone flags and AF_VSOCK sockets. Under runsc (the Sentry
// enforces it, with --oci-seccomp) clone3 is allowed instead of answered with
// ENOSYS: gVisor applies every SCMP_ACT_ERRNO as EPERM whatever errnoRet says,
// which would stop glibc falling back to clone, and its Sentry has no clone3
// (it answers ENOSYS itself).
// The zygote's profile also allows unshare, mount, umount2, move_mount and
// sethostname (what a forked session needs to contain itself).
// Joining the kernel's same-page merging is refused (madvise MADV_MERGEABLE,
// prctl PR_SET_MEMORY_MERGE: EPERM) unless `allow_memory_merge`: a page
// merged with another process's tells, by the time a write to it takes,
// that the other holds the same bytes (a host's VMs, a neighbour). Allowed
// only to Swarm kernels that share their boot memory, and in the profile a
// node's engine gets (`cellblock seccomp-profile`), over which the shim
// installs the server's own.
nlohmann::json make_seccomp_profile(RuntimeKind kind = RuntimeKind::runc,
                                    SandboxRole role = SandboxRole::session,
                                    bool allow_memory_merge = false);

}  // namespace cellblock
