// Jupyter connection files (tcp and ipc): read, written, turned into endpoints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace cellblock {

enum class Channel { shell, iopub, stdin_, control, hb };

struct ConnectionInfo {
    std::string transport = "tcp";  // "tcp" or "ipc"
    std::string ip = "127.0.0.1";   // for ipc: the path prefix
    int shell_port = 0;
    int iopub_port = 0;
    int stdin_port = 0;
    int control_port = 0;
    int hb_port = 0;
    std::string key;
    std::string signature_scheme = "hmac-sha256";
    std::string kernel_name;
    // CurveZMQ (cellblock's own fields; a Jupyter client ignores them): a
    // kernel whose sockets leave the host (a Swarm node's) binds them as
    // CURVE servers with `curve_secret_key`, and the front connects with
    // `curve_server_key`, the matching public key. Both Z85, 40 characters;
    // empty: the NULL mechanism, as every Jupyter kernel.
    std::string curve_server_key;
    std::string curve_secret_key;
    // A Swarm task's egress tunnel (server/egress_tunnel.hpp), as
    // sandbox_protocol::kEgressTunnelField: in the kernel's file the port it
    // binds, in the front's the port its node publishes; 0, none.
    int egress_port = 0;

    int port(Channel c) const;
    void set_port(Channel c, int port);
    // "tcp://127.0.0.1:5555" or, for ipc, "ipc://<ip>-<port>" as jupyter_client does.
    std::string endpoint(Channel c) const;

    // Throws std::runtime_error naming the field on a missing or mistyped field.
    static ConnectionInfo from_json(const nlohmann::json& j);
    nlohmann::json to_json() const;

    // Throws std::runtime_error("connection file <path>: <why>").
    static ConnectionInfo read(const std::filesystem::path& path);
    // Written with mode 0600, atomically (temporary file + rename).
    void write(const std::filesystem::path& path) const;
};

const char* channel_name(Channel c);

}  // namespace cellblock
