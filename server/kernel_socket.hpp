// The server's connections to a sandboxed kernel's sockets, spoken in ZMTP
// by the relay's own thread (RelayTransport::zmtp; relay_socket.hpp).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "cellblock/zmtp.hpp"
#include "relay_socket.hpp"

namespace cellblock {

// A unix stream connection to `path`, speaking ZMTP as `socket_type`
// ("DEALER" or "SUB"; a SUB subscribes to everything). Retries a refused or
// full listener until `deadline`; throws std::runtime_error naming why.
// `label` names the connection in log lines ("session X kernel shell").
std::unique_ptr<RelaySocket> connect_zmtp_kernel_socket(
    const std::string& path, const std::string& socket_type, const std::string& identity,
    zmtp::Limits limits, std::string label, std::chrono::steady_clock::time_point deadline);

}  // namespace cellblock
