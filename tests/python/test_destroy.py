"""Destroy on close, checked from the host.

However a cellblock kernel ends — a client's shutdown_request, SIGTERM, or
SIGKILL of the cellblock process — nothing of its sandbox may remain on the
host: no runc container, no session directory, no mount, no cgroup, no
process. After SIGKILL the sandbox ends itself (its init holds a lifeline
socket to the server), and the next cellblock process reaps what is left on
disk and in the kernel's tables.

Other tests may run sandboxes at the same time on this host, so every check
is scoped to the session under test (found from the lock file its cellblock
process holds), and conftest's host_residue() is filtered to that session.
"""
import glob
import os
import queue
import signal
import subprocess
import tempfile
import time

import pytest
from jupyter_client.manager import KernelManager

from conftest import (KERNEL_NAME, STATE_DIR, host_residue, run_cell, session_dirs,
                      stream_text, wait_for)
from server_helpers import alive, proc_state, session_of_process, session_pids

RUNTIME_ROOT = os.path.join(STATE_DIR, "runtime")
SESSIONS = os.path.join(STATE_DIR, "sessions")


# ---------------------------------------------------------------- helpers

class LoggedKernel:
    """A cellblock kernel started through jupyter_client with its stderr in a file."""

    def __init__(self):
        fd, self.log_path = tempfile.mkstemp(prefix="cellblock-destroy-", suffix=".log")
        self._log_file = os.fdopen(fd, "w")
        self.km = KernelManager(kernel_name=KERNEL_NAME)
        self.km.start_kernel(env=dict(os.environ), stderr=self._log_file)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.proc = self.km.provisioner.process
        self.sid = session_id_of(self.proc.pid)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self):
        try:
            self.kc.stop_channels()
        finally:
            try:
                if self.km.has_kernel:
                    self.km.shutdown_kernel(now=self.proc.poll() is not None)
            finally:
                self._log_file.close()
                os.unlink(self.log_path)


def session_id_of(pid, timeout=10):
    """The session a cellblock process runs: the one whose lock file it holds."""
    return session_of_process(pid, SESSIONS, timeout)


def sandbox_pids(sid, include_zombies=True):
    return session_pids(sid, include_zombies=include_zombies)


def session_residue(sid, pids=(), include_zombies=True):
    """Everything of session `sid` the host still holds, checked from the host.

    pids: host pids the session's processes had; they are checked by pid too,
    since a dying process may already have left its cgroup.
    """
    residue = {}
    cid = f"cb-{sid}"
    listed = subprocess.run(["runc", "--root", RUNTIME_ROOT, "list", "-q"],
                            capture_output=True, text=True).stdout.split()
    if cid in listed:
        residue["runc container"] = cid
    if os.path.exists(os.path.join(RUNTIME_ROOT, cid)):
        residue["runc state dir"] = os.path.join(RUNTIME_ROOT, cid)
    session_dir = os.path.join(SESSIONS, sid)
    if os.path.exists(session_dir):
        residue["session dir"] = sorted(
            os.path.relpath(os.path.join(d, n), session_dir)
            for d, dirs, files in os.walk(session_dir) for n in dirs + files)[:20] or session_dir
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if sid in line.split()[4]]
    if mounts:
        residue["mounts"] = mounts
    cgroups = glob.glob(f"/sys/fs/cgroup/*/cellblock/{cid}") + \
        glob.glob(f"/sys/fs/cgroup/cellblock/{cid}")
    if cgroups:
        residue["cgroups"] = cgroups
    procs = set(sandbox_pids(sid, include_zombies))
    procs |= {pid for pid in pids
              if proc_state(pid) is not None and (include_zombies or proc_state(pid) != "Z")}
    if procs:
        residue["processes"] = {pid: proc_state(pid) for pid in sorted(procs)}
    # conftest's own view, limited to this session.
    for kind, items in host_residue().items():
        if kind == "processes":
            continue  # covered above, by cgroup and by pid
        mine = [item for item in items if sid in item]
        if mine:
            residue[f"host_residue {kind}"] = mine
    return residue


def assert_nothing_left(sid, pids):
    # Right away: nothing cellblock owns, and no process still running.
    now = session_residue(sid, pids, include_zombies=False)
    assert now == {}, f"session {sid} left: {now}"
    # A killed sandbox init is reparented to the host's PID 1 (not to cellblock),
    # which reaps it on its own schedule: allow a moment for the zombie entry.
    assert wait_for(lambda: not session_residue(sid, pids), timeout=10), \
        f"session {sid} left: {session_residue(sid, pids)}"


def assert_present(sid):
    """The session really had all the things whose absence is checked later."""
    r = session_residue(sid)
    for kind in ("runc container", "runc state dir", "session dir", "mounts", "cgroups",
                 "processes"):
        assert kind in r, f"session {sid} has no {kind} while running: the check proves nothing"
    assert len(r["processes"]) >= 3, r["processes"]
    return r


# Leaves files in every writable place and a double-forked daemon that
# ignores the polite signals, so that teardown has real work to do.
BUSY_SANDBOX = r"""
import os, subprocess, time
for d in ['/tmp', os.path.expanduser('~'), '/data/output', '/dev/shm']:
    with open(os.path.join(d, 'leftover.bin'), 'wb') as f:
        f.write(os.urandom(1 << 20))
daemon = subprocess.Popen(
    ['/bin/sh', '-c', 'trap "" TERM HUP INT; (trap "" TERM HUP INT; exec sleep 600) & '
                      'while :; do date > /tmp/heartbeat; sleep 0.2; done'],
    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL)
time.sleep(0.5)
print('daemon', daemon.pid, os.path.exists('/tmp/heartbeat'))
"""


def closed_line(kernel, why):
    """The server's log line saying this session closed, and why."""
    return [line for line in kernel.log().splitlines()
            if f"session {kernel.sid}: closed (" in line and why in line]


def make_busy(kernel):
    reply, outputs = run_cell(kernel.kc, BUSY_SANDBOX)
    assert reply["status"] == "ok", reply
    assert stream_text(outputs).strip().endswith("True"), stream_text(outputs)


# ---------------------------------------------------------------- tests

def test_shutdown_request_leaves_nothing():
    kernel = LoggedKernel()
    try:
        sid = kernel.sid
        make_busy(kernel)
        assert_present(sid)
        pids = sandbox_pids(sid)
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)
        # cellblock ended by itself, after answering the request (jupyter_client
        # would have SIGKILLed it after its wait otherwise).
        assert kernel.proc.returncode == 0, (kernel.proc.returncode, kernel.log())
        assert closed_line(kernel, "shutdown requested"), kernel.log()
        assert_nothing_left(sid, pids)
    finally:
        kernel.close()


def _wait_busy(kc, msg_id, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                and msg["content"]["execution_state"] == "busy":
            return True
    return False


def _shell_reply(kc, msg_id, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_shell_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg
    return None


def test_sigterm_leaves_nothing_and_answers_the_pending_request():
    kernel = LoggedKernel()
    try:
        sid = kernel.sid
        make_busy(kernel)
        assert_present(sid)
        pids = sandbox_pids(sid)
        msg_id = kernel.kc.execute("import time; time.sleep(120)")
        assert _wait_busy(kernel.kc, msg_id), "the long cell never started"
        os.kill(kernel.proc.pid, signal.SIGTERM)
        assert kernel.proc.wait(timeout=20) == 0, kernel.log()
        assert closed_line(kernel, "server_shutdown"), kernel.log()
        # The client is told, rather than left waiting for a reply forever,
        # with the server's own name for it and the signal.
        reply = _shell_reply(kernel.kc, msg_id, timeout=5)
        assert reply is not None, "the pending execute_request got no reply on SIGTERM"
        assert reply["content"]["status"] == "error", reply["content"]
        assert reply["content"]["ename"] == "ServerShuttingDown", reply["content"]
        assert "the server is shutting down (SIGTERM)" in reply["content"]["evalue"], \
            reply["content"]
        assert_nothing_left(sid, pids)
    finally:
        kernel.close()


def test_sigkill_sandbox_ends_itself_and_next_start_reaps_it():
    before = set(session_dirs())
    killed = LoggedKernel()
    try:
        sid = killed.sid
        new_dirs = set(session_dirs()) - before
        assert os.path.join(SESSIONS, sid) in new_dirs, (sid, new_dirs)
        make_busy(killed)
        present = assert_present(sid)
        pids = sandbox_pids(sid)
        mounts = present["mounts"]
        cgroups = present["cgroups"]

        os.kill(killed.proc.pid, signal.SIGKILL)
        assert killed.proc.wait(timeout=10) == -signal.SIGKILL

        # The sandbox's init sees the lifeline close and takes every process with it.
        assert wait_for(lambda: not alive(pids), timeout=5), \
            f"sandbox processes outlived the killed server: { {p: proc_state(p) for p in alive(pids)} }"
        with open(os.path.join(SESSIONS, sid, "log", "shim.log"), errors="replace") as f:
            shim_log = f.read()
        assert "server gone" in shim_log, shim_log
        # What only a cellblock process can clean is still there (nobody ran teardown)...
        assert os.path.isdir(os.path.join(SESSIONS, sid)), \
            "the killed session's dir vanished before any cellblock process reaped it"
        leftover = session_residue(sid, pids, include_zombies=False)
    finally:
        killed.close()

    # ...until the next cellblock process starts.
    successor = LoggedKernel()
    try:
        assert successor.sid != sid
        log = successor.log()
        remaining = session_residue(sid, pids, include_zombies=False)
        assert remaining == {}, f"after the next start, killed session {sid} left: {remaining}"
        for path in (os.path.join(RUNTIME_ROOT, f"cb-{sid}"),
                     os.path.join(SESSIONS, sid, "bundle"),
                     os.path.join(SESSIONS, sid, "ipc", "kernel.json"),
                     os.path.join(SESSIONS, sid, "log", "shim.log"),
                     *mounts, *cgroups):
            assert not os.path.exists(path), f"{path} survived the reaping"
        with open("/proc/self/mountinfo") as f:
            assert not [m for m in mounts if m in f.read()], "a mount of the killed session remains"
        assert wait_for(lambda: not session_residue(sid, pids), timeout=10), \
            session_residue(sid, pids)
        # The reaping was this process's doing, and it said so — unless another
        # cellblock process on this host got there first.
        if leftover:
            reaped_line = f"reaped session {sid} left by an earlier cellblock process"
            assert reaped_line in log or _other_cellblock_running({successor.proc.pid}), log
        # The new session works.
        reply, outputs = run_cell(successor.kc, "print(6 * 7)")
        assert stream_text(outputs).strip() == "42", (reply, outputs)
        next_pids = sandbox_pids(successor.sid)
        successor.kc.stop_channels()
        successor.km.shutdown_kernel(now=False)
        assert_nothing_left(successor.sid, next_pids)
    finally:
        successor.close()


def _other_cellblock_running(ours):
    """True if a cellblock kernel process other than `ours` runs on this host."""
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"cellblock") and argv[1] == b"kernel":
            if int(path.split("/")[2]) not in ours:
                return True
    return False


@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_output_and_ipc_tmpfs_do_not_outlive_the_session(how):
    """The host-side tmpfs mounts (ipc, output) go with the session, data and all."""
    kernel = LoggedKernel()
    try:
        sid = kernel.sid
        session_dir = os.path.join(SESSIONS, sid)
        reply, _ = run_cell(kernel.kc, "open('/data/output/result.csv', 'w').write('a,b\\n1,2\\n')")
        assert reply["status"] == "ok", reply
        assert os.path.exists(os.path.join(session_dir, "output", "result.csv"))
        pids = sandbox_pids(sid)
        if how == "shutdown":
            kernel.kc.stop_channels()
            kernel.km.shutdown_kernel(now=False)
        else:
            os.kill(kernel.proc.pid, signal.SIGTERM)
            kernel.proc.wait(timeout=20)
        with open("/proc/self/mountinfo") as f:
            assert session_dir not in f.read()
        assert not os.path.exists(session_dir)
        assert_nothing_left(sid, pids)
    finally:
        kernel.close()


def test_kernel_death_closes_the_session_and_leaves_nothing():
    """A session closes when its kernel dies; the client learns why, the host is clean."""
    kernel = LoggedKernel()
    try:
        sid = kernel.sid
        make_busy(kernel)
        pids = sandbox_pids(sid)
        reply, outputs = run_cell(kernel.kc, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                                  timeout=30)
        assert reply["status"] == "error", reply
        assert reply["ename"] == "KernelDied", reply
        assert "signal 9" in reply["evalue"], reply
        assert [m["content"]["ename"] for m in outputs if m["msg_type"] == "error"] == ["KernelDied"]
        assert kernel.proc.wait(timeout=15) == 1, kernel.log()
        assert closed_line(kernel, "killed by signal 9"), kernel.log()
        assert_nothing_left(sid, pids)
    finally:
        kernel.close()


def test_a_kernel_that_outlives_its_inits_sigterm_is_ended_and_named_so():
    """The init told to stop (here by its own kernel: a signal the shim blocks
    is queued even from inside its PID namespace) passes SIGTERM on; a kernel
    that ignores it is ended with the sandbox 2 s later, and the shim's
    `kernel-exit terminated` reaches the client in words
    (include/cellblock/sandbox_protocol.hpp)."""
    kernel = LoggedKernel()
    try:
        sid = kernel.sid
        pids = sandbox_pids(sid)
        code = ("import os, signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "os.kill(1, signal.SIGTERM)\n"
                "time.sleep(60)")
        reply, outputs = run_cell(kernel.kc, code, timeout=30)
        assert reply["status"] == "error", reply
        assert reply["ename"] == "KernelDied", reply
        assert "told to stop" in reply["evalue"] and "SIGTERM" in reply["evalue"], reply
        assert kernel.proc.wait(timeout=15) == 1, kernel.log()
        assert closed_line(kernel, "told to stop"), kernel.log()
        assert_nothing_left(sid, pids)
    finally:
        kernel.close()
