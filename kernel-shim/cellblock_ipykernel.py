"""Starts ipykernel inside a cellblock sandbox.

One upstream race is fixed here. After an error, ipykernel 6.17 aborts queued
execute requests until a "stop aborting" marker, which it schedules with
call_later(0): a request that becomes readable in the same event-loop turn is
dispatched before the marker and aborted, although the client sent it after
seeing the error's reply and idle status (seen here against a bare ipykernel,
about one time in three). With no stop_on_error_timeout configured, we queue
the marker right after the requests that were already waiting, so only those
are aborted, as the messaging spec intends.

Output is cut at its source. The relay passes each execution's output budget
in the request's `metadata.cellblock.output_bytes`; stdout, stderr (Python
writes and descriptor-level output alike) and display data share it, and
what passes it is dropped here, counted, and reported in the reply's
`metadata.cellblock_source` ({dropped_bytes, dropped_messages}), so a flood
costs neither this kernel's memory nor the relay's time. The relay still
enforces the same budget on what arrives: this cut saves work, it is not the
guarantee. Where the channels are CurveZMQ (a Swarm task: the front cannot
read this sandbox's cgroups), the same report carries its cgroup readings
(`usage`: CPU time at the execution's start and end, memory now and at its
peak).

Descriptor-level output (subprocesses, C libraries, `os.write(1, ...)`) is
decoded incrementally with replacement: ipykernel 6.17 decodes each 1000-byte
read strictly, and a UTF-8 character split across two reads (or any invalid
byte) ended the forwarding for the rest of the session (upstream fix:
ipykernel PR #1129).

Packages: pip installs into PIP_TARGET (the session's home, on PYTHONPATH);
the directory is made before ipykernel is imported and import caches are
dropped after every cell, so `%pip install x` then `import x` works.

Replies outlive the relay. The kernel's shell and control sockets are set to
report a reply they cannot route (ZMQ_ROUTER_MANDATORY): a reply sent while
no server relays (a crashed server, before the next one adopts the sandbox,
docs/restarts.md) is kept, in order and bounded, and sent when the relay
connects again under the same routing identity. What passes the bound is
dropped, oldest first, and logged; the server answers those requests
ServerRestarting. The last replies sent are kept too: one can be sent and
still be lost, in the dead server's socket buffer. An adopting server's first
shell request (a kernel_info_request with content
{"cellblock": {"resend_replies": true}}) has them sent again, before its own
reply; the server passes those it still owes and drops the rest.

Files move over control where the server has no directory of the session's
(a Swarm task): four cellblock_file_* requests, answered by FileTransfers,
which never follows a link the sandbox's code may have planted. A
cellblock_exit_request on control ends the kernel at once (the server closes
a session whose sandbox it cannot kill itself at once: a Swarm task).
"""
import importlib
import os
import sys


def _make_package_dir():
    # PIP_TARGET, on PYTHONPATH: made before the first import searches it, so
    # the import system keeps a finder for it that notices what pip adds.
    target = os.environ.get("PIP_TARGET")
    if target:
        try:
            os.makedirs(target, exist_ok=True)
        except OSError:
            pass


def _writable_connection_file(argv):
    # A container engine (the Swarm backend, docs/scale-out.md) hands the
    # connection file over as a read-only secret, and ipykernel writes the
    # file back as it starts: it gets a private copy in /tmp instead.
    if "-f" not in argv[:-1]:
        return
    at = argv.index("-f") + 1
    path = argv[at]
    if not os.path.exists(path) or os.access(path, os.W_OK):
        return
    with open(path, "rb") as f:
        data = f.read()
    copy = os.path.join(os.environ.get("TMPDIR", "/tmp"), "cellblock-kernel.json")
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    argv[at] = copy


_make_package_dir()

import codecs  # noqa: E402
import collections  # noqa: E402
import errno  # noqa: E402
import hashlib  # noqa: E402
import re  # noqa: E402
import stat  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import zmq  # noqa: E402

from ipykernel.heartbeat import Heartbeat  # noqa: E402
from ipykernel.iostream import OutStream  # noqa: E402
from ipykernel.ipkernel import IPythonKernel  # noqa: E402
from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from traitlets import DottedObjectName  # noqa: E402

import cellblock_egress_tunnel  # noqa: E402


class OutputBudget:
    """The running execution's output budget, shared by stdout, stderr and
    display data. `cap` None: no budget (a request without one)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.cap = None
        self.used = 0
        self.dropped_bytes = 0
        self.dropped_messages = 0

    def reset(self, cap):
        with self._lock:
            self.cap = cap if isinstance(cap, int) and cap >= 0 else None
            self.used = 0
            self.dropped_bytes = 0
            self.dropped_messages = 0

    def admit(self, size):
        """How many of `size` units may go on. One unit past the cap still
        goes, so the relay sees the budget crossed and adds its marker."""
        with self._lock:
            if self.cap is None:
                return size
            room = max(0, self.cap + 1 - self.used)
            kept = min(size, room)
            self.used += kept
            if kept < size:
                self.dropped_bytes += size - kept
                self.dropped_messages += 1
            return kept

    def report(self):
        with self._lock:
            return {"dropped_bytes": self.dropped_bytes,
                    "dropped_messages": self.dropped_messages}


BUDGET = OutputBudget()


class SandboxOutStream(OutStream):
    """ipykernel's OutStream, cut at the execution's budget before anything is
    buffered, and with descriptor-level output decoded incrementally."""

    def write(self, string):
        if not isinstance(string, str):
            raise TypeError(f"write() argument must be str, not {type(string)}")
        # Characters, not bytes: never more than the UTF-8 bytes the relay
        # counts, so what passes here always reaches the relay's own cut.
        kept = BUDGET.admit(len(string))
        if kept == 0:
            return len(string)
        if kept < len(string):
            super().write(string[:kept])
            return len(string)
        return super().write(string)

    def _watch_pipe_fd(self):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            data = os.read(self._fid, 1000)
            while data and self._should_watch:
                text = decoder.decode(data)
                if text:
                    self.write(text)
                os.write(self._original_stdstream_copy, data)
                data = os.read(self._fid, 1000)
            rest = decoder.decode(b"", final=True)
            if rest:
                self.write(rest)
        except Exception:
            self._exc = sys.exc_info()


# What a display message costs beyond its data (header, parent header,
# metadata, signature): the relay counts whole messages against the budget, so
# the kernel's estimate must reach the budget no later than the relay does.
DISPLAY_OVERHEAD = 512


def _display_size(msg):
    data = msg.get("content", {}).get("data", {})
    return DISPLAY_OVERHEAD + sum(len(v) if isinstance(v, str) else len(repr(v))
                                  for v in data.values())


def _budget_display(msg):
    # A display publisher hook: None drops the message.
    size = _display_size(msg)
    return msg if BUDGET.admit(size) == size else None


def prewarm(argv):
    """What a zygote does once so that each fork's kernel starts in half the
    time (docs/zygote.md): the kernel application parses its command line
    (the same in every session: the connection file's path inside the
    sandbox) and the kernel's IPython shell is built (its magics,
    formatters, completer and namespaces). Nothing here depends on a
    session: the connection file is read, the sockets bound, the history
    opened and the profile dir made in the fork, as in a booted kernel. The
    zygote's shell keeps its history in memory and never runs code."""
    from traitlets.config import Config
    from ipykernel.compiler import XCachingCompiler
    from ipykernel.zmqshell import ZMQInteractiveShell

    app = SandboxKernelApp.instance(kernel_class=SandboxKernel)
    app.parse_command_line(argv)
    app.prepared_argv = list(argv)
    # The configuration files: the image's (system-wide) ones, and none in a
    # session's profile dir, whose home is fresh in every session and at the
    # same path as the zygote's. Loaded here once; the fork makes the profile
    # dir itself (SandboxKernelApp.init_profile_dir).
    app.init_profile_dir()
    app.init_config_files()
    app.load_config_file()
    app.prepared_profile = app.profile_dir.location
    app.zygote_modules = _ModulesAtStart()
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = ZMQInteractiveShell.instance(config=config, compiler_class=XCachingCompiler)
    shell._cellblock_prewarmed = True
    # What a first execution would otherwise pay for once, without running
    # anything: the tokenizer's compiled patterns and the formatters' lookups.
    shell.transform_cell("1+1\n")
    shell.display_formatter.format(2)


# What a fork adopted from its zygote and leaves untouched (see below).
_ZYGOTE_LEFTOVERS = []


def _adopt_prewarmed_shell(kernel):
    """Makes the zygote's shell this kernel's, as if the kernel had built it:
    its parent, configuration, profile dir and environment are the session's,
    and its history is a fresh one in the session's own profile dir."""
    shell = kernel.shell
    shell._cellblock_prewarmed = False
    shell.parent = kernel
    shell.config = kernel.config  # without the zygote's in-memory history
    shell.kernel = kernel
    if kernel.profile_dir is not None:
        shell.profile_dir = kernel.profile_dir
        # %store's database, in the session's profile dir (a shell makes it
        # as it is built: the zygote's was in the zygote's home).
        shell.db = type(shell.db)(os.path.join(shell.profile_dir.location, "db"))
    shell.init_environment()  # TERM, PAGER, ... in the session's environment
    old = shell.history_manager
    shell.configurables.remove(old)
    # Kept, not closed: closing the zygote's (empty, in-memory) database frees
    # its memory, which writes into ~240 pages the fork shares with the
    # zygote and makes each of them a copy of its own.
    _ZYGOTE_LEFTOVERS.append(old)
    shell.init_history()
    shell.init_user_ns()  # In, Out, _ih, _oh: the new history's


class _ModulesAtStart:
    """The names in sys.modules, as IPython keeps them when a kernel starts
    (for `%reset -f --aggressive`), made from the zygote's: building the set
    anew in the fork (`set(sys.modules)`) touches every module's name, which
    copies ~480 pages out of the zygote's into each session."""

    def __init__(self):
        self.names = set(sys.modules)
        self.count = len(sys.modules)
        self.last = next(reversed(sys.modules))

    def now(self):
        """The set of sys.modules now: the zygote's names and those imported
        since, found from the end of sys.modules (it keeps the order they
        came in); a fresh set where any of the zygote's went missing."""
        added = []
        for name in reversed(sys.modules):
            if name == self.last:
                break
            added.append(name)
        else:
            return set(sys.modules)
        if len(sys.modules) != self.count + len(added):
            return set(sys.modules)
        self.names.update(added)
        return self.names


def _forget_finders_under(home):
    """The import system's cached finders for the entries of the import path
    in the session's home (the package dir on PYTHONPATH, the working
    directory), which a zygote's fork inherits from an older home at the same
    path, and for those that found no directory: searched afresh at the next
    import. The rest of the zygote's finders stay warm
    (importlib.invalidate_caches would make the next import of each list its
    directory again). Only the import path's entries are looked at: going
    through the whole cache would touch each of its objects, and so copy the
    ~280 pages they lie on out of the zygote's."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None
    cache = sys.path_importer_cache
    # ("" on the path, which ipykernel adds later, is the working directory.)
    for entry in [*sys.path, home, cwd]:
        path = cwd if entry in ("", ".") else entry
        if path and path in cache and (cache[path] is None or path == home or
                                       path.startswith(home + os.sep)):
            del cache[path]


class KeptReplies:
    """What the kernel sends on one ROUTER socket (shell or control), sent at
    once when its peer is connected, and kept while it is not: the socket
    reports an identity it cannot route (EHOSTUNREACH) instead of dropping
    the message, and a full peer (EAGAIN) instead of blocking. Kept messages
    go out in order, before any later one, when the relay connects again
    under the same identity: at the next send, or at a retry every 100 ms on
    the socket's own event loop (the shell's waits for a running execution to
    end). Used from the socket's own thread only.

    The socket is its ZMQStream's, which watches it for requests: a send
    outside the stream can take the readiness edge (libzmq's descriptor is
    edge-triggered) of a request that came meanwhile, and the stream would
    never read it (seen here: a kernel that answered nothing more). So after
    sending, the stream is asked to read what waits (_check_readable)."""

    RETRY_S = 0.1
    # The replies sent last, for resend_recent.
    RECENT_MESSAGES = 32
    RECENT_BYTES = 16 << 20

    def __init__(self, stream, name, max_messages=1000, max_bytes=64 << 20):
        stream.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.stream = stream
        self.socket = stream.socket
        self.io_loop = stream.io_loop
        self.name = name
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.kept = collections.deque()
        self.kept_bytes = 0
        self.dropped = 0
        self.recent = collections.deque()
        self.recent_bytes = 0
        self._retry_armed = False
        self._check_armed = False

    # What jupyter_client's Session.send calls on its stream.
    def send_multipart(self, frames, flags=0, copy=True, track=False, **kwargs):
        if not self.kept and self._send(frames):
            self._sent(frames, sum(len(f) for f in frames))
            return
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
        size = sum(len(f) for f in frames)
        self.kept.append((frames, size))
        self.kept_bytes += size
        while self.kept and (len(self.kept) > self.max_messages
                             or self.kept_bytes > self.max_bytes):
            _, dropped = self.kept.popleft()
            self.kept_bytes -= dropped
            self.dropped += 1
            print(f"cellblock: {self.name}: a reply kept while no relay was connected was "
                  f"dropped (over {self.max_messages} messages or {self.max_bytes} bytes; "
                  f"{self.dropped} so far)", file=sys.__stderr__, flush=True)
        self.flush()

    def _send(self, frames):
        """True: sent; False: no peer to take it now (kept by the caller)."""
        if not self._check_armed:
            self._check_armed = True
            self.io_loop.add_callback(self._check_readable)
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._arm_retry()
            return False

    def flush(self):
        while self.kept:
            frames, size = self.kept[0]
            if not self._send(frames):
                return
            self.kept.popleft()
            self.kept_bytes -= size
            self._sent(frames, size)

    def _check_readable(self):
        self._check_armed = False
        if not self.stream.closed() and self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.stream.flush(zmq.POLLIN)

    def _sent(self, frames, size):
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
        self.recent.append((frames, size))
        self.recent_bytes += size
        while len(self.recent) > self.RECENT_MESSAGES or self.recent_bytes > self.RECENT_BYTES:
            self.recent_bytes -= self.recent.popleft()[1]

    def resend_recent(self):
        """Sends the last replies again, in order, ahead of anything later."""
        again = list(self.recent)
        self.recent.clear()
        self.recent_bytes = 0
        self.kept.extendleft(reversed(again))
        self.kept_bytes += sum(size for _, size in again)
        self.flush()

    def _arm_retry(self):
        if not self._retry_armed:
            self._retry_armed = True
            self.io_loop.call_later(self.RETRY_S, self._retry)

    def _retry(self):
        self._retry_armed = False
        if self.stream.closed():
            return
        self.flush()


def _keep_replies(kernel):
    """Routes the kernel's shell and control replies through a KeptReplies
    each (every reply goes through Session.send)."""
    keepers = {}
    for stream, name in ((kernel.shell_stream, "shell"), (kernel.control_stream, "control")):
        if stream is not None:
            keepers[id(stream)] = KeptReplies(stream, name)
    if not keepers:
        return
    session = kernel.session
    send = session.send

    def send_kept(stream, *args, **kwargs):
        keeper = keepers.get(id(stream))
        if keeper is not None:
            kwargs.pop("track", None)
            return send(keeper, *args, **kwargs)
        return send(stream, *args, **kwargs)

    session.send = send_kept
    kernel._cellblock_kept_replies = keepers


# What a client sees of an execution: counted when published to no one.
OUTPUT_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result",
                          "error"})


class Unheard:
    """What the kernel published on iopub while no relay listened (its
    server dead, the next one not yet adopting the sandbox: docs/restarts.md),
    per execution. ipykernel's PUB drops what no one subscribes to; a socket
    monitor on it (read on the iopub thread) says when the relay's connection
    goes and comes back. Counting starts at the first disconnection seen, so
    a monitor set up after the relay connected never counts what was heard.
    A lower bound: the instants between the server's death and the
    kernel's seeing it, and a subscription still joining, are not counted."""

    def __init__(self):
        self._lock = threading.Lock()
        self.peers = 0
        self.lost_one = False  # a disconnection seen
        self.by_parent = {}    # msg_id: [messages, bytes]

    def watch(self, iopub_thread):
        def start():
            from zmq.eventloop.zmqstream import ZMQStream
            monitor = iopub_thread.socket.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            ZMQStream(monitor, iopub_thread.io_loop).on_recv(self._on_event)
        iopub_thread.io_loop.add_callback(start)

    def _on_event(self, frames):
        from zmq.utils.monitor import parse_monitor_message
        event = parse_monitor_message(frames)["event"]
        with self._lock:
            if event == zmq.EVENT_DISCONNECTED:
                self.peers = max(0, self.peers - 1)
                self.lost_one = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.peers += 1

    def note(self, msg_type, content, parent):
        if msg_type not in OUTPUT_TYPES or not isinstance(parent, dict):
            return
        with self._lock:
            if not self.lost_one or self.peers > 0:
                return
            msg_id = (parent.get("header") or {}).get("msg_id") or parent.get("msg_id")
            if not msg_id:
                return
            counted = self.by_parent.setdefault(msg_id, [0, 0])
            counted[0] += 1
            counted[1] += _content_size(content)

    def take(self, msg_id):
        with self._lock:
            messages, size = self.by_parent.pop(msg_id, (0, 0))
            return {"unheard_messages": messages, "unheard_bytes": size}


def _content_size(content):
    if not isinstance(content, dict):
        return 0
    if isinstance(content.get("text"), str):
        return len(content["text"].encode("utf-8", "replace"))
    data = content.get("data")
    if isinstance(data, dict):
        return sum(len(v) if isinstance(v, str) else len(repr(v)) for v in data.values())
    return len(repr(content))


UNHEARD = Unheard()


class CgroupUsage:
    """This sandbox's own cgroup as its kernel reads it: CPU time and memory,
    at the start and the end of each execution, reported on its reply
    (`metadata.cellblock_source.usage`). Only a server that cannot read the
    sandbox's cgroups itself (a Swarm task on another node) takes the report;
    a local one keeps the host's reading. So it is read only where the
    channels are CurveZMQ, i.e. the front is across a network (`enabled`,
    set by SandboxKernelApp): a local session pays nothing for it (the
    reads cost about 0.1 ms per execution where the cgroup is readable).
    cgroup v2 (the container's root at /sys/fs/cgroup) or v1 (the
    container's own controller dirs)."""

    CPU_V2 = "/sys/fs/cgroup/cpu.stat"
    CPU_V1 = ("/sys/fs/cgroup/cpuacct/cpuacct.usage", "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage")
    MEMORY = (("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.peak"),
              ("/sys/fs/cgroup/memory/memory.usage_in_bytes",
               "/sys/fs/cgroup/memory/memory.max_usage_in_bytes"))

    def __init__(self):
        self.enabled = False
        self.cpu_ns_at_start = None

    @staticmethod
    def _number(path):
        try:
            with open(path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def cpu_ns(self):
        try:
            with open(self.CPU_V2) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == "usage_usec":
                        return int(value) * 1000
        except (OSError, ValueError):
            pass
        for path in self.CPU_V1:
            value = self._number(path)
            if value is not None:
                return value
        return None

    def start(self):
        if self.enabled:
            self.cpu_ns_at_start = self.cpu_ns()

    def report(self):
        """{cpu_ns, cpu_ns_at_start, memory_bytes, memory_peak_bytes}, or
        None when not enabled or where this sandbox's cgroup cannot be read."""
        cpu = self.cpu_ns() if self.enabled else None
        if cpu is None:
            return None
        start = self.cpu_ns_at_start if self.cpu_ns_at_start is not None else cpu
        out = {"cpu_ns": cpu, "cpu_ns_at_start": min(start, cpu)}
        for current, peak in self.MEMORY:
            now = self._number(current)
            if now is not None:
                out["memory_bytes"] = now
                out["memory_peak_bytes"] = max(now, self._number(peak) or 0)
                break
        return out


USAGE = CgroupUsage()


def _count_unheard(kernel):
    """Every iopub message goes through Session.send (streams, displays,
    results, errors): those published to no one are counted (Unheard)."""
    thread = getattr(kernel, "iopub_thread", None)
    if thread is None or getattr(thread, "socket", None) is None:
        return
    UNHEARD.watch(thread)
    session = kernel.session
    send = session.send

    def send_counted(stream, msg_or_type, content=None, parent=None, *args, **kwargs):
        if isinstance(msg_or_type, str):
            UNHEARD.note(msg_or_type, content, parent)
        elif isinstance(msg_or_type, dict):  # displays and results come built
            UNHEARD.note(msg_or_type.get("msg_type") or
                         (msg_or_type.get("header") or {}).get("msg_type"),
                         msg_or_type.get("content"), msg_or_type.get("parent_header"))
        return send(stream, msg_or_type, content, parent, *args, **kwargs)

    session.send = send_counted


class TransferRefused(Exception):
    """A file request answered with an error reply: a stable `ename` and a
    sentence naming the path and the numbers."""

    def __init__(self, ename, evalue):
        super().__init__(evalue)
        self.ename = ename
        self.evalue = evalue


def _refused_by_os(error, what, missing="FileError"):
    # `missing`: what a missing name is to this request (a read's
    # FileNotFound; to a write it is just a failed step).
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TransferRefused("DiskFull", f"{what}: the disk is full ({error.strerror})")
    if error.errno == errno.ENOENT:
        return TransferRefused(missing, f"{what}: no such file or directory")
    return TransferRefused("FileError", f"{what}: {error.strerror}")


def _refused_opening(error, dir_fd, name, shown, missing):
    # O_NOFOLLOW answers a link with ELOOP, or with ENOTDIR beside
    # O_DIRECTORY, as it answers a plain file: lstat says which it was.
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return TransferRefused("FileError",
                                       f"{shown} is a symbolic link, which is never followed")
        except OSError:
            pass
    return _refused_by_os(error, shown, missing)


def _shown(value):
    # A value the front sent, quoted in a message at a bounded length.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Fd:
    """An open descriptor, closed once."""

    def __init__(self, fd):
        self.fd = fd

    def close(self):
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_root(root, missing):
    # The root's own path is the operator's (the environment's), so it is
    # followed; below it nothing is.
    try:
        return _Fd(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as e:
        raise _refused_by_os(e, f"the directory {root}", missing) from None


def _open_dir(at, name, shown, missing):
    try:
        return _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
    except OSError as e:
        raise _refused_opening(e, at.fd, name, shown, missing) from None


def _open_parent(root, parts, missing, make=False):
    """The directory that holds parts[-1] under `root`, reached one component
    at a time without following a link; with `make`, missing ones are made
    (0755). A refusal names the whole path, then the component at fault."""
    try:
        at = _open_root(root, missing)
        try:
            for depth, name in enumerate(parts[:-1]):
                below = _open_component(at, name, os.path.join(root, *parts[:depth + 1]),
                                        missing, make)
                at.close()
                at = below
        except BaseException:
            at.close()
            raise
        return at
    except TransferRefused as e:
        raise TransferRefused(e.ename, f"{os.path.join(root, *parts)}: {e.evalue}") from None


def _open_component(at, name, shown, missing, make):
    try:
        return _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
    except FileNotFoundError:
        if not make:
            raise TransferRefused(missing, f"{shown} does not exist") from None
    except OSError as e:
        raise _refused_opening(e, at.fd, name, shown, missing) from None
    try:
        os.mkdir(name, 0o755, dir_fd=at.fd)
    except FileExistsError:
        pass  # made meanwhile: opened (and checked) below
    except OSError as e:
        raise _refused_by_os(e, f"making the directory {shown}") from None
    return _open_dir(at, name, shown, missing)


class _Upload:
    """One upload: its partial file, open for writing, in the partial dir."""

    def __init__(self, transfer, path, partial_dir, partial, now):
        self.transfer = transfer
        self.path = path
        self.partial_dir = partial_dir
        self.partial = partial
        self.written = 0
        self.sha256 = hashlib.sha256()
        self.touched = now

    def write(self, chunk):
        view = memoryview(chunk).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self.partial.fd, view[done:])
        self.sha256.update(view)
        self.written += len(view)

    def close(self, remove=True):
        self.partial.close()
        if remove:
            try:
                os.unlink(self.transfer, dir_fd=self.partial_dir.fd)
            except OSError:
                pass
        self.partial_dir.close()


class _Download:
    """One download: the file, open for reading, and its size at open."""

    def __init__(self, path, file, size, now):
        self.path = path
        self.file = file
        self.size = size
        self.sent = 0
        self.sha256 = hashlib.sha256()
        self.touched = now

    def close(self):
        self.file.close()


class FileTransfers:
    """Files moved between the front and this sandbox over the kernel's
    control channel, where the server has no directory of the session's on
    its own host (a Swarm task on another node, docs/scale-out.md).

    The front sends four requests on control; each is answered there with
    its `_reply`:
    - `cellblock_file_write_request` {transfer, path, offset, last} with one
      buffer (the next chunk): an upload into the input dir. Offset 0 starts
      it in `<input>/.cellblock-partial/<transfer>`; each later chunk must
      start where the last ended; the last one is synced and renamed onto
      `path` (its parent dirs made), answered with the sha256 of every byte.
    - `cellblock_file_read_request` {transfer, path, offset, length}: the
      next chunk of an output file (the buffer of the reply), never past
      its size at offset 0; the last one (`eof`) carries the sha256.
    - `cellblock_file_list_request` {max_files, max_depth}: the output
      dir's regular files (path, size, mtime).
    - `cellblock_file_abort_request` {transfer}: ends a transfer, removing
      an upload's partial file.
    An error is {status: error, ename, evalue, transfer}: InvalidPath,
    FileNotFound, FileError, DiskFull; it ends the transfer.

    Control, not shell: it is already encrypted and signed to the front, and
    it is served on its own thread, so files move while a cell runs.
    Nothing below a root is reached through a symbolic link: the code in the
    sandbox runs as this kernel's uid and may plant one anywhere, to turn a
    write or a read of the front's somewhere the front did not mean. Nor
    does an open wait: a FIFO planted where a file is expected is refused,
    not waited on (that would stop the control thread, and interrupts with
    it). Used from the control thread only."""

    MESSAGES = ("cellblock_file_write_request", "cellblock_file_read_request",
                "cellblock_file_list_request", "cellblock_file_abort_request")
    MAX_OPEN = 8
    IDLE_S = 120.0
    MAX_READ = 8 << 20
    MAX_PATH_BYTES = 4096
    LIST_MAX_FILES = 1000
    LIST_MAX_DEPTH = 8
    # Past this a listing says `truncated` rather than hold a descriptor
    # per level of a tree the sandbox's code may make as deep as it likes.
    LIST_DEPTH_LIMIT = 128
    PARTIAL_DIR = ".cellblock-partial"
    SNAPSHOT_FILE = ".cellblock-snapshot"  # the hibernation snapshot (docs/hibernation.md)
    TRANSFER_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._open = {}  # transfer id: _Upload or _Download

    @staticmethod
    def input_root():
        return os.environ.get("CELLBLOCK_INPUT_DIR", "/data/input")

    @staticmethod
    def output_root():
        return os.environ.get("CELLBLOCK_OUTPUT_DIR", "/data/output")

    def answer(self, msg_type, content, buffers):
        """(reply content, reply buffers) for one request; never raises."""
        content = content if isinstance(content, dict) else {}
        handle = {"cellblock_file_write_request": self.write_file,
                  "cellblock_file_read_request": self.read_file,
                  "cellblock_file_list_request": self.list_files,
                  "cellblock_file_abort_request": self.abort_transfer}[msg_type]
        try:
            self._drop_idle()
            return handle(content, list(buffers or []))
        except TransferRefused as e:
            refused = e
        except OSError as e:
            refused = _refused_by_os(e, f"{msg_type} for {_shown(content.get('path'))}")
        except Exception as e:
            refused = TransferRefused("FileError", f"{msg_type} for {_shown(content.get('path'))} "
                                                   f"failed: {e!r}")
        reply = {"status": "error", "ename": refused.ename, "evalue": refused.evalue}
        if msg_type != "cellblock_file_list_request":
            transfer = content.get("transfer")
            reply["transfer"] = transfer
            if isinstance(transfer, str):
                self._drop(transfer)
        return reply, []

    def open_count(self):
        return len(self._open)

    def write_file(self, content, buffers):
        transfer = self._transfer_id(content)
        path, parts = self._path(content)
        if parts[0] == self.PARTIAL_DIR:
            raise TransferRefused("InvalidPath", f"{path}: {self.PARTIAL_DIR} holds the "
                                                 "uploads being written, not a target")
        offset = self._number(content, "offset", 0, doing=f"writing {path}")
        last = content.get("last")
        if not isinstance(last, bool):
            raise TransferRefused("FileError", f"writing {path}: `last` is {_shown(last)}, "
                                               "not true or false")
        if len(buffers) != 1:
            raise TransferRefused("FileError", f"writing {path} at offset {offset}: the request "
                                               f"carries {len(buffers)} buffers, not 1")
        upload = self._at(_Upload, transfer, path, offset,
                          lambda: self._started_upload(transfer, path))
        upload.touched = self._clock()
        try:
            upload.write(buffers[0])
        except OSError as e:
            raise _refused_by_os(e, f"writing {path} at offset {offset}") from None
        reply = {"status": "ok", "transfer": transfer, "written": upload.written}
        if not last:
            return reply, []
        self._finish_upload(upload, parts)
        del self._open[transfer]
        upload.close(remove=False)
        reply.update(sha256=upload.sha256.hexdigest(), path=path)
        return reply, []

    def read_file(self, content, buffers):
        transfer = self._transfer_id(content)
        path, parts = self._path(content)
        offset = self._number(content, "offset", 0, doing=f"reading {path}")
        length = self._number(content, "length", 1, doing=f"reading {path}")
        if length > self.MAX_READ:
            raise TransferRefused("FileError", f"reading {path}: a chunk of {length} bytes asked, "
                                               f"at most {self.MAX_READ} are sent at once")
        download = self._at(_Download, transfer, path, offset,
                            lambda: self._start_download(path, parts))
        download.touched = self._clock()
        wanted = max(0, min(length, download.size - offset))
        data = b""
        try:
            while len(data) < wanted:
                more = os.pread(download.file.fd, wanted - len(data), offset + len(data))
                if not more:
                    break
                data += more
        except OSError as e:
            raise _refused_by_os(e, f"reading {path} at offset {offset}") from None
        if len(data) < wanted:
            raise TransferRefused("FileError", f"{path} changed while being read: it had "
                                               f"{download.size} bytes at the start, and ends at "
                                               f"{offset + len(data)}")
        download.sha256.update(data)
        download.sent += len(data)
        eof = offset + len(data) >= download.size
        reply = {"status": "ok", "transfer": transfer, "size": download.size, "offset": offset,
                 "eof": eof}
        if eof:
            reply["sha256"] = download.sha256.hexdigest()
            del self._open[transfer]
            download.close()
        return reply, [data]

    def list_files(self, content, buffers):
        max_files = self._number(content, "max_files", 0, self.LIST_MAX_FILES)
        max_depth = self._number(content, "max_depth", 0, self.LIST_MAX_DEPTH)
        root = self.output_root()
        try:
            at = _open_root(root, "FileNotFound")
        except TransferRefused as e:
            if e.ename == "FileNotFound":
                return {"status": "ok", "files": [], "truncated": False}, []
            raise
        listing = _Listing(max_files, min(max_depth, self.LIST_DEPTH_LIMIT),
                           skipped={self.PARTIAL_DIR, self.SNAPSHOT_FILE})
        with at:
            listing.walk(at)
        return {"status": "ok", "files": listing.files, "truncated": listing.truncated}, []

    def abort_transfer(self, content, buffers):
        transfer = self._transfer_id(content)
        ended = self._open.pop(transfer, None)
        if ended is not None:
            ended.close()
        return {"status": "ok", "transfer": transfer, "aborted": ended is not None}, []

    def _transfer_id(self, content):
        transfer = content.get("transfer")
        if not isinstance(transfer, str) or not self.TRANSFER_ID.fullmatch(transfer):
            raise TransferRefused("FileError", f"the transfer id {_shown(transfer)} is not 1 to 64 "
                                               "characters of [0-9a-zA-Z_-]")
        return transfer

    def _path(self, content):
        """(path, its components), or InvalidPath."""
        path = content.get("path")
        if not isinstance(path, str):
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is not a string")
        try:
            size = len(path.encode("utf-8"))
        except UnicodeEncodeError:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is not UTF-8") from None
        if size > self.MAX_PATH_BYTES:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} has {size} bytes, more "
                                                 f"than {self.MAX_PATH_BYTES}")
        if "\0" in path:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} holds a NUL")
        if path.startswith("/"):
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is absolute, not "
                                                 "relative to its directory")
        parts = path.split("/")
        for part in parts:
            if part in ("", ".", ".."):
                raise TransferRefused("InvalidPath", f"the path {_shown(path)} has a "
                                                     f"{_shown(part)} component")
        return path, parts

    @staticmethod
    def _number(content, name, least, default=None, doing="listing"):
        value = content.get(name, default)
        if type(value) is not int or value < least:
            raise TransferRefused("FileError", f"{doing}: {name} is {_shown(value)}, not a "
                                               f"whole number of at least {least}")
        return value

    def _check_room(self, transfer, path):
        if len(self._open) >= self.MAX_OPEN:
            raise TransferRefused("FileError", f"{self.MAX_OPEN} file transfers are open: "
                                               f"transfer {transfer} ({path}) can start when one "
                                               "ends or is aborted")

    def _at(self, kind, transfer, path, offset, start):
        """The transfer a chunk at `offset` belongs to: started anew (`start()`)
        at offset 0, else the open one of that kind and path, where the last
        chunk ended."""
        if offset == 0:
            self._drop(transfer)
            self._check_room(transfer, path)
            going = start()
            self._open[transfer] = going
            return going
        going = self._open.get(transfer)
        upload = kind is _Upload
        what, doing = ("upload", "writing") if upload else ("download", "reading")
        if not isinstance(going, kind):
            raise TransferRefused("FileError", f"{doing} {path} at offset {offset}: no {what} "
                                               f"{transfer} is open (one starts at offset 0)")
        if going.path != path:
            raise TransferRefused("FileError", f"{doing} {path} at offset {offset}: {what} "
                                               f"{transfer} is of {going.path}")
        moved = going.written if upload else going.sent
        if offset != moved:
            raise TransferRefused("FileError", f"{doing} {path}: the chunk is at offset {offset}, "
                                               f"but {moved} bytes were "
                                               f"{'written' if upload else 'sent'} so far")
        return going

    def _started_upload(self, transfer, path):
        try:
            return self._start_upload(transfer, path)
        except TransferRefused as e:
            raise TransferRefused(e.ename, f"starting the upload of {path}: {e.evalue}") \
                from None

    def _drop(self, transfer):
        dropped = self._open.pop(transfer, None)
        if dropped is not None:
            dropped.close()

    def _drop_idle(self):
        now = self._clock()
        for transfer in [t for t, going in self._open.items() if now - going.touched > self.IDLE_S]:
            self._drop(transfer)

    def _start_upload(self, transfer, path):
        root = self.input_root()
        shown = os.path.join(root, self.PARTIAL_DIR)
        with _open_root(root, "FileError") as at:
            try:
                os.mkdir(self.PARTIAL_DIR, 0o700, dir_fd=at.fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise _refused_by_os(e, f"making {shown}") from None
            partial_dir = _open_dir(at, self.PARTIAL_DIR, shown, "FileError")
        try:
            # O_NONBLOCK: a FIFO planted here fails at once instead of
            # waiting for a reader.
            partial = _Fd(os.open(transfer, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=partial_dir.fd))
        except OSError as e:
            refused = _refused_opening(e, partial_dir.fd, transfer,
                                       os.path.join(shown, transfer), "FileError")
            # What was planted at the partial's name goes (the link, not
            # what it names), as a partial would.
            try:
                os.unlink(transfer, dir_fd=partial_dir.fd)
            except OSError:
                pass
            partial_dir.close()
            raise refused from None
        upload = _Upload(transfer, path, partial_dir, partial, self._clock())
        try:
            if not stat.S_ISREG(os.fstat(partial.fd).st_mode):
                raise TransferRefused("FileError", f"{os.path.join(shown, transfer)} is not a "
                                                   "regular file")
        except BaseException:
            upload.close()
            raise
        return upload

    def _finish_upload(self, upload, parts):
        root = self.input_root()
        target = os.path.join(root, upload.path)
        try:
            os.fsync(upload.partial.fd)
            ours = os.fstat(upload.partial.fd)
            there = os.stat(upload.transfer, dir_fd=upload.partial_dir.fd, follow_symlinks=False)
        except OSError as e:
            raise _refused_by_os(e, f"finishing {target} ({upload.written} bytes)") from None
        # The sandbox's code may swap the partial file for its own: what is
        # renamed must be what was written and hashed.
        if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
            raise TransferRefused("FileError", f"the partial file of {target} was replaced while "
                                               f"being written ({upload.written} bytes)")
        upload.partial.close()
        with _open_parent(root, parts, "FileError", make=True) as parent:
            try:
                os.replace(upload.transfer, parts[-1], src_dir_fd=upload.partial_dir.fd,
                           dst_dir_fd=parent.fd)
            except IsADirectoryError:
                raise TransferRefused("FileError", f"{target} is a directory") from None
            except OSError as e:
                raise _refused_by_os(e, f"moving {upload.written} bytes into {target}") from None

    def _start_download(self, path, parts):
        root = self.output_root()
        target = os.path.join(root, path)
        with _open_parent(root, parts, "FileNotFound") as parent:
            try:
                # O_NONBLOCK: a FIFO planted here is refused, not waited on.
                file = _Fd(os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                                   | os.O_NONBLOCK, dir_fd=parent.fd))
            except OSError as e:
                raise _refused_opening(e, parent.fd, parts[-1], target, "FileNotFound") from None
        try:
            st = os.fstat(file.fd)
            if not stat.S_ISREG(st.st_mode):
                raise TransferRefused("FileError", f"{target} is not a regular file")
        except BaseException:
            file.close()
            raise
        return _Download(path, file, st.st_size, self._clock())


class _Listing:
    """The regular files under a directory, walked in the order of their
    paths (so the first `max_files` found are the first in order), without
    following a link. `truncated`: some were left out (more files than
    `max_files`, a directory deeper than `max_depth`, or one that could not
    be read or that a JSON string cannot name)."""

    class _Full(Exception):
        pass

    def __init__(self, max_files, max_depth, skipped):
        self.max_files = max_files
        self.max_depth = max_depth
        self.skipped = skipped  # names left out at the top
        self.files = []
        self.truncated = False

    def walk(self, at):
        try:
            self._walk(at, "", 0)
        except self._Full:
            self.truncated = True

    def _walk(self, at, prefix, depth):
        try:
            with os.scandir(at.fd) as found:
                entries = [(e, e.is_dir(follow_symlinks=False)) for e in found]
        except OSError:
            self.truncated = True
            return
        # A directory sorts as "name/": its files then come where their
        # paths do among its siblings' ("a-b" before "a/c").
        entries.sort(key=lambda pair: pair[0].name + "/" if pair[1] else pair[0].name)
        for entry, is_dir in entries:
            name = entry.name
            if depth == 0 and name in self.skipped:
                continue
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                self.truncated = True
                continue
            if is_dir:
                if depth + 1 > self.max_depth:
                    self.truncated = True
                    continue
                try:
                    below = _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
                except OSError:  # gone, or made a link, since it was listed
                    self.truncated = True
                    continue
                with below:
                    self._walk(below, prefix + name + "/", depth + 1)
            elif entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since it was listed
                if len(self.files) == self.max_files:
                    raise self._Full()
                self.files.append({"path": prefix + name, "size": st.st_size,
                                   "mtime": st.st_mtime})


class SandboxKernel(IPythonKernel):
    # ipykernel builds its control dispatch table from this list.
    control_msg_types = (IPythonKernel.control_msg_types + list(FileTransfers.MESSAGES)
                         + ["cellblock_exit_request"])

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.file_transfers = FileTransfers()
        if getattr(self.shell, "_cellblock_prewarmed", False):
            _adopt_prewarmed_shell(self)
        # A session forked from a zygote has a fresh home: make the package
        # dir there too. After each cell the import caches are dropped, so a
        # package `%pip install`ed in one cell imports in the next.
        _make_package_dir()
        _forget_finders_under(os.path.expanduser("~"))
        self.shell.events.register("post_execute", importlib.invalidate_caches)
        self.shell.display_pub.register_hook(_budget_display)
        _keep_replies(self)
        _count_unheard(self)

    def init_metadata(self, parent):
        metadata = super().init_metadata(parent)
        cellblock = (parent.get("metadata") or {}).get("cellblock")
        BUDGET.reset(cellblock.get("output_bytes") if isinstance(cellblock, dict) else None)
        USAGE.start()
        return metadata

    def finish_metadata(self, parent, metadata, reply_content):
        metadata = super().finish_metadata(parent, metadata, reply_content)
        metadata["cellblock_source"] = dict(
            BUDGET.report(), **UNHEARD.take((parent.get("header") or {}).get("msg_id")))
        usage = USAGE.report()
        if usage is not None:
            metadata["cellblock_source"]["usage"] = usage
        return metadata

    async def kernel_info_request(self, stream, ident, parent):
        # An adopting server's fence (docs/restarts.md): the replies sent
        # last go again first, for those lost in the dead server's buffers.
        ask = (parent.get("content") or {}).get("cellblock")
        keepers = getattr(self, "_cellblock_kept_replies", {})
        if isinstance(ask, dict) and ask.get("resend_replies") and id(stream) in keepers:
            keepers[id(stream)].resend_recent()
        return await super().kernel_info_request(stream, ident, parent)

    async def cellblock_file_write_request(self, stream, ident, parent):
        self._answer_file_request(stream, ident, parent)

    async def cellblock_file_read_request(self, stream, ident, parent):
        self._answer_file_request(stream, ident, parent)

    async def cellblock_file_list_request(self, stream, ident, parent):
        self._answer_file_request(stream, ident, parent)

    async def cellblock_file_abort_request(self, stream, ident, parent):
        self._answer_file_request(stream, ident, parent)

    async def cellblock_exit_request(self, stream, ident, parent):
        # The server ends the session and its sandbox cannot be killed at once
        # (a Swarm task, whose shim holds the engine's SIGTERM through a
        # drain): exit now, whatever the shell thread is doing. No reply:
        # the server does not wait for one.
        os._exit(0)

    def _answer_file_request(self, stream, ident, parent):
        msg_type = parent["header"]["msg_type"]
        content, buffers = self.file_transfers.answer(msg_type, parent.get("content"),
                                                      parent.get("buffers"))
        self.session.send(stream, msg_type.replace("_request", "_reply"), content, parent, ident,
                          buffers=buffers)

    def _abort_queues(self):
        if self.stop_on_error_timeout or not hasattr(self, "schedule_dispatch"):
            return super()._abort_queues()
        self._aborting = True
        # Move every request already received into the queue, then the marker.
        self.shell_stream.flush()

        async def stop_aborting():
            self._aborting = False

        self.schedule_dispatch(stop_aborting)


def _cellblock_fields(path):
    # The connection file with cellblock's own fields: the kernel's CurveZMQ
    # secret key (Z85), when its channels leave the host (a Swarm node's),
    # and the port of its egress tunnel, when it has one.
    import json

    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _make_curve_server(sock, secret_key):
    if not zmq.has("curve"):
        raise RuntimeError("the connection file asks for CurveZMQ, which this kernel's "
                           "libzmq was built without")
    sock.curve_secretkey = secret_key.encode()
    sock.curve_publickey = zmq.curve_public(secret_key.encode())
    sock.curve_server = True


class _CurveHeartbeat(Heartbeat):
    # ipykernel's heartbeat makes and binds its socket in its own thread.
    def __init__(self, secret_key, *args, **kwargs):
        self._curve_secret_key = secret_key
        super().__init__(*args, **kwargs)

    def _try_bind_socket(self):
        _make_curve_server(self.socket, self._curve_secret_key)
        return super()._try_bind_socket()


class SandboxKernelApp(IPKernelApp):
    # This module's, by the name it runs under (__main__ when booted, imported
    # by name in a zygote): one OutputBudget for the kernel and its streams.
    outstream_class = DottedObjectName(f"{__name__}.SandboxOutStream").tag(config=True)
    # The command line the zygote parsed already (prewarm): not parsed again.
    prepared_argv = None
    # The image's preload, which a zygote imported (set there, for its forks).
    preloaded = ()
    # The profile dir whose configuration the zygote loaded (prewarm).
    prepared_profile = None
    # sys.modules in the zygote (prewarm).
    zygote_modules = None

    # Set from the connection file: every channel, heartbeat included, is a
    # CurveZMQ server with it, and the front connects with its public half
    # (docs/scale-out.md, "Encryption"). Read before ipykernel writes the
    # file again without cellblock's fields.
    curve_secret_key = None
    # A Swarm task's way out (cellblock_egress_tunnel), one more CurveZMQ
    # server of the kernel's key, on the port the connection file names.
    egress_tunnel = None

    def init_connection_file(self):
        super().init_connection_file()
        fields = _cellblock_fields(self.abs_connection_file)
        self.curve_secret_key = fields.get("curve_secret_key") or None
        USAGE.enabled = bool(self.curve_secret_key)  # a front that cannot read our cgroups
        if self.curve_secret_key:
            self.egress_tunnel = cellblock_egress_tunnel.start_from_connection_file(
                fields, self.curve_secret_key)

    def _bind_socket(self, s, port):
        if self.curve_secret_key:
            _make_curve_server(s, self.curve_secret_key)
        return super()._bind_socket(s, port)

    def init_heartbeat(self):
        if not self.curve_secret_key:
            return super().init_heartbeat()
        # As IPKernelApp.init_heartbeat, with a CURVE socket.
        self.heartbeat = _CurveHeartbeat(self.curve_secret_key, zmq.Context(),
                                         (self.transport, self.ip, self.hb_port))
        self.hb_port = self.heartbeat.port
        self.heartbeat.start()

    def _prepared(self):
        # The fork's home is where the zygote's was (HOME, IPYTHONDIR).
        from IPython.paths import get_ipython_dir

        return (self.prepared_profile is not None and self.profile_dir is not None
                and self.profile_dir.location == self.prepared_profile
                and self.ipython_dir == get_ipython_dir())

    def init_profile_dir(self):
        if not self._prepared():
            return super().init_profile_dir()
        # As IPython makes it in a fresh home: the dir, then its subdirs.
        os.makedirs(self.prepared_profile, exist_ok=True)
        self.profile_dir.check_dirs()

    def init_config_files(self):
        if not self._prepared():
            super().init_config_files()

    def load_config_file(self, *args, **kwargs):
        if not self._prepared():
            super().load_config_file(*args, **kwargs)

    def init_code(self):
        import IPython

        if self._prepared() and self.zygote_modules is not None and IPython.version_info[0] == 8:
            self._init_code_in_fork()
        else:
            super().init_code()
        # The names the server's warm-up (`import numpy` ...) binds in a
        # booted kernel, bound here in a forked one, which may start without
        # it (docs/zygote.md); after init_code, so %who lists them as well.
        for module in self.preloaded:
            top = module.split(".")[0]
            if top in sys.modules:
                self.shell.user_ns[top] = sys.modules[top]

    def _init_code_in_fork(self):
        # IPython 8's InteractiveShellApp.init_code, step by step, but for
        # the set of sys.modules it keeps at the end (_ModulesAtStart).
        self._run_startup_files()
        self._run_exec_lines()
        self._run_exec_files()
        if self.hide_initial_ns:
            self.shell.user_ns_hidden.update(self.shell.user_ns)
        self._run_cmd_line_code()
        self._run_module()
        sys.stdout.flush()
        sys.stderr.flush()
        self.shell._sys_modules_keys = self.zygote_modules.now()

    def parse_command_line(self, argv=None):
        if argv is not None and self.prepared_argv == list(argv):
            return
        super().parse_command_line(argv)


if __name__ == "__main__":
    _writable_connection_file(sys.argv)
    SandboxKernelApp.launch_instance(kernel_class=SandboxKernel)
