// The host side's mount verbs for a sandbox's directories: the capped tmpfs
// a session's directories live on, their lazy unmount, and the detached copy
// of one that a zygote's fork moves into its own mount namespace
// (zygote_fork.cpp). What mounts a sandbox sees inside is the OCI config's
// (oci_bundle.cpp) for a booted sandbox, and the fork's own steps
// (kernel-shim/cellblock_containment.py) for a forked one.
#include <fcntl.h>
#include <sys/mount.h>

#include <string>

#include "sandbox_internal.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;

void mount_tmpfs(const fs::path& target, int size_mb, std::uint32_t owner, const char* mode) {
    const std::string options = "size=" + std::to_string(size_mb) + "m,mode=" + mode +
                                ",uid=" + std::to_string(owner) + ",gid=" + std::to_string(owner);
    if (::mount("tmpfs", target.c_str(), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                options.c_str()) != 0) {
        throw SandboxError("mount tmpfs " + target.string() + ": " + errno_text());
    }
}

void unmount_if_mounted(const fs::path& target) {
    // MNT_DETACH so a process still holding a file there cannot keep the session alive.
    for (int i = 0; i < 4; ++i) {
        if (::umount2(target.c_str(), MNT_DETACH) != 0) break;
    }
}

// A detached copy of a session directory's mount (open_tree), with the
// attributes the session gets: the forked child moves it into its own mount
// namespace; it never sees the host path.
UniqueFd detached_tree(const fs::path& dir, std::uint64_t attributes) {
    UniqueFd tree(::open_tree(AT_FDCWD, dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
    if (!tree) throw SandboxError("open_tree " + dir.string() + ": " + errno_text());
    mount_attr attr{};
    attr.attr_set = attributes;
    if (::mount_setattr(tree.get(), "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) {
        throw SandboxError("mount_setattr " + dir.string() + ": " + errno_text());
    }
    return tree;
}

}  // namespace cellblock::sandbox_detail
