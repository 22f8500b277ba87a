"""The relay's threads run above the sandboxes on the CPU, and the sandboxes
never get that priority.

`cellblock serve` and `cellblock kernel` lower the nice value of their loop
thread and libzmq's I/O thread (`--relay-nice`, default -10): on a busy host
every message between client and kernel waits for them. (With the default
ZMTP transports the loop thread is the only one a session's messages cross.) The
sandbox must not inherit it: its processes run at nice 0 or above, and code in
it cannot take a negative nice for itself (no CAP_SYS_NICE)."""
import os

from conftest import start_kernel, stop_kernel
from server_helpers import execute, process_nice, server_factory, session_pids, stream_text  # noqa: F401

PRIORITY_PROBE = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
TAKE_PRIORITY = ("import os\n"
                 "try:\n"
                 "    os.setpriority(os.PRIO_PROCESS, 0, -10)\n"
                 "    print('raised', os.getpriority(os.PRIO_PROCESS, 0))\n"
                 "except PermissionError as e:\n"
                 "    print('refused', e.errno)\n")


def thread_nice(pid):
    """{thread name: [nice, ...]} of a process's threads (/proc/PID/task/*/stat, field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out.setdefault(name, []).append(int(fields[16]))  # field 19 is the 17th after ")"
    return out


def assert_relay_threads_at(pid, nice, libzmq=True):
    """The loop thread, and libzmq's I/O thread where there is one, at `nice`.
    `cellblock serve` has one for its manager socket; `cellblock kernel`
    speaks ZMTP itself on both sides by default and has none (libzmq=False)."""
    threads = thread_nice(pid)
    io = [v for name, vs in threads.items() if name.startswith("ZMQbg/IO") for v in vs]
    if libzmq:
        assert io, f"no libzmq I/O thread among {threads}"
        assert set(io) == {nice}, threads
    else:
        assert not io, f"a libzmq I/O thread in a relay that should need none: {threads}"
    assert process_nice(pid) == nice, threads  # the loop thread (the main one)
    return threads


def test_serve_relay_threads_run_above_sandboxes_which_stay_at_nice_0(server_factory):
    srv = server_factory()
    threads = assert_relay_threads_at(srv.proc.pid, -10)
    # Pool workers fork the runtime: they never run at the relay's priority.
    others = [v for name, vs in threads.items() if not name.startswith("ZMQbg") for v in vs]
    assert any(v >= 0 for v in others), threads
    sid, kc, _ = srv.open_session()
    reply, iopub = execute(kc, PRIORITY_PROBE)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert stream_text(iopub) == "0\n"
    pids = session_pids(sid)
    assert pids, f"no processes in session {sid}'s cgroup"
    assert all(process_nice(p) >= 0 for p in pids), {p: process_nice(p) for p in pids}


def test_code_in_a_sandbox_cannot_take_a_negative_nice(server_factory):
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    reply, iopub = execute(kc, TAKE_PRIORITY)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert stream_text(iopub) == "refused 13\n"  # EACCES
    assert all(process_nice(p) >= 0 for p in session_pids(sid))


def test_relay_nice_0_leaves_the_server_alone(server_factory):
    srv = server_factory(["--relay-nice", "0"])
    assert_relay_threads_at(srv.proc.pid, 0)


def test_kernel_mode_relay_threads_run_above_its_sandbox():
    km, kc = start_kernel()
    try:
        assert_relay_threads_at(km.provisioner.process.pid, -10, libzmq=False)
        reply, iopub = execute(kc, PRIORITY_PROBE)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert stream_text(iopub) == "0\n"
        reply, iopub = execute(kc, TAKE_PRIORITY)
        assert stream_text(iopub) == "refused 13\n"
    finally:
        stop_kernel(km, kc)
