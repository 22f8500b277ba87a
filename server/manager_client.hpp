// A client of a running server's manager socket (what the CLI uses).
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"

namespace cellblock {

class ManagerClient {
  public:
    // Reads STATE_DIR/server.json; throws std::runtime_error if no server runs there.
    explicit ManagerClient(const std::filesystem::path& state_dir);

    // Sends `type` (e.g. "session_create_request") and waits for its reply.
    // Throws std::runtime_error on timeout.
    WireMessage call(const std::string& type, nlohmann::json content,
                     std::vector<std::string> buffers = {},
                     std::chrono::milliseconds timeout = std::chrono::seconds(120));

  private:
    zmq::context_t context_{1};
    zmq::socket_t socket_{context_, zmq::socket_type::dealer};
    std::string key_;
    Signer signer_{""};
    std::string session_ = make_uuid();
};

}  // namespace cellblock
