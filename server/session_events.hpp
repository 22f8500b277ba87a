// What watches the server's sessions without being part of them: the audit
// trail (audit_trail.hpp) and the metrics (server_metrics.hpp). The server
// tells every observer of each event with the session it is about; an
// observer keeps no table of sessions of its own. A new concern is a new
// observer, not a field of Server or of Session.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "cellblock/session_store.hpp"

namespace cellblock {

struct EgressEvent;

// The session an event is about: its id, and the image it runs ("" when the
// server no longer holds it, e.g. a gateway event after the session expired).
struct SessionTag {
    const std::string& id;
    const std::string& image;
};

// What a session used over its life, as its close records it.
struct SessionEnd {
    std::string id;
    std::string image;
    std::string reason;
    std::int64_t executions = 0;
    std::uint64_t memory_peak_bytes = 0;
    std::uint64_t cpu_ms = 0;
};

// Each method is an event an observer may ignore: the audit trail has no use
// for a create's latency, the metrics none for a state the registry keeps.
class SessionEvents {
  public:
    SessionEvents() = default;
    virtual ~SessionEvents() = default;
    SessionEvents(const SessionEvents&) = delete;
    SessionEvents& operator=(const SessionEvents&) = delete;

    // Handed its sandbox and answered; `seconds` since the request came in.
    virtual void created(SessionTag /*session*/, bool /*warm*/, double /*seconds*/) {}
    virtual void execution(SessionTag /*session*/, const ExecutionRecord& /*record*/) {}
    // A state the core moved to (session_state.hpp names them).
    virtual void state(SessionTag /*session*/, std::string_view /*state*/) {}
    // A line of the session's history: cpu_*, refused, files, ...
    virtual void event(SessionTag /*session*/, const std::string& /*kind*/,
                       const std::string& /*detail*/) {}
    // A request the egress gateway answered for the session.
    virtual void egress(SessionTag /*session*/, const EgressEvent& /*event*/) {}
    virtual void closed(const SessionEnd& /*end*/) {}
    // A message the relay dropped, in no session's name (SessionIo::rejected).
    virtual void dropped(std::string_view /*where*/, std::string_view /*why*/) {}
};

}  // namespace cellblock
