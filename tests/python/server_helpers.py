"""Shared fixtures and helpers for the `cellblock serve` integration tests.

A test gets a real `cellblock serve` process with a fresh state dir, talks to
its manager socket with a plain jupyter_client Session on a zmq DEALER (the
Jupyter wire format, signed with the key from server.json), and drives the
sessions it creates with ordinary BlockingKernelClients.

Everything the server claims is checked against the host itself: runc's state
(`runc --root DIR/runtime list`), DIR/sessions/<id>, /proc/self/mountinfo,
/sys/fs/cgroup/*/cellblock/cb-<id> and the processes whose /proc/<pid>/cgroup
names the session's cgroup (or whose root lies in the state dir).

The state dir lives under /run (not under pytest's tmp_path): the sandbox's
mapped user must be able to reach it, and /tmp/pytest-of-root is mode 0700.
"""
import glob
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import zmq
import zmq.asyncio
from jupyter_client import BlockingKernelClient
from jupyter_client.session import Session

# The zmq contexts of the tests' clients, one of each kind, living as long
# as the test process. A context that becomes garbage is destroyed from its
# __del__, whenever the collector runs and in whatever thread, and pyzmq 24's
# term() blocks for good when a socket of it is garbage in the same cycle
# (its weak reference is cleared first, so destroy() does not close it).
# That happened inside jupyter_client's heartbeat thread, which the next
# stop_channels() then joined forever: a whole test file hung. Contexts that
# are never collected cannot do that; garbage sockets close on their own.
CLIENT_CONTEXT = zmq.asyncio.Context()  # kernel clients (jupyter_client's kind)
MANAGER_CONTEXT = zmq.Context()  # ServerProcess's manager sockets


def kernel_client():
    """A BlockingKernelClient on the tests' shared context (see CLIENT_CONTEXT)."""
    return BlockingKernelClient(context=CLIENT_CONTEXT)


CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTOCOL_VERSION = "5.3"


# ---------------------------------------------------------------- small helpers

def routing_identity():
    """A random 8-byte ZMQ identity for a client socket. ZMQ reserves
    identities that begin with a zero byte: a ROUTER (libzmq's, and the
    server's ZMTP) gives such a peer one of its own instead, so a test that
    looks for its identity in the server's log would miss it 1 time in 256."""
    return bytes([secrets.randbelow(255) + 1]) + secrets.token_bytes(7)


def wait_for(predicate, timeout=10.0, interval=0.05):
    """Polls predicate until it is true or the timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def proc_state(pid):
    """The one-letter state of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def cmdline(pid):
    """A process's command line, its arguments joined by spaces ("" if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pgrep_full(text):
    """The pids whose command line contains `text`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and text in cmdline(p)]


def process_nice(pid):
    """The nice value of a process (field 19 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[16])


def children_running(parent, exe_suffix=""):
    """Pids of the processes whose parent is `parent` and whose executable's
    path ends with `exe_suffix` (e.g. the gateway a server or kernel
    started; any, by default)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            exe = os.readlink(f"/proc/{entry}/exe")
        except OSError:
            continue
        if ppid == parent and exe.endswith(exe_suffix):
            found.append(int(entry))
    return found


def session_of_process(pid, sessions_dir, timeout=10):
    """The session a cellblock process runs (kernel mode): the one under
    sessions_dir whose lock file it holds."""
    prefix = sessions_dir.rstrip("/") + "/"

    def find():
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix) and target.endswith("/lock"):
                return target[len(prefix):-len("/lock")]
        return None

    sid = wait_for(find, timeout=timeout)
    assert sid, f"cellblock process {pid} holds no session lock under {prefix}"
    return sid


def alive(pids):
    """Which of pids still run (zombies and vanished processes count as gone)."""
    return [pid for pid in pids if proc_state(pid) not in (None, "Z")]


def shim_log(srv, sid):
    """What session `sid`'s shim wrote (its log/shim.log), or "" once it is gone."""
    try:
        with open(os.path.join(srv.state_dir, "sessions", sid, "log", "shim.log"),
                  errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def session_pids(sid, include_zombies=False):
    """Host pids of the processes in session `sid`'s cgroup."""
    marker = f"/cellblock/cb-{sid}"
    pids = []
    for path in glob.glob("/proc/[0-9]*/cgroup"):
        pid = int(path.split("/")[2])
        try:
            with open(path) as f:
                if marker not in f.read():
                    continue
        except OSError:
            continue
        if include_zombies or proc_state(pid) not in (None, "Z"):
            pids.append(pid)
    return sorted(pids)


def root_source(pid):
    """Where process `pid`'s root directory comes from on the host: the root
    of the mount on its "/" (its mountinfo), which names the host directory
    a sandbox pivoted into even after that directory was removed. Seen from
    the host, /proc/PID/root of a process in its own mount namespace reads
    "/" (docs/field-notes.md). None for a process that has gone."""
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            return os.readlink(f"/proc/{pid}/root")  # our namespace: a path of ours
        with open(f"/proc/{pid}/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    on_root = [m for m in mounts if len(m) > 4 and m[4] == "/"]
    return on_root[-1][3] if on_root else None  # the last mounted on "/" is what it sees


def pids_rooted_in(directory, include_zombies=False):
    """Host pids whose root directory (chroot / pivot_root) lies inside `directory`."""
    prefix = directory.rstrip("/") + "/"
    pids = []
    for path in glob.glob("/proc/[0-9]*"):
        pid = int(path.split("/")[2])
        root = root_source(pid)
        if root is None:
            continue
        if root.startswith(prefix) and (include_zombies or proc_state(pid) not in (None, "Z")):
            pids.append(pid)
    return sorted(pids)


def mounts_under(text):
    """Mount points (from our own mountinfo) whose path contains `text`."""
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if text in line.split()[4]]


def session_cgroups(sid):
    cid = f"cb-{sid}"
    return sorted(set(glob.glob(f"/sys/fs/cgroup/*/cellblock/{cid}") +
                      glob.glob(f"/sys/fs/cgroup/cellblock/{cid}")))


def runc_list(state_dir):
    """Container ids runc knows in this server's runtime root."""
    root = os.path.join(state_dir, "runtime")
    if not os.path.isdir(root):
        return []
    out = subprocess.run(["runc", "--root", root, "list", "-q"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def runc_states(state_dir):
    """{container id: status} from `runc list --format json`."""
    root = os.path.join(state_dir, "runtime")
    if not os.path.isdir(root):
        return {}
    out = subprocess.run(["runc", "--root", root, "list", "--format", "json"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
    if not out or out == "null":
        return {}
    return {c["id"]: c["status"] for c in json.loads(out)}


def is_forked(state_dir, sid):
    """Whether session `sid` was forked from a zygote (docs/zygote.md): it has
    no runtime container, its session dir says so."""
    try:
        with open(os.path.join(state_dir, "sessions", sid, "runtime")) as f:
            return f.read().strip() == "zygote"
    except OSError:
        return False


def sandbox_running(state_dir, container_id):
    """A sandbox of this server runs on the host: a runc container in its
    runtime root, or a forked session whose init (the shim, PID 1 of its own
    namespace) is alive in its cgroup."""
    if container_id in runc_list(state_dir):
        return True
    sid = container_id[3:]
    if not is_forked(state_dir, sid):
        return False
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = f.read().split(b"\0")[0]
        except (OSError, StopIteration):
            continue
        if nspid[-1] == "1" and program.endswith(b"cellblock-shim"):
            return True
    return False


def is_zygote(state_dir, sid):
    """Whether the sandbox dir `sid` is a zygote's (the server marks it so
    before the zygote starts)."""
    try:
        with open(os.path.join(state_dir, "sessions", sid, "role")) as f:
            return f.read().strip() == "zygote"
    except OSError:
        return False


def running_sandboxes(state_dir):
    """Container ids of every sandbox of this server that runs: runc's
    containers (zygotes included) and the sessions forked from zygotes."""
    ids = set(runc_list(state_dir))
    for sid in sessions_on_disk(state_dir):
        if is_forked(state_dir, sid) and sandbox_running(state_dir, f"cb-{sid}"):
            ids.add(f"cb-{sid}")
    return ids


def session_sandboxes(state_dir):
    """running_sandboxes less the zygotes: one per open or pooled session."""
    return {c for c in running_sandboxes(state_dir) if not is_zygote(state_dir, c[3:])}


def session_residue(state_dir, sid, pids=(), include_zombies=False):
    """Everything of session `sid` the host still holds, checked from the host.

    pids: host pids the session's processes had; they are checked by pid too,
    since a dying process may already have left its cgroup.
    """
    residue = {}
    cid = f"cb-{sid}"
    if cid in runc_list(state_dir):
        residue["runc container"] = cid
    if os.path.exists(os.path.join(state_dir, "runtime", cid)):
        residue["runc state dir"] = os.path.join(state_dir, "runtime", cid)
    session_dir = os.path.join(state_dir, "sessions", sid)
    if os.path.lexists(session_dir):
        residue["session dir"] = session_dir
    mounts = mounts_under(sid)
    if mounts:
        residue["mounts"] = mounts
    cgroups = session_cgroups(sid)
    if cgroups:
        residue["cgroups"] = cgroups
    procs = set(session_pids(sid, include_zombies))
    procs |= {pid for pid in pids
              if proc_state(pid) is not None and (include_zombies or proc_state(pid) != "Z")}
    if procs:
        residue["processes"] = {pid: proc_state(pid) for pid in sorted(procs)}
    return residue


def sessions_on_disk(state_dir):
    return sorted(os.listdir(os.path.join(state_dir, "sessions"))) \
        if os.path.isdir(os.path.join(state_dir, "sessions")) else []


def state_dir_residue(state_dir, ids=()):
    """Everything any sandbox of this server (or sessions `ids`) left on the host."""
    residue = {}
    listed = runc_list(state_dir)
    if listed:
        residue["runc containers"] = listed
    runtime = os.path.join(state_dir, "runtime")
    if os.path.isdir(runtime) and os.listdir(runtime):
        residue["runc state dirs"] = sorted(os.listdir(runtime))
    on_disk = sessions_on_disk(state_dir)
    if on_disk:
        residue["session dirs"] = on_disk
    mounts = mounts_under(state_dir)
    if mounts:
        residue["mounts"] = mounts
    all_ids = set(ids) | set(on_disk) | {c[3:] for c in listed if c.startswith("cb-")}
    cgroups = [cg for sid in sorted(all_ids) for cg in session_cgroups(sid)]
    if cgroups:
        residue["cgroups"] = cgroups
    procs = set(pids_rooted_in(state_dir))
    for sid in all_ids:
        procs |= set(session_pids(sid))
    if procs:
        residue["processes"] = sorted(procs)
    return residue


def assert_session_gone(state_dir, sid, pids=(), timeout=15):
    """Waits (a killed sandbox init is reaped by the host's PID 1 on its own
    schedule) until nothing of session `sid` is left, then asserts it."""
    wait_for(lambda: not session_residue(state_dir, sid, pids), timeout=timeout, interval=0.2)
    left = session_residue(state_dir, sid, pids)
    assert left == {}, f"session {sid} left on the host: {left}"


def assert_session_present(state_dir, sid):
    """The session really has everything whose absence is checked later."""
    r = session_residue(state_dir, sid)
    kinds = ["session dir", "mounts", "cgroups", "processes"]
    if not is_forked(state_dir, sid):
        kinds += ["runc container", "runc state dir"]
    for kind in kinds:
        assert kind in r, f"session {sid} has no {kind} while open: a later absence proves nothing ({r})"
    if is_forked(state_dir, sid):
        assert sandbox_running(state_dir, f"cb-{sid}"), f"session {sid}'s init is not running ({r})"
    else:
        assert runc_states(state_dir).get(f"cb-{sid}") == "running", runc_states(state_dir)
    return r


# ---------------------------------------------------------------- Jupyter helpers

def stream_text(msgs, name="stdout"):
    return "".join(m["content"]["text"] for m in msgs
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


def collect_execution(kc, msg_id, timeout=60):
    """Reads shell until the reply to msg_id and iopub until its idle.

    Returns (reply message, iopub messages whose parent is msg_id, other shell
    replies seen while waiting). The reply is looked for on shell only. If the
    kernel's server (kc.cellblock_server, set by ServerProcess.connect) exits
    meanwhile, fails at once with its exit status and log.
    """
    deadline = time.monotonic() + timeout
    reply = None
    others = []
    while reply is None:
        msg = _next_message(kc, kc.get_shell_msg, deadline, f"no shell reply to {msg_id} in {timeout} s")
        if msg["parent_header"].get("msg_id") == msg_id:
            reply = msg
        else:
            others.append(msg)
    iopub = []
    while True:
        msg = _next_message(kc, kc.get_iopub_msg, deadline,
                            f"no idle status for {msg_id} in {timeout} s; iopub: "
                            f"{[m['msg_type'] for m in iopub]}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        iopub.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply, iopub, others


def _next_message(kc, get, deadline, what, poll=0.25):
    """The next message from get(), or an AssertionError at the deadline or, a
    second after the kernel's server was seen gone, at once."""
    server = getattr(kc, "cellblock_server", None)
    gone_at = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(what)
        try:
            return get(timeout=min(poll, left))
        except queue.Empty:
            pass
        if gone_at is None and server is not None and server.proc.poll() is not None:
            gone_at = time.monotonic()
        if gone_at is not None and time.monotonic() - gone_at > 1.0:
            raise AssertionError(f"{what}: cellblock serve exited with {server.proc.returncode}; "
                                 f"log {server.log_path} ends:\n{server.log()[-3000:]}")


class ShellWatch:
    """Sees a client's shell connection close (a socket monitor on its
    DEALER). jupyter_client never sends a request again: one written before
    its libzmq has seen the server's connection close goes into the dead
    socket, so a test that means to send during an outage waits for this."""

    def __init__(self, kc):
        self.socket = kc.shell_channel.socket
        # The channel's socket is a zmq.asyncio one; its monitor is read here
        # through a plain socket of the same (shadowed) context.
        address = f"inproc://cellblock-test-monitor-{secrets.token_hex(8)}"
        self.socket.monitor(address, zmq.EVENT_DISCONNECTED)
        self.monitor = zmq.Context.shadow(self.socket.context.underlying).socket(zmq.PAIR)
        self.monitor.connect(address)

    def wait_closed(self, timeout=30):
        from zmq.utils.monitor import recv_monitor_message
        try:
            if not self.monitor.poll(int(timeout * 1000)):
                return False
            return recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            self.socket.disable_monitor()
            self.monitor.close()


def send_execute(kc, code):
    """Sends an execute_request without waiting; returns its msg_id."""
    msg = kc.session.msg("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True})
    kc.shell_channel.send(msg)
    return msg["header"]["msg_id"]


def execute(kc, code, metadata=None, timeout=60):
    """Executes code, optionally with request metadata (e.g. {"cellblock": {"timeout_s": 5}}).

    Returns (reply message, iopub messages of this execution).
    """
    content = dict(code=code, silent=False, store_history=True, user_expressions={},
                   allow_stdin=False, stop_on_error=True)
    msg = kc.session.msg("execute_request", content, metadata=metadata or {})
    kc.shell_channel.send(msg)
    reply, iopub, _ = collect_execution(kc, msg["header"]["msg_id"], timeout=timeout)
    return reply, iopub


def ok_text(reply, msgs):
    """The stdout of an execution that must have succeeded (its reply and its
    IOPub messages; the error's content in the assertion)."""
    errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert reply["content"]["status"] == "ok", (reply["content"], errors)
    return stream_text(msgs)


def run_ok(kc, code, timeout=60):
    """Executes code that must succeed; returns its stdout."""
    return ok_text(*execute(kc, code, timeout=timeout))


def drain(channel_get, timeout=0.3):
    msgs = []
    while True:
        try:
            msgs.append(channel_get(timeout=timeout))
        except queue.Empty:
            return msgs


# ---------------------------------------------------------------- the server

class _ReadyAsk:
    """One client's latest kernel_info_request in connect_many, and what of
    it has come back: its reply on shell, its status on IOPub."""

    def __init__(self):
        self.msg_id, self.sent_at = None, 0.0
        self.replied = self.status = False

    @property
    def ready(self):
        return self.replied and self.status

    def send(self, kc):
        self.msg_id, self.sent_at = kc.kernel_info(), time.monotonic()
        self.replied = self.status = False

    def see(self, msg, expected):
        if msg["parent_header"].get("msg_id") != self.msg_id or msg["msg_type"] != expected:
            return
        if expected == "status":
            self.status = True
        else:
            self.replied = True


class ServerProcess:
    """A `cellblock serve` subprocess with its own state dir and a manager client."""

    def __init__(self, state_dir, args=()):
        self.state_dir = state_dir
        self.args = list(args)
        self.proc = None
        self.clients = []
        self.session_ids = set()   # every session this object saw created
        self._answered_many = set()  # the requests call_many got one reply to
        self.ctx = MANAGER_CONTEXT
        self.socket = None
        self.session = None
        self.info = None
        self.log_path = state_dir + ".log"
        self._log_file = None

    # -- process
    def start(self, timeout=60):
        old_pid = self.proc.pid if self.proc else None
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [CELLBLOCK_BIN, "serve", "--state-dir", self.state_dir, *self.args],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=self._log_file)
        server_json = os.path.join(self.state_dir, "server.json")

        def ready():
            assert self.proc.poll() is None, \
                f"cellblock serve exited with {self.proc.returncode}:\n{self.log()}"
            try:
                with open(server_json) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                return None
            # After a kill -9 the old server.json stays: wait for ours.
            return info if info.get("pid") == self.proc.pid and info.get("pid") != old_pid else None

        self.info = wait_for(ready, timeout=timeout)
        assert self.info, f"no server.json from pid {self.proc.pid} in {timeout} s:\n{self.log()}"
        self._connect_manager()
        return self

    def _connect_manager(self):
        if self.socket is not None:
            self.socket.close(linger=0)
        self.session = Session(key=self.info["key"].encode(),
                               signature_scheme=self.info["signature_scheme"],
                               username="cellblock-test")
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(self.info["manager"])

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()

    def terminate(self, timeout=60):
        """SIGTERM; returns the exit code (asserts it exited in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                try:
                    self.proc.wait(timeout=60)
                    killed = "it was then killed"
                except subprocess.TimeoutExpired:
                    killed = f"60 s after SIGKILL it is still {proc_state(self.proc.pid)}"
                raise AssertionError(f"cellblock serve did not exit {timeout} s after SIGTERM "
                                     f"({killed}):\n{self.log()[-5000:]}")
        if self._log_file and not self._log_file.closed:
            self._log_file.close()
        return self.proc.returncode

    # -- manager API
    def send(self, msg_type, content, buffers=None):
        """Sends a manager request; returns its msg_id."""
        msg = self.session.send(self.socket, msg_type, content, buffers=buffers)
        return msg["header"]["msg_id"]

    def receive(self, msg_id, timeout=60):
        """The reply to msg_id (None after timeout). Buffers come back as bytes."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                return None
            frames = self.socket.recv_multipart()
            _, msg = self.session.feed_identities(frames)
            reply = self.session.deserialize(msg)  # verifies the signature
            reply["buffers"] = [bytes(b) for b in reply["buffers"]]
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def call(self, msg_type, content, buffers=None, timeout=60):
        """One manager request and its reply message (asserting a reply comes)."""
        msg_id = self.send(msg_type, content, buffers)
        reply = self.receive(msg_id, timeout)
        if reply is None:
            state = "is still running" if self.proc.poll() is None else \
                f"has exited with {self.proc.returncode} (was it signalled from outside the test?)"
            raise AssertionError(f"no {msg_type} reply in {timeout} s; the server {state}; "
                                 f"log {self.log_path} ends:\n{self.log()[-3000:]}")
        assert reply["msg_type"] == msg_type.replace("_request", "_reply"), reply
        return reply

    def call_many(self, requests, timeout=120, drain_s=0.3):
        """Sends every (msg_type, content) at once, then collects the replies.

        Returns the replies in request order; asserts each request got exactly
        one reply (extra replies are looked for during a drain of drain_s).
        A second reply to a request of an earlier call_many, arriving during
        this one, fails it too; with drain_s=0 call extra_replies() at the end.
        """
        ids = [self.send(t, c) for t, c in requests]
        replies = {}
        counts = {i: 0 for i in ids}
        deadline = time.monotonic() + timeout
        while len(replies) < len(ids):
            left = deadline - time.monotonic()
            assert left > 0 and self.socket.poll(int(left * 1000) + 1), \
                f"{len(ids) - len(replies)} of {len(ids)} requests unanswered after {timeout} s"
            reply = self._receive_many_reply(counts)
            parent = reply["parent_header"].get("msg_id")
            if parent in counts:
                replies[parent] = reply
        while self.socket.poll(int(drain_s * 1000)):
            self._receive_many_reply(counts)
        assert all(n == 1 for n in counts.values()), f"replies per request: {sorted(counts.values())}"
        self._answered_many.update(ids)
        return [replies[i] for i in ids]

    def _receive_many_reply(self, counts):
        _, msg = self.session.feed_identities(self.socket.recv_multipart())
        reply = self.session.deserialize(msg)
        parent = reply["parent_header"].get("msg_id")
        if parent in counts:
            counts[parent] += 1
        assert parent not in self._answered_many, \
            f"a second reply to {parent}, answered in an earlier call_many: {reply['content']}"
        return reply

    def extra_replies(self, drain_s=0.3):
        """Asserts no request of any call_many got a second reply (drains
        the manager socket for drain_s)."""
        while self.socket.poll(int(drain_s * 1000)):
            self._receive_many_reply({})

    def ok(self, msg_type, content, buffers=None, timeout=60):
        reply = self.call(msg_type, content, buffers, timeout)
        assert reply["content"]["status"] == "ok", reply["content"]
        return reply

    def create(self, limits=None, image=None, metadata=None, timeout=90):
        """session_create_request; returns the reply content (asserting ok)."""
        content = {}
        if limits is not None:
            content["limits"] = limits
        if image is not None:
            content["image"] = image
        if metadata is not None:
            content["metadata"] = metadata
        reply = self.ok("session_create_request", content, timeout=timeout)["content"]
        self.session_ids.add(reply["session_id"])
        return reply

    def info_of(self, sid):
        return self.ok("session_info_request", {"session_id": sid})["content"]

    def connect(self, connection, ready_timeout=60):
        """A started, ready BlockingKernelClient on a session's connection dict."""
        kc = kernel_client()
        kc.load_connection_info(connection)
        kc.cellblock_server = self   # collect_execution stops waiting when the server is gone
        kc.start_channels()
        self.clients.append(kc)
        kc.wait_for_ready(timeout=ready_timeout)
        return kc

    def connect_many(self, connections, ready_timeout=60):
        """Started, ready clients on several sessions' connection dicts, made
        ready side by side: each sends kernel_info_request until the reply has
        come and IOPub has carried that request's status (so IOPub is joined),
        as wait_for_ready does, but without its 0.4 s of waiting for silence
        per client, and with every session woken (or started) at once."""
        kcs = []
        for connection in connections:
            kc = kernel_client()
            kc.load_connection_info(connection)
            kc.cellblock_server = self
            kc.start_channels()
            self.clients.append(kc)
            kcs.append(kc)
        asks = [_ReadyAsk() for _ in kcs]
        deadline = time.monotonic() + ready_timeout
        while not all(ask.ready for ask in asks):
            assert time.monotonic() < deadline, \
                f"{sum(not ask.ready for ask in asks)} of {len(kcs)} sessions not ready " \
                f"in {ready_timeout} s"
            for kc, ask in zip(kcs, asks):
                if ask.ready:
                    continue
                if ask.msg_id is None or time.monotonic() - ask.sent_at > 1.0:
                    ask.send(kc)
                for get, expected in ((kc.get_shell_msg, "kernel_info_reply"),
                                      (kc.get_iopub_msg, "status")):
                    try:
                        while True:
                            ask.see(get(timeout=0.01), expected)
                    except queue.Empty:
                        pass
        return kcs

    def open_session(self, limits=None, **kw):
        """Creates a session and connects to it: (session id, client, create reply)."""
        reply = self.create(limits=limits, **kw)
        return reply["session_id"], self.connect(reply["connection"]), reply

    def cli(self, *args, timeout=60, check=True):
        """Runs a `cellblock` client subcommand against this server."""
        cmd = [CELLBLOCK_BIN, args[0], "--state-dir", self.state_dir, *args[1:]]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check:
            assert result.returncode == 0, \
                f"{cmd} exited {result.returncode}:\nstdout: {result.stdout}\nstderr: {result.stderr}"
        return result

    def close_clients(self):
        for kc in self.clients:
            try:
                kc.stop_channels()
            except Exception:
                pass
        self.clients.clear()

    def shutdown(self, keep_log=False):
        """Teardown: SIGTERM, clean exit, nothing of any sandbox left, state dir removed.

        Returns a list of problems (empty when all is well). The server's log
        is removed only when there are none and keep_log is false.
        """
        problems = []
        self.close_clients()
        if self.socket is not None:
            self.socket.close(linger=0)
        if self.proc is not None:
            try:
                code = self.terminate()
                if code != 0:
                    problems.append(f"cellblock serve exited with {code} after SIGTERM")
            except AssertionError as e:
                problems.append(str(e))
        ids = set(self.session_ids) | set(sessions_on_disk(self.state_dir))
        wait_for(lambda: not state_dir_residue(self.state_dir, ids), timeout=15, interval=0.2)
        left = state_dir_residue(self.state_dir, ids)
        if left:
            problems.append(f"after SIGTERM the server left: {left}")
        if os.path.exists(os.path.join(self.state_dir, "server.json")):
            problems.append("server.json still exists after a clean exit")
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if os.path.exists(self.state_dir):
            problems.append(f"state dir {self.state_dir} could not be removed")
        log = self.log()
        if problems:
            problems.append(f"server log kept at {self.log_path}; its end:\n{log[-4000:]}")
        elif not keep_log:
            os.unlink(self.log_path)
        return problems


def new_state_dir():
    path = f"/run/cellblock-test-{secrets.token_hex(6)}"
    assert not os.path.exists(path)
    return path


def serve_once(*args, timeout=60):
    """`cellblock serve ARGS` on a state dir of its own, removed after: for a
    start expected to be refused (its CompletedProcess, output as text)."""
    state_dir = new_state_dir()
    try:
        return subprocess.run([CELLBLOCK_BIN, "serve", "--state-dir", state_dir, *args],
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def start_server(args=(), timeout=60):
    return ServerProcess(new_state_dir(), args).start(timeout=timeout)


def host_image_definition():
    with open(os.path.join(SOURCE_DIR, "images", "host", "image.json")) as f:
        return json.load(f)


def start_server_with_image(definition, args=(), more=()):
    """A server whose image folder (CELLBLOCK_IMAGES_DIR, made here) holds
    `definition` (and the definitions in `more`) beside the shipped images.
    Returns (server, folder); the caller removes the folder after the
    server's shutdown."""
    images = tempfile.mkdtemp(prefix="cb-test-images-")
    for each in (definition, *more):
        os.makedirs(os.path.join(images, each["name"]))
        with open(os.path.join(images, each["name"], "image.json"), "w") as f:
            json.dump(each, f)
    old = os.environ.get("CELLBLOCK_IMAGES_DIR")
    os.environ["CELLBLOCK_IMAGES_DIR"] = images
    try:
        return start_server(list(args)), images
    except BaseException:
        shutil.rmtree(images, ignore_errors=True)
        raise
    finally:
        if old is None:
            del os.environ["CELLBLOCK_IMAGES_DIR"]
        else:
            os.environ["CELLBLOCK_IMAGES_DIR"] = old


@pytest.fixture
def server_factory(request):
    """Starts `cellblock serve` processes on demand; stops and checks them all afterwards."""
    started = []
    failed_before = request.session.testsfailed

    def make(args=()):
        srv = start_server(args)
        started.append(srv)
        return srv

    yield make
    # The server logs of a failed test are kept (their paths are in the messages).
    keep = request.session.testsfailed > failed_before
    problems = []
    for srv in started:
        problems += srv.shutdown(keep_log=keep)
        if keep:
            print(f"cellblock serve log kept: {srv.log_path}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def server(request):
    """One `cellblock serve` (default pool: host=2) shared by a test module."""
    failed_before = request.session.testsfailed
    srv = start_server(())
    yield srv
    keep = request.session.testsfailed > failed_before
    problems = srv.shutdown(keep_log=keep)
    if keep:
        print(f"cellblock serve log kept: {srv.log_path}")
    assert not problems, "\n".join(problems)


@pytest.fixture
def clients(server):
    """Closes the kernel clients a test opened on the shared server."""
    yield server
    server.close_clients()


def write_temp(data, suffix=""):
    fd, path = tempfile.mkstemp(prefix="cellblock-test-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def zmtp_mechanism(port, then_send=b""):
    """The security mechanism ("NULL", "CURVE", ...) a ZMTP 3 peer listening
    at 127.0.0.1:`port` greets with. Only our signature and major version are
    sent (libzmq then sends the rest of its greeting, and would close on a
    mechanism unlike its own); `then_send` follows, as it is, on the wire."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03")
        greeting = b""
        while len(greeting) < 32:
            chunk = s.recv(64 - len(greeting))
            assert chunk, f"port {port}: closed after {greeting!r}"
            greeting += chunk
        s.sendall(then_send)
    return greeting[12:32].rstrip(b"\0").decode()
