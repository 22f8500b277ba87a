// The layout of a session's directory on the host
// (<state dir>/sessions/<session id>/), named once: the sandbox that makes
// it, the zygote that forks into it, the reaper that removes it and the
// server that connects to the kernel's sockets in it all ask this type.
#pragma once

#include <array>
#include <filesystem>

namespace cellblock {

class SessionDir {
  public:
    SessionDir() = default;
    explicit SessionDir(std::filesystem::path root) : root_(std::move(root)) {}

    const std::filesystem::path& root() const { return root_; }
    bool empty() const { return root_.empty(); }

    // flock'ed by the session's owner while it lives: a reaper in another
    // cellblock process skips a held one. Made as lock_staging() and renamed
    // once held, so no reaper sees it unheld.
    std::filesystem::path lock() const { return root_ / "lock"; }
    std::filesystem::path lock_staging() const { return root_ / "lock.new"; }
    // The OCI runtime that runs the sandbox ("runc", "runsc"), or "zygote"
    // for a forked session: the reaper deletes it with the same one.
    std::filesystem::path runtime_file() const { return root_ / "runtime"; }

    // The sandbox's /run/cellblock: a small tmpfs, root's and sticky, where
    // the kernel binds its sockets and reads its connection file.
    std::filesystem::path ipc() const { return root_ / "ipc"; }
    // Root-only, inside ipc(): the server's hard links to the kernel's
    // sockets, the only paths it connects to.
    std::filesystem::path server_links() const { return ipc() / ".server"; }
    std::filesystem::path connection_file() const { return ipc() / "kernel.json"; }
    // The prefix of the kernel's ipc sockets (k-1 .. k-5).
    std::filesystem::path kernel_sockets() const { return ipc() / "k"; }
    std::filesystem::path zygote_socket() const { return ipc() / "zygote.sock"; }
    std::filesystem::path lifeline_socket() const { return ipc() / "lifeline.sock"; }

    // /data/input (read-only in the sandbox) and /data/output (its own
    // size-capped tmpfs).
    std::filesystem::path input() const { return root_ / "input"; }
    std::filesystem::path output() const { return root_ / "output"; }
    // Where an upload is written before it is renamed into input() (the
    // sandbox cannot see it there).
    std::filesystem::path staging() const { return root_ / "partial"; }
    // The init's stdout and stderr, on a 1 MB tmpfs.
    std::filesystem::path log() const { return root_ / "log"; }
    std::filesystem::path shim_log() const { return log() / "shim.log"; }
    // The OCI bundle: config.json, and the rootfs when the image is the host's.
    std::filesystem::path bundle() const { return root_ / "bundle"; }
    std::filesystem::path bundle_config() const { return bundle() / "config.json"; }
    std::filesystem::path bundle_rootfs() const { return bundle() / "rootfs"; }

    // The subdirectories made with the session, in that order.
    std::array<std::filesystem::path, 5> subdirectories() const {
        return {ipc(), input(), output(), bundle(), log()};
    }
    // The tmpfs mounts, unmounted before the directory is removed.
    std::array<std::filesystem::path, 3> mounts() const { return {ipc(), output(), log()}; }

  private:
    std::filesystem::path root_;
};

}  // namespace cellblock
