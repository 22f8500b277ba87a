// A client of a running server's manager socket (what the CLI uses).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
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

    // The two halves of call(), for requests kept in flight together: send()
    // returns the request's msg_id; wait() returns its reply, keeping replies
    // to other requests for their own wait().
    std::string send(const std::string& type, nlohmann::json content,
                     std::vector<std::string> buffers = {});
    WireMessage wait(const std::string& msg_id, const std::string& type,
                     std::chrono::milliseconds timeout = std::chrono::seconds(120));

    // Called with bytes done and the file's size as a transfer moves.
    using Progress = std::function<void(std::uint64_t done, std::uint64_t total)>;
    // Streams a local file to the session's /data/input/<remote> in chunks
    // (file_put_begin/chunk/commit, sha256 checked by the server); returns
    // the commit's reply content. Throws std::runtime_error("ename: evalue").
    nlohmann::json put_file(const std::string& session_id, const std::filesystem::path& local,
                            const std::string& remote, const Progress& progress = {});
    // Streams /data/output/<remote> to `local` (written beside it, checked
    // against the server's sha256, then renamed into place); returns
    // {path, size, sha256}.
    nlohmann::json get_file(const std::string& session_id, const std::string& remote,
                            const std::filesystem::path& local, const Progress& progress = {});

  private:
    zmq::context_t context_{1};
    zmq::socket_t socket_{context_, zmq::socket_type::dealer};
    std::string key_;
    Signer signer_{""};
    std::string session_ = make_uuid();
    std::map<std::string, WireMessage> early_;  // replies that came before their wait()
};

}  // namespace cellblock
