// A session's way out through the egress gateway (docs/network.md), in
// whatever sandbox it is in now. A local sandbox's code reaches the
// gateway's listener in its own ipc dir. A Swarm task's cannot: its kernel
// carries the forwarder's connections over the egress tunnel
// (server/egress_tunnel.hpp), and the front bridges them to a listener of
// the gateway's in STATE_DIR/remote-egress/<session>/ (0700, root's), so the
// gateway and everything it holds stay on this machine.
#include <sys/stat.h>

#include "server.hpp"

namespace cellblock {

fs::path Server::remote_egress_dir(const std::string& session_id) const {
    return settings_.state_dir / kRemoteEgressDir / session_id;
}

std::unique_ptr<EgressTunnel> Server::open_egress(const std::string& session_id, Sandbox& sandbox,
                                                  const SessionLimits& limits) {
    if (!egress_) throw std::runtime_error("the server has no egress gateway");
    const auto lifetime = std::chrono::seconds(static_cast<std::int64_t>(limits.lifetime_s) + 3600);
    if (const HostProcess* host = sandbox.host_process()) {
        egress_->add_session(session_id, host->session_dir().ipc(), limits.network, lifetime);
        return nullptr;
    }
    const ConnectionInfo& kernel = sandbox.inner_connection();
    if (kernel.egress_port == 0 || kernel.curve_server_key.empty()) {
        throw std::runtime_error("the " + sandbox.runtime() +
                                 " backend's sandbox has neither an ipc directory here nor an "
                                 "egress tunnel");
    }
    const fs::path dir = remote_egress_dir(session_id);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec)
        throw std::runtime_error("the session's egress dir " + dir.string() + ": " + ec.message());
    ::chmod(dir.parent_path().c_str(), 0700);
    ::chmod(dir.c_str(), 0700);
    // The trust store the gateway wrote beside its listener goes to the task
    // with the tunnel's hello.
    const std::string trust_store = egress_->add_session(session_id, dir, limits.network, lifetime);
    EgressTunnelSettings tunnel;
    tunnel.session_id = session_id;
    tunnel.endpoint = "tcp://" + kernel.ip + ":" + std::to_string(kernel.egress_port);
    tunnel.server_key = kernel.curve_server_key;
    tunnel.gateway_socket = dir / sandbox_protocol::kEgressSocketName;
    tunnel.trust_store = trust_store;
    tunnel.signing_key = kernel.key;
    return std::make_unique<EgressTunnel>(loop_, context_, std::move(tunnel));
}

void Server::close_egress(const std::string& session_id) {
    if (!egress_) return;
    egress_->remove_session(session_id);
    if (Session* session = sessions_.find(session_id)) session->egress_tunnel().reset();
    std::error_code ec;
    fs::remove_all(remote_egress_dir(session_id), ec);
}

}  // namespace cellblock
