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

A flush with nothing to send returns at once (SandboxOutStream.flush):
ipykernel 6.17 handed every flush to its IOPub thread and waited there, two
hand-overs and a wake-up at the end of every execution for nothing.

Packages: pip installs into PIP_TARGET (the session's home, on PYTHONPATH);
the directory is made before ipykernel is imported and import caches are
dropped after every cell, so `%pip install x` then `import x` works.

Replies outlive the relay (cellblock_unrelayed.py). The kernel's shell and
control sockets are set to report a reply they cannot route
(ZMQ_ROUTER_MANDATORY): a reply sent while no server relays (a crashed
server, before the next one adopts the sandbox, docs/restarts.md) is kept,
in order and bounded, and sent when the relay connects again under the same
routing identity. What passes the bound is dropped, oldest first, and
logged; the server answers those requests ServerRestarting. The last replies
sent are kept too: one can be sent and still be lost, in the dead server's
socket buffer. An adopting server's first shell request (a
kernel_info_request with content {"cellblock": {"resend_replies": true}})
has them sent again, before its own reply; the server passes those it still
owes and drops the rest.

Files move over control where the server has no directory of the session's
(a Swarm task): four cellblock_file_* requests, answered by FileTransfers (cellblock_files.py),
which never follows a link the sandbox's code may have planted. A
cellblock_exit_request on control ends the kernel at once (the server closes
a session whose sandbox it cannot kill itself at once: a Swarm task).

Over 500 lines with a reason: it is the one place where ipykernel's classes
(IPKernelApp, IPythonKernel, OutStream, Heartbeat) are subclassed, and each
subclass changes what ipykernel does in the others' middle (the app makes the
streams that share the kernel's output budget, the kernel reports what they
dropped); what stands alone is apart: files (cellblock_files.py), kept
replies (cellblock_unrelayed.py), snapshots (cellblock_snapshot.py).
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
import threading  # noqa: E402

import zmq  # noqa: E402

from ipykernel.heartbeat import Heartbeat  # noqa: E402
from ipykernel.iostream import OutStream  # noqa: E402
from ipykernel.ipkernel import IPythonKernel  # noqa: E402
from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from traitlets import DottedObjectName  # noqa: E402

import cellblock_egress_tunnel  # noqa: E402
import cellblock_protocol  # noqa: E402
from cellblock_dedup import BootMemory  # noqa: E402
from cellblock_files import FileTransfers  # noqa: E402
from cellblock_unrelayed import UNHEARD, count_unheard, keep_replies  # noqa: E402


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

    # ipykernel 6.17 hands every flush to the IOPub thread and waits for it
    # there, with nothing to send as well: the end of every execution
    # flushes stdout and stderr, each a hand-over and a wake-up of the
    # thread, and on a host whose CPUs are busy each wake-up waits its turn.
    # A flush with nothing buffered and no flush pending or under way returns
    # at once: a `1+1` round trip 6.4-6.9 ms -> 4.3 ms, the kernel's CPU per
    # execution 4.8 -> 3.4 ms (measured here). The IOPub thread's queue keeps
    # its order: what was written before is already queued there, ahead of
    # the status that follows. Only the shell reply may now leave before the
    # IOPub messages still queued, which the protocol allows across channels,
    # and the relay holds an execute_reply until its idle status anyway
    # (session_core.cpp, held_reply_), so the reply's output figures are
    # whole.
    _flushing = 0  # _flush calls under way (on the IOPub thread, its only writer)

    def _flush(self):
        self._flushing += 1
        try:
            super()._flush()
        finally:
            self._flushing -= 1

    def flush(self):
        waits = (self.echo is not None or self._flush_pending or self._subprocess_flush_pending
                 or self._flushing)
        if not waits:
            with self._buffer_lock:
                waits = self._buffer.tell() > 0
        if waits:
            super().flush()

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
# A Swarm kernel booted with a fixed layout (serve --swarm-share-boot-memory):
# its boot pages, marked for the node's KSM. Off anywhere else.
BOOT_MEMORY = BootMemory()


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
        keep_replies(self)
        count_unheard(self)

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

    async def do_execute(self, code, silent, store_history=True, *args, **kwargs):
        BOOT_MEMORY.before_execute(store_history)
        try:
            return await super().do_execute(code, silent, store_history, *args, **kwargs)
        finally:
            BOOT_MEMORY.mark()  # the warm-up's imports, before any session code

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

    def start(self):
        BOOT_MEMORY.mark()
        super().start()

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


def _without_iopub_pipe():
    """ipykernel's IOPub thread without its pipe: a loopback TCP socket that
    forked children's output goes through, which `runsc checkpoint` refuses
    to save. Set by a shim that bridges the kernel's channels (the exact
    level on runsc, docs/hibernation.md); output of a forked child (not of a
    subprocess: its descriptors are forwarded) is then not relayed."""
    from ipykernel import iostream

    init = iostream.IOPubThread.__init__

    def init_without_pipe(self, socket, pipe=False):
        init(self, socket, pipe=False)

    iostream.IOPubThread.__init__ = init_without_pipe


if __name__ == "__main__":
    _writable_connection_file(sys.argv)
    if os.environ.get(cellblock_protocol.NO_IOPUB_PIPE_ENV) == "1":
        _without_iopub_pipe()
    SandboxKernelApp.launch_instance(kernel_class=SandboxKernel)
