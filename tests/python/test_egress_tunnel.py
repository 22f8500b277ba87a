"""The task side of a Swarm session's egress tunnel
(kernel-shim/cellblock_egress_tunnel.py), against real sockets: the tunnel
on a thread of this process, a fake front (a CurveZMQ DEALER on 127.0.0.1)
speaking cellblock_protocol's words, and clients on the tunnel's unix
socket as the shim's egress forwarder connects them. Every wait has a
deadline, so a failure is an assertion, never a hang."""
import hashlib
import hmac
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time

import pytest
import zmq

sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", "../.."), "kernel-shim"))
import cellblock_egress_tunnel  # noqa: E402
import cellblock_protocol as protocol  # noqa: E402

from cellblock_egress_tunnel import ACK, CLOSE, DATA, EOF, HELLO, OPEN  # noqa: E402

CHUNK = protocol.TUNNEL_CHUNK
WINDOW = protocol.TUNNEL_WINDOW

DEADLINE_S = 10
# How long the tunnel must stay silent for "it sends nothing more" to hold.
QUIET_S = 1.0
MIB = 1 << 20

# One context for the whole file, never collected: pyzmq 24 can block for
# good destroying a garbage context (see server_helpers.py).
CONTEXT = zmq.Context()
# One whose pipes hold two messages and whose TCP buffers are small, so that
# a front that stops reading fills the tunnel's pipe to it at once.
SMALL_PIPES = zmq.Context()
for _option, _value in ((zmq.SNDHWM, 2), (zmq.RCVHWM, 2), (zmq.SNDBUF, 4096),
                        (zmq.RCVBUF, 4096)):
    SMALL_PIPES.setsockopt(_option, _value)


def _number(value):
    return str(value).encode()


class FakeFront:
    """The front's side: a DEALER, a CURVE client of the kernel's key."""

    def __init__(self, endpoint, server_public, signing_key, context=CONTEXT):
        self.signing_key = signing_key
        self.sock = context.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.curve_serverkey = server_public
        self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(endpoint)

    def close(self):
        self.sock.close()

    def send(self, *frames):
        self.sock.send_multipart(list(frames))

    def recv(self, wait_s=DEADLINE_S):
        assert self.sock.poll(wait_s * 1000), f"the tunnel sent nothing in {wait_s} s"
        return self.sock.recv_multipart()

    def silent_for(self, seconds=QUIET_S):
        return not self.sock.poll(seconds * 1000)

    def signature(self, trust_store):
        return hmac.new(self.signing_key, trust_store, hashlib.sha256).hexdigest().encode()

    def hello(self, trust_store=b"a trust store"):
        self.send(HELLO, b"", trust_store, self.signature(trust_store))
        assert self.recv() == [HELLO, b""]

    def expect(self, verb, conn_id):
        frames = self.recv()
        assert frames[:2] == [verb, conn_id], frames[:3]
        return frames[2:]

    def expect_open(self):
        frames = self.recv()
        assert frames[0] == OPEN and len(frames) == 2, frames
        return frames[1]

    def data_until_quiet(self, conn_id, offset):
        """Takes data (no acks) until the tunnel has been silent QUIET_S;
        the offset after the last."""
        deadline = time.monotonic() + DEADLINE_S
        while not self.silent_for():
            verb, got_id, at, data = self.recv()
            assert (verb, got_id, int(at)) == (DATA, conn_id, offset)
            assert 0 < len(data) <= CHUNK
            offset += len(data)
            assert time.monotonic() < deadline, "the tunnel never stopped sending"
        return offset


class Rig:
    """A started tunnel with temp paths, and the fronts and clients a test
    makes (closed at its end)."""

    def __init__(self, context=CONTEXT):
        # Not pytest's tmp_path: a unix socket's path holds 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="cb-tunnel-")
        self.socket_path = os.path.join(self.dir, "egress.sock")
        self.ca_bundle_path = os.path.join(self.dir, "ca-certificates.crt")
        self.context = context
        self.public, secret = zmq.curve_keypair()
        self.signing_key = os.urandom(32).hex().encode()  # the connection file's "key"
        self.tunnel = cellblock_egress_tunnel.EgressTunnel(
            context, "tcp://127.0.0.1:*", secret.decode(), self.signing_key,
            socket_path=self.socket_path,
            ca_bundle_path=self.ca_bundle_path)
        self.tunnel.start()
        self.fronts = []
        self.clients = []

    def front(self):
        front = FakeFront(self.tunnel.endpoint, self.public, self.signing_key, self.context)
        self.fronts.append(front)
        return front

    def client(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(DEADLINE_S)
        sock.connect(self.socket_path)
        self.clients.append(sock)
        return sock

    def close(self):
        self.tunnel.stop()
        for front in self.fronts:
            front.close()
        for sock in self.clients:
            sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def rig():
    made = Rig()
    yield made
    made.close()


def _send_in_background(sock, data, then_shut=False):
    def send():
        try:
            sock.sendall(data)
            if then_shut:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the test closed it

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def _read_to_eof_in_background(sock):
    """A thread reading `sock` to its EOF; its `received` once joined."""
    def read():
        while True:
            chunk = sock.recv(CHUNK)
            if not chunk:
                break
            reader.received += chunk
        reader.eof = True

    reader = threading.Thread(target=read, daemon=True)
    reader.received = bytearray()
    reader.eof = False
    reader.start()
    return reader


def _closed(sock):
    """True once the tunnel has closed the other end of `sock`."""
    try:
        while sock.recv(CHUNK):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def test_hello_writes_the_trust_store_and_opens_the_socket(rig):
    # Before any hello nothing listens: the forwarder says "no network".
    front = rig.front()
    assert front.silent_for(0.2)
    assert not os.path.exists(rig.socket_path)
    with pytest.raises(OSError):
        rig.client()
    trust_store = bytes(range(256)) * 1024  # exact bytes, not text
    front.hello(trust_store)
    with open(rig.ca_bundle_path, "rb") as f:
        assert f.read() == trust_store
    assert stat.S_IMODE(os.stat(rig.ca_bundle_path).st_mode) == 0o644
    mode = os.stat(rig.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666
    # Another hello replaces the bundle whole; nothing else is left beside it.
    front.hello(b"another")
    with open(rig.ca_bundle_path, "rb") as f:
        assert f.read() == b"another"
    assert sorted(os.listdir(rig.dir)) == ["ca-certificates.crt", "egress.sock"]
    # stop() removes the socket file.
    rig.tunnel.stop()
    assert not os.path.exists(rig.socket_path)


def test_a_hello_not_signed_with_the_sessions_key_is_refused(rig):
    # A client that knows the kernel's public key gets a CURVE handshake;
    # without the session's message key it cannot become the front.
    intruder = rig.front()
    intruder.signing_key = b"not the session's key"
    intruder.send(HELLO, b"", b"my trust store", intruder.signature(b"my trust store"))
    intruder.send(HELLO, b"", b"my trust store", b"")
    assert intruder.silent_for(0.5)
    assert not os.path.exists(rig.socket_path) and not os.path.exists(rig.ca_bundle_path)
    assert rig.tunnel.counts["refused"] == 2
    # The front that has the key is answered, and the intruder's messages
    # are still nobody's.
    front = rig.front()
    front.hello()
    rig.client()
    conn = front.expect_open()
    intruder.send(DATA, conn, b"0", b"injected")
    assert front.silent_for(0.3) and intruder.silent_for(0.1)
    assert rig.tunnel.counts["ignored"] >= 1


def test_the_tunnel_refuses_to_start_without_a_message_key():
    with pytest.raises(ValueError):
        cellblock_egress_tunnel.EgressTunnel(CONTEXT, "tcp://127.0.0.1:*",
                                             zmq.curve_keypair()[1].decode(), b"")


def test_a_stale_socket_file_is_replaced_at_the_first_hello(rig):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(rig.socket_path)
    stale.close()  # the file stays, with nothing listening
    front = rig.front()
    front.hello()
    rig.client()
    assert front.expect_open() == b"1"


def test_a_mebibyte_from_the_client_arrives_whole_in_order_then_eof(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    assert conn == b"1"
    payload = os.urandom(MIB)
    _send_in_background(client, payload, then_shut=True)
    received = bytearray()
    while True:
        frames = front.recv()
        assert frames[1] == conn, frames[:3]
        if frames[0] == EOF:
            assert len(frames) == 2
            break
        verb, _, offset, data = frames
        assert verb == DATA and int(offset) == len(received) and 0 < len(data) <= CHUNK
        received += data
        front.send(ACK, conn, _number(len(received)))
    assert hashlib.sha256(received).hexdigest() == hashlib.sha256(payload).hexdigest()
    assert front.silent_for(0.2)  # eof once


def test_a_mebibyte_from_the_front_reaches_the_client_within_the_window(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    reader = _read_to_eof_in_background(client)
    payload = os.urandom(MIB)
    sent = acked = 0
    deadline = time.monotonic() + DEADLINE_S
    while acked < len(payload):
        assert time.monotonic() < deadline, f"{acked} of {len(payload)} bytes acked"
        if sent < len(payload) and sent + CHUNK - acked <= WINDOW:
            chunk = payload[sent:sent + CHUNK]
            front.send(DATA, conn, _number(sent), chunk)
            sent += len(chunk)
            continue
        (total,) = front.expect(ACK, conn)
        assert acked < int(total) <= sent
        acked = int(total)
    front.send(EOF, conn)
    reader.join(DEADLINE_S)
    assert reader.eof, f"the client read {len(reader.received)} bytes and no EOF"
    assert hashlib.sha256(reader.received).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_without_acks_exactly_one_window_is_sent_and_an_ack_releases_more(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    _send_in_background(client, bytes(4 * WINDOW))
    assert front.data_until_quiet(conn, 0) == WINDOW
    front.send(ACK, conn, _number(CHUNK))
    assert front.data_until_quiet(conn, WINDOW) == WINDOW + CHUNK
    client.shutdown(socket.SHUT_RDWR)  # ends the sender


def test_eof_each_way_then_the_task_closes_the_connection(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    client.sendall(b"ping")
    client.shutdown(socket.SHUT_WR)
    assert front.expect(DATA, conn) == [b"0", b"ping"]
    assert front.expect(EOF, conn) == []
    front.send(DATA, conn, b"0", b"pong")
    front.send(EOF, conn)
    assert client.recv(16) == b"pong"
    assert client.recv(16) == b""  # the front's eof
    assert front.expect(ACK, conn) == [b"4"]
    # Not closed while the front has not acknowledged "ping": it may still
    # be on its way to the gateway.
    assert front.silent_for(0.3)
    front.send(ACK, conn, b"4")
    assert front.expect(CLOSE, conn) == []
    # Forgotten: what comes for it now is answered with close.
    front.send(ACK, conn, b"4")
    assert front.expect(CLOSE, conn) == []


def test_a_close_from_the_front_closes_the_client_without_a_reply(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    front.send(CLOSE, conn)
    assert _closed(client)
    assert front.silent_for(0.2)
    front.send(CLOSE, b"12345")  # an unknown id: ignored
    assert front.silent_for(0.2)


def test_protocol_errors_close_only_their_connection(rig):
    front = rig.front()
    front.hello()
    clients, ids = {}, {}
    for name in ("wrong offset", "oversized", "ack beyond sent", "after eof", "bystander"):
        clients[name] = rig.client()
        ids[name] = front.expect_open()

    def conn(name):
        return ids[name]

    front.send(DATA, conn("wrong offset"), b"1", b"x")
    front.send(DATA, conn("oversized"), b"0", bytes(CHUNK + 1))
    front.send(ACK, conn("ack beyond sent"), b"1")
    front.send(EOF, conn("after eof"))
    front.send(DATA, conn("after eof"), b"0", b"x")
    closed = set()
    for _ in range(4):
        verb, conn_id = front.recv()
        assert verb == CLOSE, verb
        closed.add(conn_id)
    assert closed == {conn(name) for name in clients if name != "bystander"}
    for name, sock in clients.items():
        if name != "bystander":
            assert _closed(sock), name
    # The bystander works both ways.
    bystander = clients["bystander"]
    bystander.sendall(b"still here")
    assert front.expect(DATA, conn("bystander")) == [b"0", b"still here"]
    front.send(DATA, conn("bystander"), b"0", b"so am I")
    assert bystander.recv(16) == b"so am I"
    assert front.expect(ACK, conn("bystander")) == [b"7"]
    assert rig.tunnel.counts["protocol errors"] == 4


def test_an_unknown_id_is_answered_with_close(rig):
    front = rig.front()
    front.hello()
    front.send(DATA, b"77", b"0", b"x")
    assert front.expect(CLOSE, b"77") == []
    front.send(ACK, b"78", b"0")
    assert front.expect(CLOSE, b"78") == []
    front.send(EOF, b"79")
    assert front.expect(CLOSE, b"79") == []


def test_a_second_fronts_hello_drops_the_first_fronts_connections(rig):
    first = rig.front()
    first.hello()
    old_client = rig.client()
    old_conn = first.expect_open()
    second = rig.front()
    second.hello()
    assert _closed(old_client)
    # Nothing more goes to the first front; what it sends is ignored.
    first.send(DATA, old_conn, b"0", b"x")
    assert first.silent_for(QUIET_S)
    assert rig.tunnel.counts["ignored"] >= 1
    # The new front gets the new clients, under new ids.
    new_client = rig.client()
    new_conn = second.expect_open()
    assert new_conn == b"2"
    new_client.sendall(b"hi")
    assert second.expect(DATA, new_conn) == [b"0", b"hi"]
    assert second.silent_for(0.2) and first.silent_for(0.2)


def test_a_front_that_stops_reading_loses_nothing():
    """The tunnel's pipe to a slow front fills: what cannot be sent waits,
    in order, and the clients are not read meanwhile."""
    rig = Rig(SMALL_PIPES)
    try:
        front = rig.front()
        front.hello()
        clients = {}
        for _ in range(8):
            client = rig.client()
            clients[front.expect_open()] = client
        payloads = {conn: os.urandom(MIB // 2) for conn in clients}
        received = {conn: bytearray() for conn in clients}
        ended = set()
        for conn, client in clients.items():
            _send_in_background(client, payloads[conn], then_shut=True)
        time.sleep(QUIET_S)  # reading nothing
        assert rig.tunnel.counts["front full"] > 0
        while len(ended) < len(payloads):
            frames = front.recv()
            verb, conn = frames[:2]
            assert conn in payloads and conn not in ended, frames[:3]
            if verb == EOF:
                ended.add(conn)
                continue
            assert verb == DATA and int(frames[2]) == len(received[conn]), frames[:3]
            received[conn] += frames[3]
            front.send(ACK, conn, _number(len(received[conn])))
        for conn, payload in payloads.items():
            assert hashlib.sha256(received[conn]).digest() == hashlib.sha256(payload).digest()
    finally:
        rig.close()


def test_a_front_that_disconnects_takes_its_connections_with_it(rig):
    front = rig.front()
    front.hello()
    client = rig.client()
    front.expect_open()
    front.close()
    # The tunnel finds the front gone when it next sends to it.
    client.settimeout(0.05)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "the client was never closed"
        try:
            client.sendall(b"x")
        except OSError:
            break
        if _closed(client):
            break
    assert rig.tunnel.counts["fronts gone"] == 1
    # A front that says hello afterwards is served.
    again = rig.front()
    again.hello()
    rig.client()
    assert again.expect_open() == b"2"


def test_malformed_messages_are_ignored_and_the_tunnel_goes_on(rig):
    front = rig.front()
    # Garbage before any hello, from a peer that is not (yet) the front.
    front.send(b"nonsense")
    front.send(DATA, b"1", b"0", b"x")
    front.hello()
    client = rig.client()
    conn = front.expect_open()
    garbage = [
        [b"nonsense", conn],
        [DATA],
        [DATA, conn, b"0"],
        [DATA, conn, b"-1", b"x"],
        [DATA, conn, b"0x10", b"x"],
        [DATA, b"one", b"0", b"x"],
        [ACK, conn, b"1" * 100],
        [ACK, b"", b"0"],
        [EOF, conn, b"extra"],
        [CLOSE],
        [HELLO, b"1", b""],
        [HELLO, b""],
        [b""],
    ]
    for frames in garbage:
        front.send(*frames)
    client.sendall(b"after the garbage")
    assert front.expect(DATA, conn) == [b"0", b"after the garbage"]
    front.send(DATA, conn, b"0", b"still fine")
    assert client.recv(64) == b"still fine"
    assert front.expect(ACK, conn) == [b"10"]
    assert rig.tunnel.counts["malformed"] >= len(garbage) + 1
    assert rig.tunnel.counts["failures"] == 0


def test_past_the_most_connections_a_client_is_closed_at_once():
    rig = Rig()
    try:
        front = rig.front()
        front.hello()
        clients = []
        for n in range(1, protocol.TUNNEL_MAX_CONNECTIONS + 1):
            clients.append(rig.client())
            assert front.expect_open() == _number(n)
        extra = rig.client()
        assert _closed(extra)
        assert front.silent_for(0.5)
        assert rig.tunnel.counts["refused"] == 1
        # A connection that ends makes room for the next client.
        front.send(CLOSE, b"1")
        assert _closed(clients[0])
        rig.client()
        assert front.expect_open() == _number(protocol.TUNNEL_MAX_CONNECTIONS + 1)
    finally:
        rig.close()


def test_the_connection_file_names_the_tunnels_port():
    assert cellblock_egress_tunnel.start_from_connection_file({}, "unused") is None
    for bad in (0, 70000, "http", True, 55.5):
        with pytest.raises(ValueError):
            cellblock_egress_tunnel.start_from_connection_file(
                {protocol.EGRESS_TUNNEL_FIELD: bad}, "unused")
