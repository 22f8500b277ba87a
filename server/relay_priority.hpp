// The relay's threads are given priority over the sandboxes on the CPU.
//
// Every message between a client and a kernel passes through the server's
// loop thread and libzmq's I/O thread. On a busy host each hand-off waits for
// a run queue behind the sandboxes' own work, which is what made the relay
// cost 1.7-2.4x a bare kernel under load (bench figure 2, 4). A lower nice
// value for those two threads (inherited by the I/O thread, which the ZMQ
// context starts after this call) shortens the wait. The sandboxes never
// inherit it: run_process() puts a child back to nice 0 at least, and the
// pool's workers set their own nice per job.
//
// The server's threads also run with EEVDF's shortest slice, so that a
// message waking one of them may preempt a sandbox's long-running task at
// once rather than wait out its slice (sched_slice.hpp). Unlike the nice
// value the sandboxes do inherit this: a session starts interactive, and
// serve's CPU fairness puts a session holding the CPU back to the default.
#pragma once

#include <cstdint>

namespace cellblock {

// Sets the calling thread's nice value; call before the ZMQ context exists.
// 0 leaves it alone. A refusal (no CAP_SYS_NICE) is logged and ignored: the
// server still works, only without the priority.
void give_relay_priority(int nice);

// Sets the calling thread's slice to `us` microseconds (0 leaves it alone),
// inherited by every thread and process started after; call before any. A
// refusal is logged and ignored.
void give_interactive_slice(std::uint32_t us);

}  // namespace cellblock
