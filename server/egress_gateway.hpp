// The server's side of the egress gateway (gateway/gateway.hpp,
// docs/egress.md): starts the unprivileged cellblock-gateway process, gives it
// one listening socket per session whose limits say network.mode gateway (the
// session's /run/cellblock/egress.sock), takes it back when the session
// closes, and reads the gateway's per-connection events for the audit trail.
// A gateway that dies is started again and given every session it served.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/session_policy.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

inline constexpr const char* kEgressSocketName = "egress.sock";

struct EgressOptions {
    std::filesystem::path binary;                // cellblock-gateway
    std::vector<std::string> private_ranges;     // CIDRs the operator opts in (tests' loopback)
    std::map<std::string, std::string> resolve;  // name -> address, instead of DNS
    uid_t uid = 65534;  // the gateway's user and group when the server is root
    gid_t gid = 65534;
};

class EgressGateway {
  public:
    // Checks the options (throws std::runtime_error naming the bad one) and
    // starts the gateway.
    explicit EgressGateway(EgressOptions options);
    ~EgressGateway();
    EgressGateway(const EgressGateway&) = delete;
    EgressGateway& operator=(const EgressGateway&) = delete;

    // The socket to watch: readable when events came or the gateway died.
    // It changes when the gateway is restarted (read_events() says so).
    int control_fd() const { return control_.get(); }
    pid_t pid() const { return pid_; }

    // Listens at `socket_path` (mode 0666: the directory is the session's
    // own) and hands the listener to the gateway. Throws on failure.
    void add_session(const std::string& session_id, const std::filesystem::path& socket_path,
                     const NetworkLimits& network);
    void remove_session(const std::string& session_id);

    // The events waiting (JSON objects, gateway.hpp). Sets `restarted` when the
    // gateway had died and was started again (control_fd() changed).
    std::vector<nlohmann::json> read_events(bool& restarted);

  private:
    void start();
    void stop();
    void send(const nlohmann::json& message, int fd = -1);

    struct Entry {
        UniqueFd listener;
        nlohmann::json network;
    };
    EgressOptions options_;
    UniqueFd control_;
    pid_t pid_ = -1;
    std::map<std::string, Entry> sessions_;
};

}  // namespace cellblock
