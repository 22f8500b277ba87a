// The manager's requests that read or close sessions (session_list,
// session_info, session_close, session_history), written against the narrow
// service they need, not against the Server: the registry, the table of
// sessions held, a hibernated session's snapshot and what else the backend
// runs. Server provides the service; tests/unit/session_requests_test.cpp
// provides one over a real SQLite registry.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/session_store.hpp"
#include "manager_api.hpp"
#include "session.hpp"

namespace cellblock {

// The host pids of a sandbox's processes (its cgroup's members).
std::vector<pid_t> sandbox_pids(const std::string& container_id);

class SessionService {
  public:
    virtual ~SessionService() = default;
    // Every session the state dir has had, with its executions and events.
    virtual const SessionStore& registry() const = 0;
    // The sessions this server holds (session.hpp).
    virtual SessionTable& sessions() = 0;
    // A hibernated session's snapshot: {bytes, kept_at, age_s}, or null.
    virtual nlohmann::json snapshot(const std::string& session_id) const = 0;
    // What the backend runs besides the sessions, as session_list_reply
    // carries it: warm_sandboxes, zygotes, backend, runtime_root, and nodes
    // and zygotes_refused when there are any (docs/manager-api.md).
    virtual nlohmann::json backend_inventory() const = 0;
};

class SessionRequests {
  public:
    explicit SessionRequests(SessionService& service) : service_(service) {}

    // A request's session_id. Throws RequestError(InvalidRequest).
    static std::string session_id_of(const nlohmann::json& content);
    // The relay of the live session a request names. Throws RequestError:
    // NoSuchSession, or SessionClosed naming why.
    SessionProxy& live(const nlohmann::json& content);

    // Each takes the request's content and returns the reply's.
    nlohmann::json list(const nlohmann::json& content);
    nlohmann::json info(const nlohmann::json& content);
    nlohmann::json close(const nlohmann::json& content);
    nlohmann::json history(const nlohmann::json& content);

  private:
    SessionService& service_;
};

}  // namespace cellblock
