"""The tight Jupyter client every figure uses, for cellblock and bare kernels alike.

No jupyter_client channel threads and no polling with sleeps: a
jupyter_client `Session` signs and verifies, and raw zmq sockets (shell
DEALER, iopub SUB) are read with one zmq.Poller. The same code drives a
cellblock session and a bare ipykernel, so whatever the client costs is
paid on both sides of every ratio.
"""
import json
import time

import zmq
from jupyter_client.session import Session

PROTOCOL_VERSION = "5.3"


class BenchError(RuntimeError):
    """A figure could not be measured (the message says what happened)."""


def _endpoint(connection, channel):
    transport = connection.get("transport", "tcp")
    ip = connection["ip"]
    port = connection[f"{channel}_port"]
    return f"{transport}://{ip}:{port}" if transport == "tcp" else f"{transport}://{ip}-{port}"


def _timestamp(date):
    try:
        return date.timestamp()
    except AttributeError:
        return None


class Execution:
    """What one execute round trip produced, with its timings (seconds, perf_counter)."""

    __slots__ = ("msg_id", "sent", "sent_wall", "reply_at", "idle_at", "result_at", "reply",
                 "outputs", "busy_date", "idle_date", "done_wall", "msg", "sent_again")

    def __init__(self, msg_id, sent):
        self.msg_id = msg_id
        self.sent = sent
        self.sent_wall = None   # time.time() at send, to compare with the kernel's header dates
        self.busy_date = None   # the kernel's own timestamps (header.date) of busy and idle
        self.idle_date = None
        self.done_wall = None   # time.time() when the round trip completed
        self.reply_at = None
        self.idle_at = None
        self.result_at = None   # first execute_result or display_data on iopub
        self.reply = None       # the execute_reply (content and metadata parsed)
        self.outputs = []       # iopub messages of this execution (content parsed), if kept
        self.msg = None         # the request, to send again after a reconnection
        self.sent_again = 0

    @property
    def done(self):
        return self.reply_at is not None and self.idle_at is not None

    @property
    def round_trip(self):
        """Send → both the shell reply and the idle status of this execution arrived."""
        return max(self.reply_at, self.idle_at) - self.sent

    def phases(self):
        """(request path, kernel, reply path) in seconds, from the kernel's header dates:
        send → the kernel's busy; busy → idle in the kernel; the kernel's idle → reply and
        idle both received. Client and kernel read the same host clock."""
        if self.busy_date is None or self.idle_date is None or self.done_wall is None:
            return None
        return (self.busy_date - self.sent_wall, self.idle_date - self.busy_date,
                self.done_wall - self.idle_date)

    def status(self):
        return self.reply["content"].get("status") if self.reply else None

    def stream_text(self):
        return "".join(m["content"].get("text", "") for m in self.outputs
                       if m["msg_type"] == "stream")

    def rich(self, mime):
        for m in self.outputs:
            if m["msg_type"] in ("execute_result", "display_data"):
                data = m["content"].get("data", {})
                if mime in data:
                    return data[mime]
        return None


class KernelChannels:
    """Shell and iopub of one kernel (or one cellblock session), driven tightly."""

    def __init__(self, ctx, connection, username="bench"):
        self.connection = connection
        key = connection["key"]
        self.session = Session(key=key.encode() if isinstance(key, str) else key,
                               signature_scheme=connection.get("signature_scheme", "hmac-sha256"),
                               username=username)
        # iopub first, so its subscription travels while shell is connecting.
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(_endpoint(connection, "iopub"))
        self.shell = ctx.socket(zmq.DEALER)
        self.shell.linger = 0
        # An identity of its own, as jupyter_client's: a request carried over
        # a server's restart is answered to this socket (figure 18).
        self.shell.identity = self.session.bsession
        self.shell.connect(_endpoint(connection, "shell"))
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)
        self.pending = {}   # msg_id -> Execution
        self.keep_outputs = False
        self.monitor = None
        self.dropped = False

    def watch_reconnects(self):
        """After this, a shell connection that drops and comes back (a server's
        restart) has every open request sent again under its msg_id: one the
        dead server read but never recorded is otherwise lost (libzmq counted
        it as sent). The server runs none twice (docs/restarts.md)."""
        self.monitor = self.shell.get_monitor_socket(zmq.EVENT_CONNECTED |
                                                     zmq.EVENT_DISCONNECTED)
        self.poller.register(self.monitor, zmq.POLLIN)

    def on_monitor(self):
        from zmq.utils.monitor import recv_monitor_message
        back = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_DISCONNECTED:
                self.dropped = True
            elif event == zmq.EVENT_CONNECTED and self.dropped:
                self.dropped = False
                back = True
        if back:
            for ex in self.pending.values():
                ex.sent_again += 1
                self.session.send(self.shell, ex.msg)

    def close(self):
        if self.monitor is not None:
            self.shell.disable_monitor()
            self.monitor.close(linger=0)
        self.shell.close(linger=0)
        self.iopub.close(linger=0)

    # -- sending
    def send_execute(self, code, user_expressions=None, keep_outputs=False):
        content = dict(code=code, silent=False, store_history=True,
                       user_expressions=user_expressions or {}, allow_stdin=False,
                       stop_on_error=True)
        msg = self.session.msg("execute_request", content)
        msg["header"]["version"] = PROTOCOL_VERSION
        self.keep_outputs = keep_outputs
        ex = Execution(msg["header"]["msg_id"], 0.0)
        ex.msg = msg
        self.pending[ex.msg_id] = ex
        ex.sent_wall = time.time()
        ex.sent = time.perf_counter()
        self.session.send(self.shell, msg)
        return ex

    # -- receiving
    def _decode(self, frames):
        _, parts = self.session.feed_identities(frames, copy=True)
        # Verify the signature; leave the content packed until it is needed.
        return self.session.deserialize(parts, content=False)

    def on_shell(self, now):
        """Reads every shell message waiting; returns executions completed by them."""
        done = []
        while True:
            try:
                frames = self.shell.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return done
            msg = self._decode(frames)
            ex = self.pending.get(msg["parent_header"].get("msg_id"))
            if ex is None or msg["msg_type"] != "execute_reply":
                continue
            ex.reply_at = now
            msg["content"] = json.loads(msg["content"])
            ex.reply = msg
            if ex.done:
                ex.done_wall = time.time()
                done.append(self.pending.pop(ex.msg_id))

    def on_iopub(self, now):
        done = []
        while True:
            try:
                frames = self.iopub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return done
            msg = self._decode(frames)
            ex = self.pending.get(msg["parent_header"].get("msg_id"))
            if ex is None:
                continue
            kind = msg["msg_type"]
            if kind in ("execute_result", "display_data") and ex.result_at is None:
                ex.result_at = now
            if kind == "status":
                content = json.loads(msg["content"])
                state = content.get("execution_state")
                if state == "busy":
                    ex.busy_date = _timestamp(msg["header"].get("date"))
                elif state == "idle":
                    ex.idle_at = now
                    ex.idle_date = _timestamp(msg["header"].get("date"))
                    if ex.done:
                        ex.done_wall = time.time()
                        done.append(self.pending.pop(ex.msg_id))
            elif self.keep_outputs:
                msg["content"] = json.loads(msg["content"])
                ex.outputs.append(msg)

    def pump(self, timeout_s):
        """Waits up to timeout_s for traffic; returns the executions it completed."""
        events = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        now = time.perf_counter()
        done = []
        if self.shell in events:
            done += self.on_shell(now)
        if self.iopub in events:
            done += self.on_iopub(now)
        if self.monitor is not None and self.monitor in events:
            self.on_monitor()
        return done

    def execute(self, code, timeout=60.0, keep_outputs=False, user_expressions=None, check=True):
        """One round trip: returns the Execution once its reply and its idle arrived.
        With check, a reply whose status is not ok raises BenchError (a figure must
        never time the server's refusals as if they were executions)."""
        ex = self.send_execute(code, user_expressions, keep_outputs)
        deadline = ex.sent + timeout
        while not ex.done:
            left = deadline - time.perf_counter()
            if left <= 0:
                self.pending.pop(ex.msg_id, None)
                raise BenchError(f"no reply and idle for {code[:40]!r} in {timeout} s "
                                 f"(reply {'seen' if ex.reply_at else 'missing'}, "
                                 f"idle {'seen' if ex.idle_at else 'missing'}; "
                                 f"msg_id {ex.msg_id}, sent again {ex.sent_again}x)")
            self.pump(left)
        if check and ex.status() != "ok":
            c = ex.reply["content"]
            raise BenchError(f"{code[:40]!r} answered {c.get('status')}: {c.get('ename')}: "
                             f"{str(c.get('evalue'))[:200]}")
        return ex

    def execute_until_reply(self, code, timeout=60.0, user_expressions=None, iopub_grace=0.5):
        """Like execute, but done when the shell reply arrives; then waits at most
        iopub_grace seconds more for this execution's iopub (a just-connected SUB
        may have missed it: the PUB/SUB slow joiner)."""
        ex = self.send_execute(code, user_expressions)
        deadline = ex.sent + timeout
        while ex.reply_at is None:
            left = deadline - time.perf_counter()
            if left <= 0:
                self.pending.pop(ex.msg_id, None)
                raise BenchError(f"no reply for {code[:40]!r} in {timeout} s")
            self.pump(left)
        grace_end = time.perf_counter() + iopub_grace
        while not ex.done and (left := grace_end - time.perf_counter()) > 0:
            self.pump(left)
        self.pending.pop(ex.msg_id, None)
        return ex


class MultiDriver:
    """Keeps one execute in flight on each of many kernels from a single poller,
    so the client's own cost per message is as low as Python allows."""

    def __init__(self, channels):
        self.channels = channels
        self.poller = zmq.Poller()
        self.owner = {}
        for ch in channels:
            for sock in (ch.shell, ch.iopub):
                self.poller.register(sock, zmq.POLLIN)
                self.owner[sock] = ch

    def run(self, code, seconds):
        """Each kernel executes `code` back to back for `seconds`.

        Returns [(sent, finished)] for every execution that finished, and the
        number of executions whose reply was not status ok.
        """
        finished = []
        failures = 0
        end = time.perf_counter() + seconds
        for ch in self.channels:
            ch.send_execute(code)
        in_flight = len(self.channels)
        while in_flight:
            now = time.perf_counter()
            if now > end + 60:
                raise BenchError(f"{in_flight} executions still unanswered 60 s after the window")
            events = self.poller.poll(1000)
            now = time.perf_counter()
            for sock, _ in events:
                ch = self.owner[sock]
                done = ch.on_shell(now) if sock is ch.shell else ch.on_iopub(now)
                for ex in done:
                    finished.append((ex.sent, max(ex.reply_at, ex.idle_at)))
                    if ex.status() != "ok":
                        failures += 1
                    if now < end:
                        ch.send_execute(code)
                    else:
                        in_flight -= 1
        return finished, failures


class ManagerClient:
    """The manager socket of `cellblock serve` (Jupyter wire, signed with server.json's key)."""

    def __init__(self, ctx, info):
        self.session = Session(key=info["key"].encode(),
                               signature_scheme=info.get("signature_scheme", "hmac-sha256"),
                               username="bench")
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(info["manager"])
        self.replies = {}

    def close(self):
        self.socket.close(linger=0)

    def send(self, msg_type, content):
        msg = self.session.msg(msg_type, content)
        msg["header"]["version"] = PROTOCOL_VERSION
        self.session.send(self.socket, msg)
        return msg["header"]["msg_id"]

    def wait(self, msg_id, timeout=120.0):
        """The reply to msg_id; raises BenchError after timeout."""
        deadline = time.perf_counter() + timeout
        while msg_id not in self.replies:
            left = deadline - time.perf_counter()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                raise BenchError(f"no manager reply in {timeout} s")
            _, parts = self.session.feed_identities(self.socket.recv_multipart())
            msg = self.session.deserialize(parts)
            self.replies[msg["parent_header"].get("msg_id")] = msg
        return self.replies.pop(msg_id)

    def call(self, msg_type, content, timeout=120.0, check=True):
        reply = self.wait(self.send(msg_type, content), timeout)
        c = reply["content"]
        if check and c.get("status") != "ok":
            raise BenchError(f"{msg_type}: {c.get('ename')}: {c.get('evalue')}")
        return c
