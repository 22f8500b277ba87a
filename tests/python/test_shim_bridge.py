"""The shim's bridge of the kernel's channels (the exact level on runsc,
step 1: docs/hibernation.md), the real shim and the real kernel launcher,
run here as a sandbox's init would be: PID 1 of a PID namespace, as nobody,
with its ipc directory at /run/cellblock (a private mount namespace over a
directory of the test's). The kernel binds inside (CELLBLOCK_BRIDGE), the
shim listens where the server connects; on "quiesce" the shim closes every
socket it holds outside (answering "quiet"), and on SIGUSR1 it connects its
lifeline again with its key and listens again: a jupyter_client keeps
talking to the same kernel, its variables and a running thread intact."""
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import pytest
from jupyter_client import BlockingKernelClient

import server_helpers as sh

LIBEXEC = os.path.join(os.path.dirname(os.path.dirname(sh.CELLBLOCK_BIN)), "libexec",
                       "cellblock")
SHIM = os.path.join(LIBEXEC, "cellblock-shim")
NOBODY = 65534


def read_line(sock, timeout=30):
    sock.settimeout(timeout)
    line = b""
    while not line.endswith(b"\n"):
        got = sock.recv(1)
        if not got:
            return line.decode() or None
        line += got
    return line.decode().rstrip("\n")


def shim_pid(unshare_pid, timeout=10):
    """The shim: the child of `unshare --fork`, PID 1 of its namespace."""
    def child():
        try:
            with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None
    assert sh.wait_for(lambda: child() is not None, timeout=timeout)
    return child()


def sockets_held(pid):
    """How many sockets the process holds open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


class Sandbox:
    """The shim as a sandbox's init, its lifeline's listener the test's (root's)."""

    def __init__(self, kernel_argv, bridge=True):
        self.top = tempfile.mkdtemp(prefix="cb-shim-bridge-")
        os.chmod(self.top, 0o755)
        self.ipc = os.path.join(self.top, "ipc")
        os.mkdir(self.ipc)
        os.chmod(self.ipc, 0o1777)  # root's and sticky, as a session's is
        self.lifeline_path = os.path.join(self.ipc, "lifeline.sock")
        self.listener = self.listen()
        self.key = secrets.token_hex(16)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/run/inner/home",
               "IPYTHONDIR": "/run/inner/home/.ipython",
               "CELLBLOCK_LIFELINE": "/run/cellblock/lifeline.sock",
               "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
        if bridge:
            env["CELLBLOCK_BRIDGE"] = "/run/inner/channels"
        # A tmpfs of its own over /run (the host's stays as it is), the
        # test's ipc dir at /run/cellblock, then nobody.
        script = ("mount -t tmpfs -o mode=0755 none /run && mkdir /run/cellblock /run/inner && "
                  "chmod 1777 /run/inner && mount --bind \"$0\" /run/cellblock && "
                  f"exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups "
                  "--inh-caps=-all \"$@\"")
        self.log = open(os.path.join(self.top, "shim.log"), "wb")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--propagation", "private",
             "sh", "-c", script, self.ipc, SHIM, "--", *kernel_argv],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.pid = shim_pid(self.proc.pid)
        self.lifeline = self.accept()
        self.lifeline.sendall(f"adopt-key {self.key}\n".encode())

    def listen(self):
        if os.path.exists(self.lifeline_path):
            os.unlink(self.lifeline_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.lifeline_path)
        os.chmod(self.lifeline_path, 0o666)  # root's: the sandbox's user may connect
        s.listen(1)
        return s

    def accept(self, timeout=30):
        self.listener.settimeout(timeout)
        conn, _ = self.listener.accept()
        self.listener.close()
        os.unlink(self.lifeline_path)
        return conn

    def channel(self, port):
        return os.path.join(self.ipc, f"k-{port}")

    def channels_listening(self):
        return all(os.path.exists(self.channel(p)) and stat.S_ISSOCK(os.lstat(self.channel(p)).st_mode)
                   for p in range(1, 6))

    def shim_log(self):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def close(self):
        try:
            self.lifeline.close()
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # A shim left quiesced (a failed test) waits for SIGUSR1:
                # its namespace ends with it.
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            self.log.close()
            shutil.rmtree(self.top, ignore_errors=True)


@pytest.fixture
def bridged():
    conn = {"transport": "ipc", "ip": "/run/inner/channels/k", "shell_port": 1, "iopub_port": 2,
            "stdin_port": 3, "control_port": 4, "hb_port": 5, "key": secrets.token_hex(16),
            "signature_scheme": "hmac-sha256", "kernel_name": "python3"}
    top = tempfile.mkdtemp(prefix="cb-shim-conn-")
    os.chmod(top, 0o755)
    path = os.path.join(top, "kernel.json")
    with open(path, "w") as f:
        json.dump(conn, f)
    os.chmod(path, 0o644)
    box = Sandbox(["/usr/bin/python3", os.path.join(LIBEXEC, "cellblock_ipykernel.py"),
                   "-f", path])
    box.conn = conn
    yield box
    box.close()
    shutil.rmtree(top, ignore_errors=True)


def client_of(box):
    kc = BlockingKernelClient()
    kc.load_connection_info({**box.conn, "ip": os.path.join(box.ipc, "k")})
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return kc


def test_the_kernel_is_reached_through_the_bridge_and_outlives_a_quiesce(bridged):
    box = bridged
    assert sh.wait_for(box.channels_listening, timeout=60), box.shim_log()
    # The kernel's own sockets are not in the ipc dir: only the shim's are.
    assert sorted(n for n in os.listdir(box.ipc) if n.startswith("k-")) == \
        [f"k-{p}" for p in range(1, 6)]
    kc = client_of(box)
    try:
        sh.run_ok(kc, "import itertools, threading, time, os\n"
                      "x = 41\n"
                      "numbers = itertools.count(100)\n"
                      "next(numbers)\n"
                      "ticks = [0]\n"
                      "def tick():\n"
                      "    while True:\n"
                      "        ticks[0] += 1\n"
                      "        time.sleep(0.02)\n"
                      "threading.Thread(target=tick, daemon=True).start()\n")
        # No IOPub pipe when bridged (its loopback socket cannot be checkpointed).
        reply, msgs = sh.execute(kc, "import ipykernel.kernelapp as k\n"
                                     "print(k.IPKernelApp.instance().iopub_thread._pipe_flag)")
        assert sh.stream_text(msgs).strip() == "False", msgs
        # A flood through it comes through whole, in order.
        reply, msgs = sh.execute(kc, "print('\\n'.join(str(i) for i in range(200000)))")
        assert reply["content"]["status"] == "ok"
        assert sh.stream_text(msgs).split() == [str(i) for i in range(200000)]

        assert sockets_held(box.pid) > 1  # the lifeline, the channels' listeners and pairs
        box.lifeline.sendall(b"quiesce\n")
        assert read_line(box.lifeline) == "quiet"
        assert read_line(box.lifeline, timeout=10) is None, "the lifeline ends after 'quiet'"
        # Nothing of the host's is held now: no socket in the shim, no channel to connect to.
        assert sh.wait_for(lambda: sockets_held(box.pid) == 0, timeout=5), \
            os.listdir(f"/proc/{box.pid}/fd")
        assert not any(n.startswith("k-") for n in os.listdir(box.ipc)), os.listdir(box.ipc)
        assert sh.wait_for(lambda: "quiesced: no host socket held" in box.shim_log(), timeout=5)
        time.sleep(0.5)

        # Woken: the lifeline again, with the key the first one gave it.
        box.listener = box.listen()
        os.kill(box.pid, signal.SIGUSR1)
        box.lifeline = box.accept()
        assert read_line(box.lifeline) == f"adopt {box.key}"
        box.lifeline.sendall(b"adopted\n")
        assert sh.wait_for(box.channels_listening, timeout=30), box.shim_log()
        # The same client's ZMQ connects again by itself; the same kernel answers.
        reply, msgs = sh.execute(kc, "t0 = ticks[0]; time.sleep(0.3)\n"
                                     "print(x + 1, next(numbers), ticks[0] > t0)", timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert sh.stream_text(msgs).split() == ["42", "101", "True"], msgs
        assert reply["content"]["execution_count"] == 4  # the same kernel
    finally:
        kc.stop_channels()


def test_a_shim_that_does_not_bridge_refuses_to_quiesce():
    box = Sandbox(["/bin/sleep", "60"], bridge=False)
    try:
        box.lifeline.sendall(b"quiesce\n")
        assert read_line(box.lifeline) == "not-quiet"
        box.lifeline.sendall(b"interrupt\n")  # the lifeline still works
        assert read_line(box.lifeline).startswith("kernel-exit"), box.shim_log()
    finally:
        box.close()
