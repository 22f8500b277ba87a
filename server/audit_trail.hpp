// The audit trail: the observer that writes what sessions did to the
// registry (SessionStore): each execution, the states a session can be found
// in after this process is gone, every event of its history, and its close
// with what it used. Executions wait in a queue until flush(): the SQLite
// write then overlaps the client's receive instead of delaying the idle
// status behind it. A write that fails is logged, never thrown into the relay.
#pragma once

#include <vector>

#include "cellblock/session_store.hpp"
#include "session_events.hpp"

namespace cellblock {

class AuditTrail final : public SessionEvents {
  public:
    explicit AuditTrail(SessionStore& store) : store_(store) {}

    void execution(SessionTag session, const ExecutionRecord& record) override;
    void state(SessionTag session, std::string_view state) override;
    void event(SessionTag session, const std::string& kind, const std::string& detail) override;
    void egress(SessionTag session, const EgressEvent& event) override;
    void closed(const SessionEnd& end) override;

    // Writes the executions queued; called before any request that reads
    // the history, and after each turn of the loop.
    void flush();
    std::size_t queued() const { return queue_.size(); }

  private:
    SessionStore& store_;
    std::vector<ExecutionRecord> queue_;
};

}  // namespace cellblock
