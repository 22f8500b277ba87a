"""Shared helpers for cellblock's integration tests.

Everything here talks to real components: the cellblock binary, runc
sandboxes, jupyter_client. The host is inspected directly (/proc, mounts,
cgroups, runc state), never through cellblock's own view of itself.
"""
import glob
import os
import queue
import subprocess
import time

import pytest
from jupyter_client.manager import KernelManager

KERNEL_NAME = "cellblock-python"
CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
STATE_DIR = "/run/cellblock/kernels"


def start_kernel(extra_env=None, startup_timeout=60):
    """Starts cellblock-python through jupyter_client, as a frontend would."""
    km = KernelManager(kernel_name=KERNEL_NAME)
    env = dict(os.environ)
    env.update(extra_env or {})
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=startup_timeout)
    return km, kc


def stop_kernel(km, kc):
    try:
        kc.stop_channels()
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=False)


@pytest.fixture
def kernel():
    km, kc = start_kernel()
    yield km, kc
    stop_kernel(km, kc)


def run_cell(kc, code, timeout=60):
    """Executes code; returns (reply content, list of iopub messages for it)."""
    outputs = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=outputs.append)
    return reply["content"], outputs


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


def wait_for(predicate, timeout=10.0, interval=0.05):
    """Polls predicate until it is true or the timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def drain_iopub(kc, timeout=0.5):
    msgs = []
    while True:
        try:
            msgs.append(kc.get_iopub_msg(timeout=timeout))
        except queue.Empty:
            return msgs
