// A client of a running server's manager socket (what the CLI uses).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
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
    // Stops the socket monitor before either socket closes: libzmq leaks a
    // queued event otherwise (and can block on one; libzmq #3575).
    ~ManagerClient();
    ManagerClient(const ManagerClient&) = delete;
    ManagerClient& operator=(const ManagerClient&) = delete;

    // Sends `type` (e.g. "session_create_request") and waits for its reply.
    // Refused ServerRestarting (a planned restart under way), it sends the
    // same message again once the connection to that process drops, so the
    // next start serves it, within `timeout`. Throws std::runtime_error on
    // timeout.
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
    // How a file moves: by descriptor over the server's local file socket
    // when this process can reach it, else streamed (Auto); or only one way.
    enum class Route { Auto, Stream, Local };
    // Copies a local file to the session's /data/input/<remote>: by descriptor
    // (file_put_local_request), or streamed in chunks (file_put_begin/chunk/
    // commit, sha256 checked by the server); returns the reply's content
    // (path, size, sha256, and local: true when it went by descriptor).
    // Throws std::runtime_error("ename: evalue").
    nlohmann::json put_file(const std::string& session_id, const std::filesystem::path& local,
                            const std::string& remote, const Progress& progress = {},
                            Route route = Route::Auto);
    // Copies /data/output/<remote> to `local` (written beside it, checked
    // against the server's sha256, then renamed into place); returns
    // {path, size, sha256}.
    nlohmann::json get_file(const std::string& session_id, const std::string& remote,
                            const std::filesystem::path& local, const Progress& progress = {},
                            Route route = Route::Auto);

  private:
    // A request signed, as frames; `msg_id` set to its id.
    std::vector<std::string> encoded(const std::string& type, nlohmann::json content,
                                     std::vector<std::string> buffers, std::string& msg_id);
    void send_frames(const std::vector<std::string>& frames);
    // wait(); with `until_dropped`, nullopt once the connection to the
    // server drops, or at the timeout.
    std::optional<WireMessage> wait_for(const std::string& msg_id, const std::string& type,
                                        std::chrono::milliseconds timeout, bool until_dropped);
    // One request on the local file socket with `fd` passed: the reply's
    // content, or nullopt when the socket cannot be reached (and `route` is
    // not Local). Throws std::runtime_error for an error reply.
    std::optional<nlohmann::json> local_copy(const std::string& type, nlohmann::json content,
                                             int fd, const Progress& progress, Route route);
    nlohmann::json stream_put(const std::string& session_id, const std::filesystem::path& local,
                              const std::string& remote, const Progress& progress);
    nlohmann::json stream_get(const std::string& session_id, const std::string& remote,
                              const std::filesystem::path& local, const Progress& progress);

    zmq::context_t context_{1};
    zmq::socket_t socket_{context_, zmq::socket_type::dealer};
    zmq::socket_t monitor_{context_, zmq::socket_type::pair};  // socket_'s disconnections
    std::string key_;
    std::string files_socket_;  // server.json's files_socket, when it offers one
    Signer signer_{""};
    std::string session_ = make_uuid();
    std::map<std::string, WireMessage> early_;  // replies that came before their wait()
};

}  // namespace cellblock
