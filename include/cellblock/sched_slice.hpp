// EEVDF's per-task slice (Linux 6.12+, sched_setattr's sched_runtime for a
// fair task): how long it may run before the scheduler picks again. A waking
// task whose slice is shorter than the running one's may preempt it at
// once; its share of the CPU is not changed.
//
// The interactive path (the server's threads, and an interactive session's
// tasks) runs with the shortest slice the kernel takes, so that a message
// waking the quiet session's kernel or the relay does not wait out the
// noise's slice (1.4 ms by default here): beside ten spinning sessions a
// quiet session's p99 was 1.4-1.9x its quiet p99 in eleven runs, against
// 1.6-2.2x without (docs/performance.md, "A shorter EEVDF slice"). Only the
// difference counts:
// with every task at the short slice nothing changed, so a session holding
// the CPU (yielding or demoted) is put back to the default.
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace cellblock {

// The kernel's floor for a custom slice (0.1 ms).
inline constexpr std::uint32_t kInteractiveSliceUs = 100;

// Sets task `tid`'s slice to `us` microseconds (0: the kernel's default),
// keeping its policy and nice value; the task's threads and children
// started later inherit it. False, with errno, when the kernel refused. A
// kernel without custom slices (before 6.12) accepts it and changes nothing.
bool set_sched_slice(pid_t tid, std::uint32_t us);

// The slice in microseconds as the kernel reports it (/proc/<tid>/sched,
// se.slice), or -1 when it does not (no such task, or no EEVDF).
std::int64_t sched_slice_us(pid_t tid);

}  // namespace cellblock
