// The server's side of the egress gateway (gateway/gateway.hpp,
// docs/network.md): starts the unprivileged cellblock-gateway process, gives it
// one listening socket per session whose limits say network.mode gateway (the
// session's /run/cellblock/egress.sock), takes it back when the session
// closes, and reads the gateway's per-connection events for the audit trail.
// A gateway that dies is started again and given every session it served.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/unique_fd.hpp"
#include "event_loop.hpp"

namespace cellblock {

inline constexpr const char* kEgressSocketName = sandbox_protocol::kEgressSocketName;
// The trust store a gateway session's code uses (SSL_CERT_FILE and friends
// name it): the host's CA bundle, plus the session's own CA when it has secrets.
inline constexpr const char* kEgressCaBundleName = "ca-certificates.crt";
inline constexpr const char* kSystemCaBundle = "/etc/ssl/certs/ca-certificates.crt";

// The value of a secret reference (NetworkSecret::value_from): the server's
// environment variable, or a regular file only the server's user can read
// (at most 8 KiB, a final newline dropped). Throws std::runtime_error naming
// the reference (never the value) when it is missing, readable by others, or
// holds a line break.
std::string read_secret(const std::string& value_from);

struct EgressOptions {
    std::filesystem::path binary;                // cellblock-gateway
    std::vector<std::string> private_ranges;     // CIDRs the operator opts in (tests' loopback)
    std::map<std::string, std::string> resolve;  // name -> address, instead of DNS
    std::string extra_ca_file;  // PEM the gateway trusts upstream besides the system's
    bool dns = true;            // false (--egress-no-dns): names outside `resolve` do not resolve
    uid_t uid = 65534;          // the gateway's user and group when the server is root
    gid_t gid = 65534;
};

// What `cellblock serve` and `cellblock kernel` take on their command lines
// for the gateway (--egress-*; docs/network.md), the same in both modes.
struct EgressSettings {
    std::vector<std::string> allow;              // --egress-allow HOST:PORT patterns
    std::vector<std::string> secrets;            // --egress-secret HOST:HEADER=SOURCE
    std::vector<std::string> private_ranges;     // --egress-private CIDR
    std::map<std::string, std::string> resolve;  // --egress-resolve NAME=ADDRESS
    std::string user = "nobody";                 // --egress-user
    std::string ca;                              // --egress-ca FILE
    bool no_dns = false;                         // --egress-no-dns

    // Parses one --egress-resolve NAME=ADDRESS into `resolve`; throws
    // std::runtime_error naming it when it is not that.
    void add_resolve(const std::string& item);
    // The server's maximum from --egress-allow and --egress-secret: no
    // session reaches beyond these, and a session that asks for the gateway
    // without a list of its own gets them all (policy.maxima.network and
    // policy.defaults.network). Throws std::runtime_error naming the bad flag.
    void apply_to(ServerPolicy& policy) const;
    // Throws std::runtime_error when flags that only a gateway uses
    // (--egress-private, --egress-resolve, --egress-ca) come without one.
    void check(const NetworkLimits& maxima) const;
};

class EgressGateway;

// The gateway a server with these settings runs: started when `maxima` say
// gateway (after checking the user, the secrets' sources and the CA file),
// null when they do not (and then the other --egress-* flags are refused,
// since they would do nothing). Throws std::runtime_error.
std::unique_ptr<EgressGateway> start_egress_gateway(const EgressSettings& settings,
                                                    const NetworkLimits& maxima,
                                                    const std::filesystem::path& binary);

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

    // Listens at ipc_dir/egress.sock (mode 0666: the directory is the
    // session's own), writes ipc_dir/ca-certificates.crt, and hands the
    // listener to the gateway with the limits; with secrets, also their
    // values and a new CA valid for `lifetime`, whose key only the gateway
    // keeps. Returns that trust store (what it wrote). Throws on failure.
    std::string add_session(const std::string& session_id, const std::filesystem::path& ipc_dir,
                            const NetworkLimits& network, std::chrono::seconds lifetime);
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
        nlohmann::json add;  // the add message (with secrets' values: kept in memory only)
    };
    std::string extra_ca_;
    EgressOptions options_;
    UniqueFd control_;
    pid_t pid_ = -1;
    std::map<std::string, Entry> sessions_;
};

// One of the gateway's events (a connection or a request: gateway.hpp), as
// a server records it.
struct EgressEvent {
    std::string session_id;
    std::uint64_t bytes = 0;  // up and down: what counts against the session's caps
    bool allowed = false;
    nlohmann::json detail;  // the event without "op" and "session"
};

// Calls `on_event` from `loop` for each event the gateway reports, and
// follows a restarted gateway to its new control socket. Stops watching
// when destroyed; the gateway must outlive it.
class EgressEvents {
  public:
    using Handler = std::function<void(const EgressEvent&)>;
    EgressEvents(EventLoop& loop, EgressGateway& gateway, Handler on_event);
    ~EgressEvents();
    EgressEvents(const EgressEvents&) = delete;
    EgressEvents& operator=(const EgressEvents&) = delete;

  private:
    void read();

    EventLoop& loop_;
    EgressGateway& gateway_;
    Handler on_event_;
    EventLoop::WatchId watch_ = 0;
};

}  // namespace cellblock
