#include "audit_trail.hpp"

#include <spdlog/spdlog.h>

#include "egress_gateway.hpp"

namespace cellblock {
namespace {

template <typename Write>
void write(Write&& w) {
    try {
        w();
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

}  // namespace

void AuditTrail::execution(SessionTag, const ExecutionRecord& record) { queue_.push_back(record); }

void AuditTrail::state(SessionTag session, std::string_view state) {
    // idle and busy change twice per execution and are served from memory
    // (session_list, session_info); closing lasts only inside a close, and
    // closed is written with its reason and figures by closed(). The
    // registry keeps the states a session can be found in after this
    // process is gone (session_state.hpp).
    if (state == "idle" || state == "busy" || state == "closing" || state == "closed") return;
    write([&] { store_.set_state(session.id, std::string(state)); });
}

void AuditTrail::event(SessionTag session, const std::string& kind, const std::string& detail) {
    write([&] { store_.add_event({session.id, unix_now(), kind, detail}); });
}

void AuditTrail::egress(SessionTag session, const EgressEvent& event) {
    this->event(session, "egress", event.detail.dump());
}

void AuditTrail::closed(const SessionEnd& end) {
    write([&] {
        const double at = unix_now();
        store_.close_session(end.id, end.reason, at, end.executions, end.memory_peak_bytes,
                             end.cpu_ms);
        store_.add_event({end.id, at, "closed", end.reason});
    });
}

void AuditTrail::flush() {
    for (const auto& record : queue_) write([&] { store_.add_execution(record); });
    queue_.clear();
}

}  // namespace cellblock
