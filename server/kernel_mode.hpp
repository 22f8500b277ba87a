// `cellblock kernel -f CONNECTION_FILE`: one sandboxed session on the channels
// a Jupyter frontend chose, for as long as the frontend keeps it.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "cellblock/image.hpp"
#include "egress_gateway.hpp"
#include "kernel_socket.hpp"

namespace cellblock {

struct ServerPaths {
    std::filesystem::path state_dir;    // runtime state, sessions, database
    std::filesystem::path libexec_dir;  // cellblock-shim and the kernel launcher
    std::vector<std::filesystem::path> image_dirs;
    // Built and imported images (image_builder.hpp). Empty: serve uses
    // <state_dir>/images, kernel mode /var/lib/cellblock/images.
    std::filesystem::path image_store;
    std::filesystem::path egress_gateway;  // the cellblock-gateway binary

    // Defaults: /run/cellblock; <exe>/../libexec/cellblock; <exe>/cellblock-gateway;
    // images from $CELLBLOCK_IMAGES_DIR, <exe>/../share/cellblock/images, the source tree.
    static ServerPaths defaults();
};

struct KernelModeOptions {
    std::filesystem::path connection_file;
    std::string image = "host";
    std::string runtime;  // empty: the image's
    // The session's limits (SessionLimits' JSON names), over the image's and
    // the server defaults, as a session request's limits are in `serve`.
    nlohmann::json limits = nlohmann::json::object();
    ServerPaths paths;
    // The nice value of the relay's loop and I/O threads (relay_priority.hpp).
    int relay_nice = -10;
    // How the relay speaks to the kernel's sockets (kernel_socket.hpp).
    RelayTransport kernel_transport = RelayTransport::zmtp;
    RelayTransport client_transport = RelayTransport::zmtp;
    // The egress gateway, as `serve` has it: with --egress-allow, a kernel
    // whose limits say network.mode gateway gets one (docs/network.md).
    EgressSettings egress;
};

// Returns the process exit code: 0 after a requested shutdown, a signal, or
// the session's idle timeout or lifetime; 1 when the kernel died or was killed
// (memory limit, execution timeout, ignored interrupt) or the sandbox could
// not start, so that jupyter_client's restarter starts a fresh kernel.
int run_kernel_mode(const KernelModeOptions& options);

struct KernelspecOptions {
    std::string name = "cellblock-python";
    std::optional<std::filesystem::path> prefix;       // <prefix>/share/jupyter/kernels
    bool user = false;                                 // ~/.local/share/jupyter/kernels
    std::vector<std::string> extra_args;               // appended to `cellblock kernel -f ...`
    nlohmann::json limits = nlohmann::json::object();  // written as `--limit KEY=VALUE`
    std::string image;                                 // empty: the kernel's or server's default
    // Instead of starting `cellblock kernel`, jupyter_client's
    // cellblock-provisioner (clients/python) takes a session from the
    // server whose server.json is `server_file` (empty: the provisioner's default).
    bool provisioner = false;
    std::string server_file;
};

// Writes <dir>/<name>/kernel.json and returns its path.
std::filesystem::path install_kernelspec(const KernelspecOptions& options);

}  // namespace cellblock
