// The OCI bundle of a sandbox, built as a value from an image and a policy.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/image.hpp"

namespace cellblock {

// Paths inside every sandbox.
inline constexpr const char* kSandboxIpcDir = "/run/cellblock";
inline constexpr const char* kSandboxConnectionFile = "/run/cellblock/kernel.json";
inline constexpr const char* kSandboxLibexec = "/opt/cellblock";
inline constexpr const char* kSandboxShim = "/opt/cellblock/cellblock-shim";
inline constexpr const char* kSandboxHome = "/home/sandbox";
inline constexpr const char* kSandboxInputDir = "/data/input";
inline constexpr const char* kSandboxOutputDir = "/data/output";
inline constexpr std::uint32_t kSandboxUid = 1000;

// Container ids 0..size-1 map to host ids host_base..; container root is never host root.
struct IdMapping {
    std::uint32_t host_base = 1u << 30;
    std::uint32_t size = 65536;
    std::uint32_t host_uid(std::uint32_t container_uid) const { return host_base + container_uid; }
};

struct SandboxSpec {
    std::string container_id;
    Image image;
    SandboxLimits limits;
    IdMapping ids;
    std::filesystem::path rootfs;       // host path of the root filesystem
    std::filesystem::path ipc_dir;      // host dir mounted at /run/cellblock
    std::filesystem::path input_dir;    // host dir mounted read-only at /data/input
    std::filesystem::path output_dir;   // host dir mounted at /data/output
    std::filesystem::path libexec_dir;  // host dir with cellblock-shim, mounted at /opt/cellblock
    std::string cgroup_parent = "cellblock";
};

// config.json for the spec: namespaces, user namespace mapping, read-only root,
// capped tmpfs mounts, binds, no capabilities, no_new_privs, seccomp, masked
// and read-only /proc paths, cgroup limits, rlimits, and the shim as init.
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

// The seccomp section: Docker's default denials plus ptrace, process_vm_*,
// pidfd_getfd, namespace-creating clone flags and AF_VSOCK sockets.
nlohmann::json make_seccomp_profile();

}  // namespace cellblock
