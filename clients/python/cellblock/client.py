"""A small client for a running `cellblock serve`: sessions, code, files.

    import cellblock
    with cellblock.connect() as server:
        with server.session(limits={"max_executions": 20}) as s:
            s.put("sales.csv", open("sales.csv", "rb").read())
            r = s.run("import pandas as pd; pd.read_csv('/data/input/sales.csv').describe()")
            print(r.text, r.budget["executions_left"])

The manager socket and each session's channels speak the Jupyter wire format
through jupyter_client's Session (and pyzmq, which jupyter_client brings).
A Server may be shared by threads (each thread gets its own manager socket);
a Session belongs to one thread at a time.

Why one module of about 550 lines: a Server and its Sessions are one object
graph (a Session borrows its Server's ZMQ context, sends its manager
requests (info, history, hibernate, resume, close) through its Server, whose
retry across a server's restart they share, and is listed in its Server's
open sessions until it closes), and the user's import is `cellblock.connect()`. What was separable is apart: files (`files.py`,
mixed into Session), results and errors (`results.py`, `errors.py`).
"""
import fcntl
import json
import os
import struct
import threading
import time

import zmq
from jupyter_client.session import Session as WireSession

from .errors import (POLICY_ENAMES, ClientTimeout, ServerNotFound, ServerRestarting, SessionClosed,
                     error_for)
from .files import SessionFiles
from .results import Error, Execution, Result

DEFAULT_STATE_DIR = "/var/lib/cellblock"
KILL_GRACE_S = 3.0        # the server's wait between interrupt and kill at a timeout
REPLY_MARGIN_S = 15.0     # how much longer than the server's deadline the client waits


def server_file(state_dir=None, path=None):
    """Where the server's connection file is: `path`, else STATE_DIR/server.json with
    STATE_DIR from the argument, $CELLBLOCK_STATE_DIR or /var/lib/cellblock."""
    if path:
        return path
    if os.environ.get("CELLBLOCK_SERVER_FILE") and not state_dir:
        return os.environ["CELLBLOCK_SERVER_FILE"]
    state_dir = state_dir or os.environ.get("CELLBLOCK_STATE_DIR") or DEFAULT_STATE_DIR
    return os.path.join(state_dir, "server.json")


def _lock_holder(state_dir):
    """The pid of the server holding STATE_DIR/server.lock, 0 when none does, or None
    when there is no lock file (a server older than the lock). The lock is tested
    (F_GETLK), never taken, so it cannot get in the way of a server starting."""
    try:
        fd = os.open(os.path.join(state_dir, "server.lock"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return None
    try:
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (native layout)
        probe = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, l_pid = struct.unpack("@hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    finally:
        os.close(fd)
    return 0 if l_type == fcntl.F_UNLCK else l_pid


def _pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def connect(state_dir=None, path=None, timeout=10.0):
    """Connects to the server whose connection file is found by server_file();
    raises ServerNotFound when there is none or it does not answer in `timeout` s."""
    file = server_file(state_dir, path)
    try:
        with open(file) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ServerNotFound(f"no server connection file at {file} (is `cellblock serve` running? "
                             f"pass state_dir= or set CELLBLOCK_STATE_DIR)") from None
    except (OSError, ValueError) as e:
        raise ServerNotFound(f"cannot read {file}: {e}") from None
    # A server killed by SIGKILL leaves server.json behind; the lock it held is
    # gone with it (and a pid may be reused: the lock is the better witness).
    holder = _lock_holder(os.path.dirname(os.path.abspath(file)))
    if holder == 0:
        raise ServerNotFound(f"no server running: {file} is left from pid {info.get('pid')}, "
                             f"which holds no lock there (a stale file)")
    if holder is None and "pid" in info and not _pid_alive(info["pid"]):
        raise ServerNotFound(f"{file} names pid {info['pid']}, which is not running (a stale file)")
    server = Server(info, file)
    try:
        server.info(timeout=timeout)
    except ClientTimeout:
        server.close()
        raise ServerNotFound(f"the server of {file} does not answer on {info.get('manager')}") from None
    return server


class Server:
    """A connection to a server's manager socket."""

    def __init__(self, info, file=None):
        self.file = file
        self.manager = info["manager"]
        self.pid = info.get("pid")
        # The server's local file socket (docs/files.md): files on this host
        # are passed by descriptor and copied inside the kernel.
        self.files_socket = info.get("files_socket")
        self._key = info["key"].encode()
        self._scheme = info.get("signature_scheme", "hmac-sha256")
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets = []
        self._sessions = []
        self._closed = False

    # -- plumbing
    def _channel(self):
        """This thread's (wire session, DEALER socket) for the manager."""
        local = self._local
        if getattr(local, "socket", None) is None:
            if self._closed:
                raise SessionClosed("this server connection is closed")
            local.wire = WireSession(key=self._key, signature_scheme=self._scheme,
                                     username="cellblock-client")
            local.socket = self._ctx.socket(zmq.DEALER)
            local.socket.linger = 0
            local.socket.connect(self.manager)
            with self._lock:
                self._sockets.append(local.socket)
        return local.wire, local.socket

    def _reset_channel(self):
        """Drops this thread's manager socket (a connection given up for lost);
        the next request connects afresh."""
        local = self._local
        sock = getattr(local, "socket", None)
        if sock is not None:
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close(linger=0)
            local.socket = None
            local.early = {}

    def _send(self, msg_type, content=None, buffers=None):
        """Sends one manager request without waiting; returns its msg_id."""
        wire, sock = self._channel()
        msg = wire.send(sock, msg_type, content or {}, buffers=buffers)
        return msg["header"]["msg_id"]

    def _wait(self, msg_id, msg_type, timeout=60.0):
        """The reply to `msg_id`: (content, buffers), or raises the exception named by
        its ename. Replies to this thread's other requests in flight are kept for them."""
        wire, sock = self._channel()
        early = self._local.__dict__.setdefault("early", {})
        if msg_id in early:
            reply = early.pop(msg_id)
        else:
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise ClientTimeout(f"no {msg_type.replace('_request', '_reply')} in "
                                        f"{timeout:g} s from {self.manager}")
                _, frames = wire.feed_identities(sock.recv_multipart(copy=True))
                reply = wire.deserialize(frames)        # verifies the signature
                parent = reply["parent_header"].get("msg_id")
                if parent == msg_id:
                    break
                if len(early) < 64:
                    early[parent] = reply               # a request still in flight
        c = reply["content"]
        if c.get("status") != "ok":
            raise error_for(c.get("ename", "ServerError"), c.get("evalue", ""))
        # A buffer received whole is handed on as the bytes it already is (a
        # download's chunk is megabytes: no second copy).
        return c, [b.obj if isinstance(getattr(b, "obj", None), bytes) and b.nbytes == len(b.obj)
                   else bytes(b) for b in reply["buffers"]]

    def request(self, msg_type, content=None, buffers=None, timeout=60.0):
        """One manager request; returns (reply content, reply buffers) or raises
        the exception named by the reply's ename. A server restarting
        (ServerRestarting: SIGHUP, an upgrade) is asked again until `timeout`."""
        deadline = time.monotonic() + timeout
        wire, sock = self._channel()
        # Signed once: sent again byte for byte, so a server serves no copy
        # twice (its replay guard takes a signature once) and the process
        # that refused ignores the rest.
        msg = wire.msg(msg_type, content or {})
        wire.send(sock, msg, buffers=buffers)
        msg_id = msg["header"]["msg_id"]
        try:
            return self._wait(msg_id, msg_type, max(0.1, deadline - time.monotonic()))
        except ServerRestarting:
            if time.monotonic() + 0.2 >= deadline:
                raise
        # The next start takes it once this connection drops (a copy written
        # as the refusing process's socket closes is lost): sent again at
        # every drop, and every 5 s at most otherwise, until answered.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClientTimeout(f"no {msg_type.replace('_request', '_reply')} in "
                                        f"{timeout:g} s from {self.manager} (it was restarting)")
                ready = dict(poller.poll(int(min(5.0, left) * 1000) + 1))
                if sock in ready:
                    try:
                        return self._wait(msg_id, msg_type, 0.1)
                    except (ServerRestarting, ClientTimeout):
                        continue  # refused again, or another request's reply
                if monitor in ready:
                    monitor.recv_multipart()
                wire.send(sock, msg, buffers=buffers)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    # -- the manager API
    def info(self, timeout=60.0):
        """server_info: version, images, pool, sessions, policy."""
        return self.request("server_info_request", {}, timeout=timeout)[0]

    def sessions(self, open_only=True):
        """The registry's sessions, newest first (dicts)."""
        return self.request("session_list_request", {"open_only": open_only})[0]["sessions"]

    def session(self, image=None, limits=None, metadata=None, runtime=None, timeout=120.0):
        """A new session in a fresh sandbox, ready to run code."""
        content = {}
        if image is not None:
            content["image"] = image
        if limits:
            content["limits"] = dict(limits)
        if metadata is not None:
            content["metadata"] = metadata
        if runtime is not None:
            content["runtime"] = runtime
        # The server never hands out a session after this client stopped waiting.
        content["timeout_s"] = timeout
        reply, _ = self.request("session_create_request", content, timeout=timeout)
        session = Session(self, reply)
        with self._lock:
            self._sessions.append(session)
        try:
            session._wait_ready(timeout=timeout)
        except BaseException:
            session.close()
            raise
        return session

    def close(self):
        """Closes the sessions this connection opened (if still open) and its sockets."""
        if self._closed:
            return
        for s in list(self._sessions):
            try:
                s.close()
            except Exception:
                pass
        self._closed = True
        with self._lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<cellblock.Server {self.manager} pid={self.pid}>"


class Session(SessionFiles):
    """One sandboxed session: a persistent kernel, its files (files.py), its budget."""

    def __init__(self, server, reply):
        self.server = server
        self.id = reply["session_id"]
        self.connection = reply["connection"]   # jupyter_client.load_connection_info() takes it
        self.limits = reply.get("limits", {})
        self.warm = reply.get("warm")
        self.runtime = reply.get("runtime")
        self.closed = False
        c = self.connection
        self._wire = WireSession(key=c["key"].encode(),
                                 signature_scheme=c.get("signature_scheme", "hmac-sha256"),
                                 username="cellblock-client")
        ctx = server._ctx

        def url(port):
            if c.get("transport", "tcp") == "ipc":
                return f"ipc://{c['ip']}-{port}"
            return f"tcp://{c['ip']}:{port}"

        self._shell = ctx.socket(zmq.DEALER)
        self._control = ctx.socket(zmq.DEALER)
        # A routing identity of its own, as jupyter_client gives its sockets:
        # a request carried over a server's restart (docs/restarts.md) is
        # answered to the connection made again with the same identity.
        self._shell.identity = self._control.identity = self._wire.bsession
        self._iopub = ctx.socket(zmq.SUB)
        self._iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self._shell, c["shell_port"]), (self._control, c["control_port"]),
                           (self._iopub, c["iopub_port"])):
            sock.linger = 0
            sock.connect(url(port))
        # Whether shell's connection dropped and came back (a server's
        # restart): run() then sends its request again, under the same
        # msg_id. The dead server may have read it and died before it was
        # recorded (libzmq counts it as sent and never sends it again); the
        # next server runs none twice (docs/restarts.md).
        self._shell_monitor = self._shell.get_monitor_socket(zmq.EVENT_CONNECTED |
                                                             zmq.EVENT_DISCONNECTED)
        self._shell_dropped = False
        self._shell_back = False

    # -- channels
    def _recv(self, sock):
        _, frames = self._wire.feed_identities(sock.recv_multipart(copy=True))
        return self._wire.deserialize(frames)

    def _wait_ready(self, timeout=60.0):
        """Until a kernel_info round trip also shows on IOPub (the SUB socket is joined)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._wire.send(self._shell, "kernel_info_request", {})
            got_reply = got_iopub = False
            until = time.monotonic() + 1.0
            while time.monotonic() < until and not (got_reply and got_iopub):
                ready = dict(self._poll(50))
                if self._shell in ready:
                    reply = self._recv(self._shell)
                    got_reply |= reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]
                if self._iopub in ready:
                    self._recv(self._iopub)
                    got_iopub = True
            if got_reply and got_iopub:
                while self._iopub.poll(100):      # the rest of that round trip's status
                    self._recv(self._iopub)
                return
        raise ClientTimeout(f"session {self.id} did not answer kernel_info in {timeout:g} s")

    def _poll(self, ms):
        """Shell and iopub sockets with a message waiting, within ms; notes
        shell's reconnections on the way (_shell_back)."""
        poller = zmq.Poller()
        poller.register(self._shell, zmq.POLLIN)
        poller.register(self._iopub, zmq.POLLIN)
        poller.register(self._shell_monitor, zmq.POLLIN)
        deadline = time.monotonic() + ms / 1000
        while True:
            ready = poller.poll(max(0, int((deadline - time.monotonic()) * 1000)))
            if not any(sock is self._shell_monitor for sock, _ in ready):
                return ready
            self._watch_shell()
            ready = [(sock, ev) for sock, ev in ready if sock is not self._shell_monitor]
            if ready or self._shell_back or time.monotonic() >= deadline:
                return ready

    def _watch_shell(self):
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                event = recv_monitor_message(self._shell_monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._shell_dropped = True
            elif event == zmq.EVENT_CONNECTED and self._shell_dropped:
                self._shell_dropped = False
                self._shell_back = True

    # -- code
    def run(self, code, *, on_stdout=None, on_stderr=None, on_result=None, on_error=None,
            timeout=None, raise_errors=True, store_history=True):
        """Executes `code` and returns an Execution.

        timeout: seconds for this execution (the server interrupts, then kills,
        past it); default the session's exec_timeout_s. Callbacks get each
        piece of output as it arrives: on_stdout(str), on_stderr(str),
        on_result(Result), on_error(Error).

        An exception raised by the code is returned in `.error`. When the
        server stops or refuses the execution (ExecutionLimitExceeded,
        ExecutionTimeout, MemoryLimitExceeded, SessionClosed, ...), the matching
        exception is raised, carrying the Execution as `.execution`, unless
        raise_errors is False.
        """
        if self.closed:
            raise SessionClosed(f"session {self.id} was closed by this client")
        content = {"code": code, "silent": False, "store_history": store_history,
                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
        metadata = {"cellblock": {"timeout_s": timeout}} if timeout else {}
        msg = self._wire.msg("execute_request", content, metadata=metadata)
        msg_id = msg["header"]["msg_id"]
        ex = Execution(code, msg_id)
        server_timeout = float(timeout or self.limits.get("exec_timeout_s") or 30.0)
        started = time.monotonic()
        deadline = started + server_timeout + KILL_GRACE_S + REPLY_MARGIN_S
        self._wire.send(self._shell, msg)
        self._shell_back = False
        reply, idle, idle_grace = None, False, None
        while not (reply is not None and idle):
            if self._shell_back and reply is None:
                self._shell_back = False
                self._wire.send(self._shell, msg)  # the server may have died with it
            now = time.monotonic()
            if reply is not None and idle_grace is None:
                idle_grace = now + 2.0            # a reply whose idle got lost
            if now >= (idle_grace or deadline):
                if reply is not None:
                    break
                raise ClientTimeout(f"no execute_reply in {deadline - started:.0f} s "
                                    f"(session {self.id})", execution=ex)
            for sock, _ in self._poll(int(((idle_grace or deadline) - now) * 1000) + 1):
                m = self._recv(sock)
                if m["parent_header"].get("msg_id") != msg_id:
                    continue
                if sock is self._shell:
                    reply = m
                else:
                    idle |= self._on_iopub(ex, m, on_stdout, on_stderr, on_result, on_error)
        ex.duration_s = time.monotonic() - started
        rc = reply["content"]
        ex.status = rc.get("status")
        ex.execution_count = rc.get("execution_count")
        ex.budget = dict(reply["metadata"].get("cellblock") or rc.get("cellblock") or {})
        if ex.status != "ok":
            # The server's own replies carry no wall_ms: the kernel never answered them.
            by_server = rc.get("ename") in POLICY_ENAMES and "wall_ms" not in ex.budget
            if ex.error is None or ex.error.ename != rc.get("ename"):
                ex.error = Error(rc.get("ename", "Error"), rc.get("evalue", ""),
                                 rc.get("traceback"), by_server)
            ex.error.by_server = by_server
            ex.timed_out = by_server and ex.error.ename == "ExecutionTimeout" or (
                ex.error.ename == "KeyboardInterrupt" and "wall_ms" in ex.budget and
                ex.budget["wall_ms"] >= 1000 * float(ex.budget.get("timeout_s", server_timeout)))
            if raise_errors and (by_server or ex.timed_out):
                ex.raise_for_error()
        return ex

    def _on_iopub(self, ex, m, on_stdout, on_stderr, on_result, on_error):
        kind, c = m["msg_type"], m["content"]
        if kind == "status":
            return c.get("execution_state") == "idle"
        if kind == "stream":
            text = c.get("text", "")
            if c.get("name") == "stderr":
                ex.stderr += text
                on_stderr and on_stderr(text)
            else:
                ex.stdout += text
                on_stdout and on_stdout(text)
            last = ex.outputs[-1] if ex.outputs else None
            if last and last["output_type"] == "stream" and last["name"] == c.get("name"):
                last["text"] += text
            else:
                ex.outputs.append({"output_type": "stream", "name": c.get("name", "stdout"),
                                   "text": text})
        elif kind in ("execute_result", "display_data"):
            main = kind == "execute_result"
            r = Result(c.get("data", {}), c.get("metadata"), main, c.get("execution_count"))
            ex.results.append(r)
            out = {"output_type": kind, "data": dict(c.get("data", {})),
                   "metadata": dict(c.get("metadata", {}))}
            if main:
                out["execution_count"] = c.get("execution_count")
            ex.outputs.append(out)
            on_result and on_result(r)
        elif kind == "error":
            ex.error = Error(c.get("ename", "Error"), c.get("evalue", ""), c.get("traceback"))
            ex.outputs.append({"output_type": "error", "ename": ex.error.ename,
                               "evalue": ex.error.evalue, "traceback": ex.error.traceback})
            on_error and on_error(ex.error)
        elif kind == "clear_output":
            ex.outputs.clear()
        return False

    def interrupt(self, timeout=10.0):
        """Sends interrupt_request on the control channel."""
        msg = self._wire.send(self._control, "interrupt_request", {})
        deadline = time.monotonic() + timeout
        while self._control.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            reply = self._recv(self._control)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]
            if time.monotonic() >= deadline:
                break
        raise ClientTimeout(f"no interrupt_reply in {timeout:g} s")

    # -- the registry
    def info(self):
        return self.server.request("session_info_request", {"session_id": self.id})[0]

    def history(self):
        return self.server.request("session_history_request", {"session_id": self.id})[0]

    def hibernate(self, timeout=600.0):
        """Saves the idle session to disk and frees its sandbox; its next request
        (or resume()) wakes it. Returns the reply ({state, snapshot_bytes, detail});
        raises HibernateFailed, with the session awake, when it cannot."""
        return self.server.request("session_hibernate_request", {"session_id": self.id},
                                   timeout=timeout)[0]

    def resume(self, timeout=600.0):
        """Wakes a hibernated session now; returns once it is awake."""
        return self.server.request("session_resume_request", {"session_id": self.id},
                                   timeout=timeout)[0]

    def close(self):
        """Closes the session: the sandbox and everything in it is destroyed."""
        if self.closed:
            return
        self.closed = True
        try:
            self.server.request("session_close_request", {"session_id": self.id})
        except SessionClosed:
            pass                  # closed already (a limit, a timeout, the kernel died)
        finally:
            self._shell.disable_monitor()
            for sock in (self._shell_monitor, self._shell, self._control, self._iopub):
                sock.close(linger=0)
            try:
                self.server._sessions.remove(self)
            except ValueError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<cellblock.Session {self.id}{' closed' if self.closed else ''}>"


__all__ = ["connect", "server_file", "Server", "Session", "Execution", "Result", "Error"]
