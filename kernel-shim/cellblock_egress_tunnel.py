"""The task side of a Swarm session's egress tunnel (docs/scale-out.md,
"Egress"; the words are cellblock_protocol's TUNNEL_* and EGRESS_*).

A Swarm task has no route out. Its egress forwarder (the shim's, on the
sandbox's 127.0.0.1:3128) takes each of the code's proxy connections to the
unix socket EGRESS_SOCKET; this module listens there, inside the kernel
process, and carries every such connection, multiplexed, over one CurveZMQ
ROUTER of the kernel's key to the front (a DEALER), which bridges each one
to the session's egress gateway. The front says hello first, with the trust
store the code's TLS needs (written to CA_BUNDLE); nothing listens on the
socket before that, so the forwarder answers "no network access".

Everything runs on one daemon thread, in one poll loop, without ever
blocking; each connection holds at most TUNNEL_WINDOW bytes unacknowledged
each way, so one download can neither fill the kernel's memory nor starve
the kernel's own channels. The code in the sandbox has the kernel's uid and
may speak to the socket or end this thread: that harms only its own egress
(the front enforces everything), so nothing here is trusted beyond CURVE,
and every buffer and count is bounded.

One concern, one file (about 600 lines): the tunnel's loop, its protocol
checks and its connections are read together.
"""
import collections
import errno
import hashlib
import hmac
import os
import socket
import sys
import tempfile
import threading
import time

import zmq

import cellblock_protocol as protocol

HELLO = protocol.TUNNEL_HELLO.encode()
OPEN = protocol.TUNNEL_OPEN.encode()
DATA = protocol.TUNNEL_DATA.encode()
ACK = protocol.TUNNEL_ACK.encode()
EOF = protocol.TUNNEL_EOF.encode()
CLOSE = protocol.TUNNEL_CLOSE.encode()

# The frames after the verb that each verb from the front carries:
# [verb, connection id, ...]. A side closes a connection once it has sent
# eof and had everything it sent acknowledged, and has written the other's
# eof: a close makes the other side drop what it has not written.
FRAMES = {HELLO: 4, DATA: 4, ACK: 3, EOF: 2, CLOSE: 2}

LISTEN_BACKLOG = 64
# The largest frame a peer may send (the trust store is the largest the front
# sends, a few hundred KiB); a peer that sends more is disconnected by libzmq.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# Offsets and totals are decimal; 20 digits hold any 64-bit count.
MAX_DIGITS = 20
# Messages taken from the ROUTER in one poll turn, so that clients are served
# between floods.
MESSAGES_PER_TURN = 256
# Messages waiting for the front's pipe to have room. What the tunnel itself
# queues stays far below this (clients are not read while anything waits);
# only a front that floods requests while it reads nothing reaches it.
MAX_QUEUED_MESSAGES = 4096
# How soon a full pipe to the front, or a listener that failed to accept (no
# descriptor left), is tried again: the ROUTER's POLLOUT says only that *some*
# peer has room, so waiting for it could spin.
RETRY_SECONDS = 0.01
# A line in the kernel's log for the first of each kind of trouble and every
# REPORT_EVERY-th after it: a noisy peer must not flood the log.
REPORT_EVERY = 100


def _decimal(frame):
    """The number an ASCII decimal frame spells, or None."""
    if not frame or len(frame) > MAX_DIGITS or not frame.isdigit():
        return None
    return int(frame)


def _shown(frame):
    """A frame as a log line shows it: its start only (a peer's frame can
    be megabytes)."""
    if frame is None:
        return "none"
    return repr(frame[:40])


class TunnelConnection:
    """One client of the egress socket, carried under `id` (ASCII decimal).
    Counts are bytes: `sent` to the front and `acked` by it; `received` from
    the front and `delivered` to the client, with what is between them in
    `to_client`."""

    def __init__(self, conn_id, sock):
        self.id = conn_id
        self.sock = sock
        self.sent = 0
        self.acked = 0
        self.client_eof = False   # the client's EOF was read (and sent as eof)
        self.received = 0
        self.delivered = 0
        self.to_client = bytearray()
        self.front_eof = False    # the front's eof came
        self.shut = False         # ... and reached the client (SHUT_WR)
        self.ack_due = False      # delivered moved since the last ack

    def read_budget(self):
        """How much may be read from the client now (0: none)."""
        if self.client_eof:
            return 0
        return min(protocol.TUNNEL_CHUNK, protocol.TUNNEL_WINDOW - (self.sent - self.acked))

    def accepts_data(self, offset, size):
        return (not self.front_eof and offset == self.received
                and size <= protocol.TUNNEL_CHUNK
                and self.received + size - self.delivered <= protocol.TUNNEL_WINDOW)

    def accepts_ack(self, total):
        # Cumulative, so a repeated ack is harmless; past `sent` it is a lie.
        return self.acked <= total <= self.sent

    def done(self):
        # Both ways ended, and everything sent acknowledged: the front has
        # written it all to the gateway (a close makes the other side drop
        # what it has not written yet).
        return self.client_eof and self.shut and self.acked == self.sent


class EgressTunnel:
    """The tunnel's ROUTER, bound to `endpoint` (a CURVE server with
    `secret_key`, Z85), and the listener on `socket_path` that it opens at
    the first hello, which writes its trust store to `ca_bundle_path`.
    start() runs it on a daemon thread; stop() ends it and cleans up.

    `counts`, by kind, is what it did not carry: "malformed" messages,
    messages from a peer that is not the front ("ignored"), connections
    closed for the front's "protocol errors", clients "refused" (too many,
    or no front), messages "dropped" for a front that reads nothing,
    "fronts gone" and "failures" (exceptions, OS errors); and how often the
    front's pipe was full ("front full"), which is no trouble."""

    def __init__(self, context, endpoint, secret_key, signing_key,
                 socket_path=protocol.EGRESS_SOCKET, ca_bundle_path=protocol.CA_BUNDLE):
        self._context = context
        self._endpoint = endpoint
        self._secret_key = secret_key.encode() if isinstance(secret_key, str) else secret_key
        # The kernel's message key (the connection file's "key"): a hello
        # must be signed with it. CURVE without a handler that checks client
        # keys admits any client that knows the kernel's public key; the
        # signature is what says the front is the server (as the kernel's
        # channels' signatures do).
        self._signing_key = signing_key.encode() if isinstance(signing_key, str) else signing_key
        if not self._signing_key:
            raise ValueError("egress tunnel: no message key to check the front's hello with")
        self._socket_path = socket_path
        self._ca_bundle_path = ca_bundle_path
        self.endpoint = None       # as bound (a "*" port resolved)
        self.counts = collections.Counter()
        self._router = None
        self._listener = None
        self._accept_resumes = 0.0
        self._front = None         # the routing id of the last hello's sender
        self._connections = {}     # id -> TunnelConnection
        self._next_id = 0
        self._outgoing = collections.deque()  # frames waiting for the front's pipe
        self._wake = None          # (read, write) ends of the pipe stop() writes
        self._stopping = False
        self._thread = None
        self._handlers = {DATA: self._on_data, ACK: self._on_ack, EOF: self._on_eof,
                          CLOSE: self._on_close}

    # -- the thread -------------------------------------------------------

    def start(self):
        """Binds the ROUTER (here, so that a taken port fails the caller)
        and starts the thread."""
        if not zmq.has("curve"):
            raise RuntimeError("egress tunnel: this kernel's libzmq was built without CurveZMQ")
        router = self._context.socket(zmq.ROUTER)
        router.linger = 0
        # Without it a ROUTER drops, silently, what passes the pipe's high
        # water mark, and a connection's bytes would be lost: with it a full
        # pipe is zmq.Again, and the message waits in _outgoing.
        router.router_mandatory = 1
        router.maxmsgsize = MAX_FRAME_BYTES
        router.curve_secretkey = self._secret_key
        router.curve_publickey = zmq.curve_public(self._secret_key)
        router.curve_server = True
        try:
            router.bind(self._endpoint)
        except zmq.ZMQError as error:
            router.close()
            raise RuntimeError(f"egress tunnel: bind {self._endpoint}: {error}") from error
        self.endpoint = router.last_endpoint.decode()
        self._router = router
        self._wake = os.pipe()
        os.set_blocking(self._wake[0], False)
        os.set_blocking(self._wake[1], False)
        self._thread = threading.Thread(target=self._run, name="cellblock-egress-tunnel",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout=10):
        """Ends the thread; it closes every socket and removes the socket
        file as it ends."""
        if self._thread is None:
            return
        self._stopping = True
        try:
            os.write(self._wake[1], b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake[1])
        self._thread = None

    def _run(self):
        try:
            while not self._stopping:
                try:
                    self._turn()
                except zmq.ContextTerminated:
                    return
                except Exception as error:  # a bug here must not end the session's egress
                    self._note("failures", f"the poll loop: {error!r}")
                    time.sleep(RETRY_SECONDS)  # never a hot loop of one failure
        finally:
            self._close_everything()

    def _turn(self):
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake[0], zmq.POLLIN)
        if self._accept_resumes and time.monotonic() >= self._accept_resumes:
            self._accept_resumes = 0.0
        listening = self._listener is not None and not self._outgoing and not self._accept_resumes
        if listening:
            poller.register(self._listener.fileno(), zmq.POLLIN)
        # By descriptor: what pyzmq's poll gives back for anything not zmq's.
        polled = {}
        for conn in self._connections.values():
            events = self._events_wanted(conn)
            if events:
                polled[conn.sock.fileno()] = conn
                poller.register(conn.sock.fileno(), events)
        ready = dict(poller.poll(self._poll_timeout_ms()))
        if self._wake[0] in ready:
            self._drain_wake_pipe()
            if self._stopping:
                return
        self._flush()
        if self._router in ready:
            self._receive_from_router()
        for fd, conn in polled.items():
            # Unless a message from the front closed it meanwhile.
            if fd in ready and self._connections.get(conn.id) is conn:
                self._serve_client(conn, ready[fd])
        if listening and self._listener.fileno() in ready:
            self._accept_clients()
        self._send_due_acks()
        self._flush()
        if self._front is None and self._connections:
            self._note("fronts gone", "the front disconnected; its connections are closed")
            self._drop_every_connection()

    def _events_wanted(self, conn):
        # Only what can make progress is polled for, so the loop never spins:
        # a client is read while its window has room and nothing waits for
        # the front's pipe, written while bytes wait for it.
        events = 0
        if conn.read_budget() > 0 and not self._outgoing:
            events |= zmq.POLLIN
        if conn.to_client:
            events |= zmq.POLLOUT
        return events

    def _poll_timeout_ms(self):
        waits = []
        if self._outgoing:
            waits.append(RETRY_SECONDS)
        if self._accept_resumes:
            waits.append(max(0.0, self._accept_resumes - time.monotonic()))
        return int(min(waits) * 1000) + 1 if waits else None

    def _drain_wake_pipe(self):
        try:
            while os.read(self._wake[0], 64):
                pass
        except BlockingIOError:
            pass

    def _close_everything(self):
        for conn in self._connections.values():
            conn.sock.close()
        self._connections.clear()
        self._outgoing.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self._socket_path)
            except OSError:
                pass
        self._router.close(linger=0)
        os.close(self._wake[0])

    def _note(self, kind, detail):
        """Counts one of `kind`; says so for the first and every
        REPORT_EVERY-th."""
        self.counts[kind] += 1
        n = self.counts[kind]
        if n == 1 or n % REPORT_EVERY == 0:
            try:
                print(f"cellblock: egress tunnel: {kind} ({n} so far): {detail}",
                      file=sys.__stderr__, flush=True)
            except (AttributeError, OSError, ValueError):
                pass  # no stderr left: the count is still kept

    # -- to the front -----------------------------------------------------

    def _send(self, frames):
        """Sends to the front now, or as soon as its pipe has room, in
        order; with no front, nothing is sent."""
        if self._front is None:
            return
        if len(self._outgoing) >= MAX_QUEUED_MESSAGES:
            self._note("dropped", f"a {frames[0].decode()} to a front that reads nothing")
            return
        self._outgoing.append(frames)
        self._flush()

    def _flush(self):
        while self._outgoing and self._front is not None:
            try:
                self._router.send_multipart([self._front] + self._outgoing[0], zmq.NOBLOCK)
            except zmq.Again:
                self.counts["front full"] += 1  # not trouble: the front is slow
                return
            except zmq.ZMQError as error:
                if error.errno != errno.EHOSTUNREACH:
                    raise
                # The front's connection is gone, and with it whatever was on
                # the way: no connection can go on without a gap (the turn
                # closes them at its end; a front that comes back says hello
                # again).
                self._front = None
                self._outgoing.clear()
                return
            self._outgoing.popleft()

    def _send_due_acks(self):
        # One ack per connection and turn, of everything delivered so far;
        # they wait (coalescing further) while the front's pipe is full.
        for conn in self._connections.values():
            if self._outgoing:
                return
            if conn.ack_due:
                conn.ack_due = False
                self._send([ACK, conn.id, str(conn.delivered).encode()])

    # -- from the front ---------------------------------------------------

    def _receive_from_router(self):
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(frames[0], frames[1:])
            except Exception as error:  # one message must not end the tunnel
                self._note("failures", f"handling a message: {error!r}")

    def _handle(self, peer, message):
        verb = message[0] if message else None
        if verb not in FRAMES or len(message) != FRAMES[verb]:
            self._note("malformed", f"{len(message)} frames, verb {_shown(verb)}")
            return
        conn_id = message[1]
        if verb == HELLO:
            if conn_id:
                self._note("malformed", "a hello with a connection id")
                return
            if not self._signed(message[2], message[3]):
                self._note("refused", "a hello not signed with the session's key")
                return
            self._on_hello(peer, message[2])
            return
        if peer != self._front:
            self._note("ignored", "a message from a peer that is not the front")
            return
        if _decimal(conn_id) is None:
            self._note("malformed", f"connection id {_shown(conn_id)}")
            return
        fields = message[2:]
        if verb in (DATA, ACK):  # an offset, a total
            number = _decimal(fields[0])
            if number is None:
                self._note("malformed", f"{verb.decode()} number {_shown(fields[0])}")
                return
            fields = [number] + fields[1:]
        self._handlers[verb](conn_id, *fields)

    def _signed(self, trust_store, signature):
        expected = hmac.new(self._signing_key, trust_store, hashlib.sha256).hexdigest().encode()
        return hmac.compare_digest(expected, signature)

    def _on_hello(self, peer, trust_store):
        if peer != self._front:
            # A new front (the old one restarted, or lost its connection):
            # the old one's connections cannot go on, and nothing more is
            # sent to it.
            self._drop_every_connection()
            self._outgoing.clear()
        self._front = peer
        try:
            self._write_trust_store(trust_store)
        except OSError as error:
            self._note("failures", f"writing the trust store to {self._ca_bundle_path}: {error}")
        if self._listener is None:
            try:
                self._listen()
            except OSError as error:
                self._note("failures", f"listening on {self._socket_path}: {error}")
        self._send([HELLO, b""])

    def _write_trust_store(self, data):
        # Written aside and renamed onto the bundle, so that the code never
        # reads half of one.
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(self._ca_bundle_path) or ".",
                                    prefix=".ca-bundle-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), 0o644)
            os.replace(temp, self._ca_bundle_path)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise

    def _listen(self):
        try:
            os.unlink(self._socket_path)  # a socket file left by an earlier kernel
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._socket_path)
            os.chmod(self._socket_path, 0o666)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener

    def _known(self, conn_id):
        """The connection, or None after telling the front it is closed (so
        that it forgets the id too)."""
        conn = self._connections.get(conn_id)
        if conn is None:
            self._send([CLOSE, conn_id])
        return conn

    def _on_data(self, conn_id, offset, data):
        conn = self._known(conn_id)
        if conn is None:
            return
        if not conn.accepts_data(offset, len(data)):
            self._protocol_error(conn, f"data of {len(data)} bytes at offset {offset}, "
                                       f"{conn.received} received, {conn.delivered} delivered")
            return
        conn.to_client += data
        conn.received += len(data)
        self._write_client(conn)

    def _on_ack(self, conn_id, total):
        conn = self._known(conn_id)
        if conn is None:
            return
        if not conn.accepts_ack(total):
            self._protocol_error(conn, f"ack of {total} bytes, {conn.acked} acked before, "
                                       f"{conn.sent} sent")
            return
        conn.acked = total
        self._finish_if_done(conn)

    def _on_eof(self, conn_id):
        conn = self._known(conn_id)
        if conn is None:
            return
        conn.front_eof = True
        self._shut_if_written(conn)

    def _on_close(self, conn_id):
        conn = self._connections.get(conn_id)
        if conn is not None:
            self._forget(conn)

    def _protocol_error(self, conn, detail):
        self._note("protocol errors", f"connection {conn.id.decode()}: {detail}")
        self._abort(conn)

    # -- the clients ------------------------------------------------------

    def _accept_clients(self):
        for _ in range(LISTEN_BACKLOG):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                # EMFILE and the like: the client stays in the backlog, and
                # the listener stays readable, so wait before the next try.
                self._note("failures", f"accepting on {self._socket_path}: {error}")
                self._accept_resumes = time.monotonic() + RETRY_SECONDS
                return
            if self._front is None or len(self._connections) >= protocol.TUNNEL_MAX_CONNECTIONS:
                self._note("refused", f"a client past {protocol.TUNNEL_MAX_CONNECTIONS} "
                                      "connections, or with no front")
                sock.close()
                continue
            sock.setblocking(False)
            self._next_id += 1
            conn = TunnelConnection(str(self._next_id).encode(), sock)
            self._connections[conn.id] = conn
            self._send([OPEN, conn.id])

    def _serve_client(self, conn, events):
        try:
            # An error or hang-up is found by the read or write it fails.
            if events & (zmq.POLLIN | zmq.POLLERR) and conn.read_budget() > 0:
                self._read_client(conn)
            if conn.id in self._connections and conn.to_client:
                self._write_client(conn)
        except Exception as error:  # one socket must not end the tunnel
            self._note("failures", f"connection {conn.id.decode()}: {error!r}")
            if conn.id in self._connections:
                self._abort(conn)

    def _read_client(self, conn):
        if self._outgoing:
            return  # the front is slow: its pipe drains first
        budget = conn.read_budget()
        try:
            data = conn.sock.recv(budget)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(conn)
            return
        if not data:
            conn.client_eof = True
            self._send([EOF, conn.id])
            self._finish_if_done(conn)
            return
        self._send([DATA, conn.id, str(conn.sent).encode(), data])
        conn.sent += len(data)

    def _write_client(self, conn):
        try:
            written = conn.sock.send(conn.to_client, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(conn)
            return
        del conn.to_client[:written]
        conn.delivered += written
        conn.ack_due = True
        self._shut_if_written(conn)

    def _shut_if_written(self, conn):
        if not conn.front_eof or conn.to_client or conn.shut:
            return
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._abort(conn)
            return
        conn.shut = True
        self._finish_if_done(conn)

    def _finish_if_done(self, conn):
        if conn.done():
            if conn.ack_due:  # the last bytes' ack comes before the close
                self._send([ACK, conn.id, str(conn.delivered).encode()])
            self._send([CLOSE, conn.id])
            self._forget(conn)

    def _abort(self, conn):
        """Ends a connection that cannot go on, and tells the front."""
        self._send([CLOSE, conn.id])
        self._forget(conn)

    def _forget(self, conn):
        conn.sock.close()
        del self._connections[conn.id]

    def _drop_every_connection(self):
        for conn in list(self._connections.values()):
            self._forget(conn)


def start_from_connection_file(info, secret_key):
    """The kernel's tunnel, started, when its connection file (`info`, as
    parsed) names a port in EGRESS_TUNNEL_FIELD; None when it names none. The
    ROUTER binds that port on every address (the front connects from
    another host) with the kernel's CurveZMQ `secret_key`."""
    port = info.get(protocol.EGRESS_TUNNEL_FIELD)
    if port is None:
        return None
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"egress tunnel: the connection file's {protocol.EGRESS_TUNNEL_FIELD} "
                         f"is not a TCP port: {port!r}")
    # A context of its own: its I/O thread is not the kernel channels'.
    tunnel = EgressTunnel(zmq.Context(), f"tcp://*:{port}", secret_key, info.get("key") or "")
    tunnel.start()
    return tunnel
