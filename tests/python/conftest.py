"""Shared helpers for cellblock's integration tests.

Everything here talks to real components: the cellblock binary, runc
sandboxes, jupyter_client. The host is inspected directly (/proc, mounts,
cgroups, runc state), never through cellblock's own view of itself.
"""
import atexit
import glob
import os
import queue
import subprocess
import sys
import tempfile
import time

import pytest
from jupyter_client.manager import KernelManager

from server_helpers import wait_for  # noqa: F401 - the kernel-mode tests import it from here

KERNEL_NAME = "cellblock-python"
CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
STATE_DIR = "/run/cellblock/kernels"


def start_kernel(extra_env=None, startup_timeout=60):
    """Starts cellblock-python through jupyter_client, as a frontend would.

    The kernel-mode `cellblock` process logs to a file of its own (its path is
    km.cellblock_log) so that a test whose kernel dies can say why; stop_kernel
    copies the log to stderr, where pytest shows it for a failed test.
    """
    km = KernelManager(kernel_name=KERNEL_NAME)
    env = dict(os.environ)
    env.update(extra_env or {})
    fd, log_path = tempfile.mkstemp(prefix="cellblock-kernel-", suffix=".log", dir="/var/tmp")
    with os.fdopen(fd, "wb") as log:
        km.start_kernel(env=env, stdout=log, stderr=log)
    km.cellblock_log = log_path
    atexit.register(_remove, log_path)   # for a kernel whose test never stops it
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except (RuntimeError, TimeoutError) as e:
        # Reaped and killed here: a failed start must not leave a zombie or a sandbox.
        detail = kernel_death(km) or "the process is still running"
        stop_kernel(km, kc, now=True)
        raise AssertionError(f"cellblock-python did not become ready ({e}); {detail}") from None
    return km, kc


def _remove(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def kernel_log(km, tail=6000):
    """The end of the kernel-mode cellblock process's own log."""
    try:
        with open(km.cellblock_log, errors="replace") as f:
            return f.read()[-tail:]
    except (AttributeError, OSError):
        return ""


def kernel_death(km):
    """None while the kernel-mode cellblock process runs; once it has exited (it is
    reaped here, never left a zombie), a sentence with its exit status and its log."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None or process.poll() is None:
        return None
    return (f"the kernel-mode cellblock process {process.pid} exited with {process.returncode}; "
            f"its log {getattr(km, 'cellblock_log', '?')} ends:\n{kernel_log(km)}")


def stop_kernel(km, kc, now=False):
    try:
        kc.stop_channels()
    finally:
        try:
            if km.has_kernel:
                km.shutdown_kernel(now=now)
        finally:
            log = getattr(km, "cellblock_log", None)
            if log:
                text = kernel_log(km, tail=20000)
                if text:
                    sys.stderr.write(f"--- cellblock kernel log {log}:\n{text}")
                _remove(log)


@pytest.fixture
def kernel():
    km, kc = start_kernel()
    yield km, kc
    stop_kernel(km, kc)


class KernelDied(AssertionError):
    """The kernel's process exited while a test waited for it."""


def run_cell(kc, code, timeout=60):
    """Executes code; returns (reply content, list of iopub messages for it).

    The wait is bounded twice: by `timeout`, and by the kernel-mode cellblock
    process itself. When that process has exited (a kernel killed by a signal
    takes it down), no reply can come: KernelDied is raised at once with the
    process's exit status and log, instead of waiting out the timeout.
    """
    msg_id = kc.execute(code, allow_stdin=False)
    deadline = time.monotonic() + timeout
    outputs = []
    while True:
        msg = _next_message(kc, kc.get_iopub_msg, deadline, f"no idle status for {msg_id}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        outputs.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = _next_message(kc, kc.get_shell_msg, deadline, f"no execute_reply to {msg_id}")
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], outputs


def _next_message(kc, get, deadline, what, poll=0.25):
    """The next message from get(); fails at the deadline or, after a last second
    for messages still in flight, as soon as the kernel's process is gone."""
    km = getattr(kc, "parent", None)
    died_at = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} before the timeout" +
                               (f"; {kernel_death(km)}" if km is not None and kernel_death(km) else ""))
        try:
            return get(timeout=min(poll, left))
        except queue.Empty:
            pass
        if died_at is None and km is not None and kernel_death(km):
            died_at = time.monotonic()
        if died_at is not None and time.monotonic() - died_at > 1.0:
            raise KernelDied(f"{what}: {kernel_death(km)}")


def stream_text(outputs, name="stdout"):
    return "".join(m["content"]["text"] for m in outputs
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


def session_dirs():
    return sorted(glob.glob(os.path.join(STATE_DIR, "sessions", "*")))


def host_residue():
    """What cellblock sandboxes left on the host, checked from the host itself.

    Returns a dict of non-empty lists: runc containers, session directories,
    mounts, cgroups and processes that belong to any cellblock sandbox.
    """
    residue = {}
    runc_root = os.path.join(STATE_DIR, "runtime")
    if os.path.isdir(runc_root):
        out = subprocess.run(["runc", "--root", runc_root, "list", "-q"],
                             capture_output=True, text=True).stdout.split()
        if out:
            residue["runc containers"] = out
    if session_dirs():
        residue["session dirs"] = session_dirs()
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if "/run/cellblock/" in line.split()[4]]
    if mounts:
        residue["mounts"] = mounts
    cgroups = glob.glob("/sys/fs/cgroup/*/cellblock/cb-*") + glob.glob("/sys/fs/cgroup/cellblock/cb-*")
    if cgroups:
        residue["cgroups"] = cgroups
    procs = []
    for cg in glob.glob("/proc/[0-9]*/cgroup"):
        try:
            with open(cg) as f:
                if "/cellblock/cb-" in f.read():
                    procs.append(cg.split("/")[2])
        except OSError:
            pass
    if procs:
        residue["processes"] = procs
    return residue


def drain_iopub(kc, timeout=0.5):
    msgs = []
    while True:
        try:
            msgs.append(kc.get_iopub_msg(timeout=timeout))
        except queue.Empty:
            return msgs
