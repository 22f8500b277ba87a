// A session's lifecycle as named states and the moves between them: the one
// place that says what a session may become next. SessionCore holds one and
// reports every move to its observers (SessionObserver::on_state).
//
//   starting ──▶ idle ◀──▶ busy
//   starting ──▶ hibernated       (handed over asleep by the last server)
//                 │ ▲
//                 ▼ │ (resumed, or hibernation failed)
//           hibernating ──▶ hibernated ──▶ resuming ──▶ idle
//   starting ──▶ adopting ──▶ idle (a sandbox that outlived a crashed server)
//   any state but closed ──▶ closing ──▶ closed
//
// hibernating, hibernated and resuming are a hibernating session's
// (session_sleep.cpp, docs/hibernation.md); adopting is a session whose
// sandbox outlived its server, being taken back (session_adoption.cpp).
#pragma once

#include <cstdint>
#include <string_view>

namespace cellblock {

enum class SessionState : std::uint8_t {
    starting,     // created; its kernel not yet answering
    idle,         // its kernel attached, no execution running
    busy,         // an execution running (more may be queued)
    hibernating,  // its state being saved, its sandbox about to go
    hibernated,   // no sandbox; its state kept to resume from
    resuming,     // a sandbox being given its saved state back
    adopting,     // a restarted server taking over its running sandbox
    closing,      // answering what is pending, releasing its sandbox
    closed,       // gone: only refusals are answered until it expires
};

// The state's name, as the manager API and the history show it.
std::string_view state_name(SessionState state);

// Whether a session in `from` may move to `to` (the drawing above).
bool transition_allowed(SessionState from, SessionState to);

// The current state and the moves made.
class SessionLifecycle {
  public:
    explicit SessionLifecycle(SessionState initial = SessionState::starting) : state_(initial) {}

    SessionState state() const { return state_; }
    // Moves to `to` and says true, or says false and stays where it is if the
    // drawing has no such move (the caller's bug: it is logged).
    bool go(SessionState to);

    // Its kernel answered once (it left starting for a state with a sandbox).
    bool attached() const { return attached_; }
    // closing or closed: no new work is taken.
    bool ending() const {
        return state_ == SessionState::closing || state_ == SessionState::closed;
    }
    // A kernel that can be asked something: attached and not ending.
    bool kernel_live() const;

  private:
    SessionState state_;
    bool attached_ = false;
};

}  // namespace cellblock
