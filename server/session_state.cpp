#include "session_state.hpp"

#include <spdlog/spdlog.h>

namespace cellblock {

std::string_view state_name(SessionState state) {
    switch (state) {
        case SessionState::starting:
            return "starting";
        case SessionState::idle:
            return "idle";
        case SessionState::busy:
            return "busy";
        case SessionState::hibernating:
            return "hibernating";
        case SessionState::hibernated:
            return "hibernated";
        case SessionState::resuming:
            return "resuming";
        case SessionState::adopting:
            return "adopting";
        case SessionState::closing:
            return "closing";
        case SessionState::closed:
            return "closed";
    }
    return "unknown";
}

bool transition_allowed(SessionState from, SessionState to) {
    using S = SessionState;
    if (from == S::closed) return false;
    if (to == S::closing) return from != S::closing;
    switch (from) {
        case S::starting:  // hibernated: handed over asleep; adopting: after a crash
            return to == S::idle || to == S::hibernated || to == S::adopting;
        case S::idle:
            return to == S::busy || to == S::hibernating;
        case S::busy:
            return to == S::idle;
        case S::hibernating:
            return to == S::hibernated || to == S::idle;
        case S::hibernated:
            return to == S::resuming;
        case S::resuming:
            return to == S::idle;
        case S::adopting:
            return to == S::idle;
        case S::closing:
            return to == S::closed;
        case S::closed:
            return false;
    }
    return false;
}

bool SessionLifecycle::go(SessionState to) {
    if (!transition_allowed(state_, to)) {
        spdlog::error("session state: no move from {} to {}", state_name(state_), state_name(to));
        return false;
    }
    state_ = to;
    if (to == SessionState::idle || to == SessionState::busy) attached_ = true;
    return true;
}

bool SessionLifecycle::kernel_live() const {
    switch (state_) {
        case SessionState::idle:
        case SessionState::busy:
        case SessionState::hibernating:
        case SessionState::resuming:  // once its sandbox is attached: the restore is asked
        case SessionState::adopting:  // its sandbox ran on: attached as it is adopted
            return true;
        default:
            return false;
    }
}

}  // namespace cellblock
