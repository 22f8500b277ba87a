"""What a kernel sends while no relay listens (docs/restarts.md): its server
dead, the next one not yet adopting the sandbox.

- Replies outlive the relay (KeptReplies): the kernel's shell and control
  sockets report a reply they cannot route (ZMQ_ROUTER_MANDATORY), and it is
  kept, in order and bounded, and sent when the relay connects again under
  the same routing identity; the replies sent last are kept too, for an
  adopting server's fence (resend_recent).
- Output published to no one is counted (Unheard), per execution, for the
  reply's metadata: ipykernel's PUB drops what no one subscribes to.

cellblock_ipykernel's SandboxKernel routes its Session.send through both
(keep_replies, count_unheard).
"""
import collections
import sys
import threading

import zmq


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


def keep_replies(kernel):
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


def count_unheard(kernel):
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
