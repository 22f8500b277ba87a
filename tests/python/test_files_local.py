"""The local file socket (docs/files.md): a client on the server's host passes
a file's descriptor with one signed request, and the server copies it inside
the kernel and hashes what landed.

Checked from outside: what the sandbox itself reads back, the session's
directories on the host, the socket's mode, the server's log, and raw
requests on the socket (unsigned, replayed, the wrong descriptors, paths
that leave /data) that must copy nothing.
"""
import array
import hashlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys

import pytest

from server_helpers import assert_session_gone, server, wait_for  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python"))

import cellblock  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(scope="module")
def cb(server):  # noqa: F811
    with cellblock.connect(state_dir=server.state_dir) as conn:
        yield conn


def sha(data):
    return hashlib.sha256(data).hexdigest()


def inside(s, code):
    r = s.run(code)
    assert r.ok, r.error
    return r.stdout.strip()


def sandbox_sha(s, path):
    return inside(s, "import hashlib\nh = hashlib.sha256()\n"
                     f"with open({path!r}, 'rb') as f:\n"
                     "    for b in iter(lambda: f.read(1 << 22), b''): h.update(b)\n"
                     "print(h.hexdigest())")


def input_listing(s):
    return inside(s, "import os\nprint(sorted(os.path.relpath(os.path.join(d, f), '/data/input')"
                     " for d, _, fs in os.walk('/data/input') for f in fs))")


def session_dir(server, sid):  # noqa: F811
    return os.path.join(server.state_dir, "sessions", sid)


def leftovers(server, sid):  # noqa: F811
    """Files in the session's partial directory on the host (none once a copy ended)."""
    partial = os.path.join(session_dir(server, sid), "partial")
    return os.listdir(partial) if os.path.exists(partial) else []


# ---------------------------------------------------------------- raw requests

def pack(frames):
    return struct.pack("<I", len(frames)) + b"".join(
        struct.pack("<I", len(f)) + bytes(f) for f in frames)


def unpack(data):
    (count,), at, frames = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<I", data, at)
        frames.append(data[at + 4:at + 4 + size])
        at += 4 + size
    assert at == len(data), "a malformed datagram from the server"
    return frames


def connect(server):  # noqa: F811
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(60)
    sock.connect(server.info["files_socket"])
    return sock


def send_raw(sock, datagram, fds=()):
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([datagram], ancillary)


def signed(server, msg_type, content):  # noqa: F811
    msg = server.session.msg(msg_type, content)
    return msg, server.session.serialize(msg)


def request(server, msg_type, content, fds):  # noqa: F811
    """One signed request with `fds`; returns the socket and the request's msg_id."""
    sock = connect(server)
    msg, frames = signed(server, msg_type, content)
    send_raw(sock, pack(frames), fds)
    return sock, msg["header"]["msg_id"]


def next_message(server, sock):  # noqa: F811
    """The next signed message from the server (its signature checked), or None at EOF."""
    data = sock.recv(1 << 16)
    if not data:
        return None
    _, frames = server.session.feed_identities(unpack(data))
    return server.session.deserialize(frames)


def reply_of(server, sock, msg_id):  # noqa: F811
    """The reply to msg_id, after any progress; the server then closes the connection."""
    while True:
        msg = next_message(server, sock)
        assert msg is not None, f"the server closed the socket without a reply:\n{server.log()[-2000:]}"
        assert msg["parent_header"]["msg_id"] == msg_id
        if msg["msg_type"] != "file_progress":
            assert next_message(server, sock) is None, "more after the reply"
            sock.close()
            return msg


def refused(server, msg_type, content, fds):  # noqa: F811
    sock, msg_id = request(server, msg_type, content, fds)
    reply = reply_of(server, sock, msg_id)
    assert reply["msg_type"] == msg_type.replace("_request", "_reply"), reply
    c = reply["content"]
    assert c["status"] == "error", c
    return c["ename"], c["evalue"]


def closed_without_reply(sock):
    assert sock.recv(1 << 16) == b"", "the server answered a request it should have dropped"
    sock.close()


# ---------------------------------------------------------------- the tests

def test_put_and_get_by_descriptor(server, cb, tmp_path):  # noqa: F811
    assert server.info["files_socket"] == os.path.join(server.state_dir, "files.sock")
    payload = os.urandom(40 * MiB + 777)
    local = tmp_path / "in.bin"
    local.write_bytes(payload)
    with cb.session() as s:
        seen = []
        assert s.put("deep/in.bin", local, progress=lambda d, t: seen.append((d, t)),
                     local=True, sha256=sha(payload)) == "/data/input/deep/in.bin"
        assert seen[0] == (0, len(payload)) and seen[-1] == (len(payload), len(payload)), seen
        assert sandbox_sha(s, "/data/input/deep/in.bin") == sha(payload)
        # Put again under the same name: the code sees the new file whole, and the
        # one it replaced is gone from the host too.
        other = os.urandom(3 * MiB)
        local.write_bytes(other)
        s.put("deep/in.bin", local, local=True)
        assert sandbox_sha(s, "/data/input/deep/in.bin") == sha(other)
        held = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(session_dir(server, s.id), "input"))
                for f in fs]
        assert [os.path.getsize(p) for p in held] == [len(other)], held
        assert leftovers(server, s.id) == []
        events = [e for e in s.history()["events"] if e["kind"] == "file_put"]
        assert len(events) == 2 and "local copy" in events[0]["detail"], events
        assert sha(payload)[:12] in events[0]["detail"], events

        # The code writes a file; it comes back by descriptor, byte for byte.
        inside(s, "data = open('/data/input/deep/in.bin', 'rb').read()\n"
                  "open('/data/output/out.bin', 'wb').write(data[::-1] * 7)")
        dest = tmp_path / "out.bin"
        got = []
        assert s.get("out.bin", dest, progress=lambda d, t: got.append(d), local=True) == dest
        assert dest.read_bytes() == other[::-1] * 7
        assert got[0] == 0 and got[-1] == 7 * len(other)
        assert not os.path.exists(f"{dest}.part")
        # An empty file both ways.
        (tmp_path / "empty").write_bytes(b"")
        s.put("empty", tmp_path / "empty", local=True, sha256=sha(b""))
        inside(s, "open('/data/output/empty', 'wb').close()")
        assert s.get("empty", tmp_path / "empty.back", local=True).read_bytes() == b""


def test_only_the_servers_user_may_connect(server):  # noqa: F811
    path = server.info["files_socket"]
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077 == 0, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    # Another uid (nobody) is refused by the kernel before a byte is read.
    probe = ("import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
             "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('EACCES')\n"
             "else:\n    print('connected')\n")

    def as_nobody():
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    out = subprocess.run(["/usr/bin/python3", "-c", probe, path], preexec_fn=as_nobody,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "EACCES", (out.stdout, out.stderr)


def test_unsigned_replayed_and_malformed_requests_copy_nothing(server, cb, tmp_path):  # noqa: F811
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"the first")
    second.write_bytes(b"the second, replayed")
    with cb.session() as s:
        log_before = len(server.log())
        content = {"session_id": s.id, "path": "r.txt"}
        # A forged signature: the connection is closed, nothing is copied.
        msg, frames = signed(server, "file_put_local_request", content)
        frames[1] = b"0" * len(frames[1])
        with open(second, "rb") as f:
            sock = connect(server)
            send_raw(sock, pack(frames), [f.fileno()])
            closed_without_reply(sock)
        assert input_listing(s) == "[]"
        # A request signed with another key.
        forged = cellblock.client.WireSession(key=b"not the key", signature_scheme="hmac-sha256")
        with open(second, "rb") as f:
            sock = connect(server)
            send_raw(sock, pack(forged.serialize(forged.msg("file_put_local_request", content))),
                     [f.fileno()])
            closed_without_reply(sock)
        # A good request lands; the same datagram again (a replay) is dropped.
        msg, frames = signed(server, "file_put_local_request", content)
        with open(first, "rb") as f:
            sock = connect(server)
            send_raw(sock, pack(frames), [f.fileno()])
            assert reply_of(server, sock, msg["header"]["msg_id"])["content"]["status"] == "ok"
        with open(second, "rb") as f:
            sock = connect(server)
            send_raw(sock, pack(frames), [f.fileno()])
            closed_without_reply(sock)
        assert inside(s, "print(open('/data/input/r.txt').read())") == "the first"
        # Not a packing, a truncated packing, over the size limit.
        for datagram in (b"garbage", pack(frames)[:-3], b"\0" * (70 << 10)):
            sock = connect(server)
            send_raw(sock, datagram)
            closed_without_reply(sock)
        # A connection that never sends a request is closed by the server (10 s).
        sock = connect(server)
        sock.settimeout(60)
        assert sock.recv(1) == b""
        sock.close()
        log = server.log()[log_before:]
        assert log.count("local file socket: rejected a request") >= 6, log
        assert "sent no request" in log, log
        assert input_listing(s) == "['r.txt']" and leftovers(server, s.id) == []
    # ...and the manager socket goes on answering.
    assert server.ok("server_info_request", {})["content"]["implementation"] == "cellblock"


def test_wrong_descriptors_and_paths_get_an_error_reply(server, cb, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    data.write_bytes(b"some bytes")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with cb.session() as s:
        put = {"session_id": s.id, "path": "x"}
        with open(data, "rb") as r, open(data, "r+b") as rw, open(data, "ab") as w:
            assert refused(server, "file_delete_local_request", put, [r.fileno()])[0] == \
                "UnknownRequest"
            ename, evalue = refused(server, "file_put_local_request", put, [])
            assert ename == "InvalidRequest" and "exactly one descriptor" in evalue, evalue
            ename, evalue = refused(server, "file_put_local_request", put, [r.fileno(), rw.fileno()])
            assert ename == "InvalidRequest" and "not 2" in evalue, evalue
            # Not a regular file: a FIFO (its reader would block the copy), a directory,
            # an O_PATH descriptor; not readable: O_WRONLY.
            fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            path_fd = os.open(data, os.O_PATH)
            try:
                for fd in (fifo_fd, dir_fd):
                    ename, evalue = refused(server, "file_put_local_request", put, [fd])
                    assert ename == "FileError" and "regular file" in evalue, evalue
                for fd in (path_fd, w.fileno()):
                    ename, evalue = refused(server, "file_put_local_request", put, [fd])
                    assert ename == "FileError" and "reading" in evalue, evalue
            finally:
                for fd in (fifo_fd, dir_fd, path_fd):
                    os.close(fd)
            # A get writes into the file: read-only is refused.
            inside(s, "open('/data/output/o.txt', 'w').write('out')")
            ename, evalue = refused(server, "file_get_local_request",
                                    {"session_id": s.id, "path": "o.txt"}, [r.fileno()])
            assert ename == "FileError" and "not open for writing" in evalue, evalue
            # Paths stay inside /data/input and /data/output.
            for path in ("../x", "/etc/passwd", "a/../../x", "/data/input/../../etc/x", ""):
                assert refused(server, "file_put_local_request",
                               {"session_id": s.id, "path": path}, [r.fileno()])[0] == \
                    "InvalidPath", path
                assert refused(server, "file_get_local_request",
                               {"session_id": s.id, "path": path}, [rw.fileno()])[0] == \
                    "InvalidPath", path
            # A link the code made is not followed out of the sandbox.
            inside(s, "import os\nos.symlink('/etc/shadow', '/data/output/link')")
            assert refused(server, "file_get_local_request",
                           {"session_id": s.id, "path": "link"}, [rw.fileno()])[0] == "FileError"
            assert refused(server, "file_put_local_request", {"session_id": "no-such", "path": "x"},
                           [r.fileno()])[0] == "NoSuchSession"
        assert data.read_bytes() == b"some bytes"   # no refused get wrote into it
        assert input_listing(s) == "[]" and leftovers(server, s.id) == []
        # The Python client: local=True without a socket to use is an error, and
        # by default it streams instead.
        real = cb.files_socket
        try:
            cb.files_socket = str(tmp_path / "no-such.sock")
            with pytest.raises(cellblock.FileError, match="local file socket"):
                s.put("y", data, local=True)
            assert s.put("y", data) == "/data/input/y"
        finally:
            cb.files_socket = real
        with pytest.raises(cellblock.FileError, match="os.PathLike"):
            s.put("z", b"bytes", local=True)


def test_the_disk_cap_holds_for_a_local_put(server, cb, tmp_path):  # noqa: F811
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 * MiB))
    with cb.session(limits={"disk_mb": 2}) as s:
        with pytest.raises(cellblock.FileTooLarge) as e:
            s.put("big", big, local=True)
        assert str(3 * MiB) in str(e.value) and "disk_mb 2" in str(e.value), e.value
        assert input_listing(s) == "[]" and leftovers(server, s.id) == []
        # A declared digest the file does not have: discarded after the copy.
        small = tmp_path / "small"
        small.write_bytes(b"abc")
        with pytest.raises(cellblock.ChecksumMismatch):
            s.put("small", small, local=True, sha256=sha(b"abd"))
        assert input_listing(s) == "[]" and leftovers(server, s.id) == []


def sparse(path, size):
    """A file of `size` zero bytes that takes no disk: a long copy that costs nothing to make."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_a_client_that_hangs_up_cancels_its_copy(server, cb, tmp_path):  # noqa: F811
    source = sparse(tmp_path / "zeros", 4 * GiB)
    with cb.session(limits={"disk_mb": 5000}) as s, open(source, "rb") as f:
        log_before = len(server.log())
        sock, msg_id = request(server, "file_put_local_request",
                               {"session_id": s.id, "path": "zeros"}, [f.fileno()])
        first = next_message(server, sock)
        assert first["msg_type"] == "file_progress" and first["content"]["size"] == 4 * GiB, first
        sock.close()
        assert wait_for(lambda: leftovers(server, s.id) == [], timeout=120), leftovers(server, s.id)
        log = server.log()[log_before:]
        assert "hung up; cancelled" in log, log[-3000:]
        assert input_listing(s) == "[]"
        # The session and the socket go on: the next copy lands.
        small = tmp_path / "small"
        small.write_bytes(b"after")
        s.put("small", small, local=True)
        assert inside(s, "print(open('/data/input/small').read())") == "after"


def test_closing_the_session_mid_copy_says_so(server, cb, tmp_path):  # noqa: F811
    source = sparse(tmp_path / "zeros", 4 * GiB)
    s = cb.session(limits={"disk_mb": 5000})
    with open(source, "rb") as f:
        sock, msg_id = request(server, "file_put_local_request",
                               {"session_id": s.id, "path": "zeros"}, [f.fileno()])
        assert next_message(server, sock)["msg_type"] == "file_progress"
        server.ok("session_close_request", {"session_id": s.id})
        reply = reply_of(server, sock, msg_id)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "SessionClosed", reply["content"]
    # The sandbox is destroyed off the loop after the close reply: wait for it.
    assert_session_gone(server.state_dir, s.id)
