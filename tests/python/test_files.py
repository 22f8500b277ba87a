"""Files in and out of sessions: chunked and streamed, resumable, atomic,
sha256-checked, capped with numbers; and the manager's refusals, each an
error reply and one log line.

Checked against what the sandbox itself sees (/data/input listed and hashed
from inside), the host's session directory, and the server's log.
"""
import hashlib
import hmac
import json
import os
import re
import subprocess
import sys

import pexpect
import pytest

from server_helpers import CELLBLOCK_BIN, server  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python"))

import cellblock  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def cb(server):  # noqa: F811
    with cellblock.connect(state_dir=server.state_dir) as conn:
        yield conn


def sha(data):
    return hashlib.sha256(data).hexdigest()


def error_of(reply):
    c = reply["content"]
    assert c["status"] == "error", c
    return c["ename"], c["evalue"]


def inside(s, code):
    r = s.run(code)
    assert r.ok, r.error
    return r.stdout.strip()


def input_listing(s):
    return inside(s, "import os\nprint(sorted(os.path.relpath(os.path.join(d, f), '/data/input')"
                     " for d, _, fs in os.walk('/data/input') for f in fs))")


def session_dir(server, sid):  # noqa: F811
    return os.path.join(server.state_dir, "sessions", sid)


def test_streamed_put_and_get_with_progress(cb, tmp_path):
    payload = os.urandom(21 * MiB + 12345)   # over the inline size: chunked, 4 MiB a chunk
    seen = []
    with cb.session() as s:
        local = tmp_path / "in.bin"
        local.write_bytes(payload)
        assert s.put("deep/dir/in.bin", local, progress=lambda d, t: seen.append((d, t)),
                     local=False) == \
            "/data/input/deep/dir/in.bin"
        assert len(seen) >= 6 and seen[-1] == (len(payload), len(payload)), seen
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert inside(s, "import hashlib\nprint(hashlib.sha256(open('/data/input/deep/dir/in.bin',"
                         " 'rb').read()).hexdigest())") == sha(payload)
        # A file object, read from its position.
        with open(local, "rb") as f:
            f.seek(MiB)
            s.put("tail.bin", f)
        assert inside(s, "import os\nprint(os.path.getsize('/data/input/tail.bin'))") == \
            str(len(payload) - MiB)
        # The code writes a file; it comes back by chunks to a path and as bytes.
        inside(s, "data = open('/data/input/deep/dir/in.bin', 'rb').read()\n"
                  "open('/data/output/out.bin', 'wb').write(data[::-1])")
        got = []
        dest = tmp_path / "out.bin"
        assert s.get("out.bin", dest, progress=lambda d, t: got.append(d), local=False) == dest
        assert dest.read_bytes() == payload[::-1]
        assert not os.path.exists(f"{dest}.part")
        assert got[-1] == len(payload) and len(got) >= 6
        assert s.get("/data/output/out.bin") == payload[::-1]
        history = [e for e in s.history()["events"] if e["kind"] == "file_put"]
        assert len(history) == 2 and sha(payload)[:12] in history[0]["detail"], history


def test_killed_upload_leaves_nothing_visible_and_resumes(server, cb):  # noqa: F811
    payload = os.urandom(10 * MiB)
    with cb.session() as s:
        begin = server.ok("file_put_begin_request", {"session_id": s.id, "path": "data.csv",
                                                     "size": len(payload), "sha256": sha(payload)})
        upload, chunk = begin["content"]["upload_id"], begin["content"]["chunk_bytes"]
        assert begin["content"]["offset"] == 0 and chunk <= 8 * MiB
        server.ok("file_put_chunk_request", {"session_id": s.id, "upload_id": upload, "offset": 0},
                  buffers=[payload[:chunk]])
        # Mid-upload: nothing in /data/input, seen from the sandbox or the host.
        assert input_listing(s) == "[]"
        assert os.listdir(os.path.join(session_dir(server, s.id), "input")) == []
        assert inside(s, "import os\nprint(os.path.exists('/data/partial'))") == "False"
        # The connection drops; a new one begins the same file and is told where to go on.
        server._connect_manager()
        again = server.ok("file_put_begin_request", {"session_id": s.id, "path": "data.csv",
                                                     "size": len(payload), "sha256": sha(payload)})
        assert again["content"]["upload_id"] == upload
        assert again["content"]["offset"] == chunk and again["content"]["resumed"] is True
        offset = chunk
        while offset < len(payload):
            server.ok("file_put_chunk_request",
                      {"session_id": s.id, "upload_id": upload, "offset": offset},
                      buffers=[payload[offset:offset + chunk]])
            offset += chunk
        done = server.ok("file_put_commit_request", {"session_id": s.id, "upload_id": upload})
        assert done["content"]["sha256"] == sha(payload)
        assert inside(s, "import hashlib\nprint(hashlib.sha256(open('/data/input/data.csv', 'rb')"
                         ".read()).hexdigest())") == sha(payload)
        assert os.listdir(os.path.join(session_dir(server, s.id), "partial")) == []


def test_client_resumes_after_its_connection_drops(cb, monkeypatch):
    payload = os.urandom(18 * MiB)
    begins = []
    request = cb.request

    def recording(msg_type, content=None, buffers=None, timeout=60.0):
        reply = request(msg_type, content, buffers, timeout)
        if msg_type == "file_put_begin_request":
            begins.append(reply[0])
        return reply

    monkeypatch.setattr(cb, "request", recording)
    dropped = []

    def drop_once(done, total):
        if not dropped:
            dropped.append(done)
            cb._reset_channel()    # the socket under the upload is gone

    with cb.session() as s:
        s.put("big.bin", payload, progress=drop_once, timeout=5)
        assert [b["resumed"] for b in begins] == [False, True], begins
        assert begins[1]["offset"] >= dropped[0] > 0
        assert inside(s, "import hashlib\nprint(hashlib.sha256(open('/data/input/big.bin', 'rb')"
                         ".read()).hexdigest())") == sha(payload)


def test_checksum_mismatch_discards_the_upload(server, cb):  # noqa: F811
    payload = os.urandom(MiB)
    with cb.session() as s:
        upload = server.ok("file_put_begin_request",
                           {"session_id": s.id, "path": "x.bin", "size": len(payload),
                            "sha256": sha(b"other")})["content"]["upload_id"]
        server.ok("file_put_chunk_request", {"session_id": s.id, "upload_id": upload, "offset": 0},
                  buffers=[payload])
        ename, evalue = error_of(server.call("file_put_commit_request",
                                             {"session_id": s.id, "upload_id": upload}))
        assert ename == "ChecksumMismatch" and sha(payload) in evalue, evalue
        assert input_listing(s) == "[]"
        assert os.listdir(os.path.join(session_dir(server, s.id), "partial")) == []


def test_file_too_large_says_the_numbers(server, cb):  # noqa: F811
    with cb.session(limits={"disk_mb": 2}) as s:
        ename, evalue = error_of(server.call("file_put_begin_request",
                                             {"session_id": s.id, "path": "big", "size": 3 * MiB,
                                              "sha256": sha(b"")}))
        assert ename == "FileTooLarge", evalue
        assert str(3 * MiB) in evalue and str(2 * MiB) in evalue and "disk_mb 2" in evalue, evalue
        s.put("one.bin", os.urandom(MiB + MiB // 2))
        with pytest.raises(cellblock.FileTooLarge, match=str(MiB + MiB // 2)):
            s.put("two.bin", os.urandom(MiB))
        # Above the server's maximum for one file.
        maximum = cb.info()["policy"]["max_file_bytes"]
        ename, evalue = error_of(server.call("file_put_begin_request",
                                             {"session_id": s.id, "path": "huge",
                                              "size": maximum + 1, "sha256": sha(b"")}))
        assert ename == "FileTooLarge" and str(maximum) in evalue, evalue


def test_paths_cannot_escape(server, cb):  # noqa: F811
    with cb.session() as s:
        for path in ("../x", "/etc/passwd", "a/../../x", "/data/input/../../etc/x", ""):
            ename, _ = error_of(server.call("file_put_begin_request",
                                            {"session_id": s.id, "path": path, "size": 1,
                                             "sha256": sha(b"x")}))
            assert ename == "InvalidPath", path
            ename, _ = error_of(server.call("file_get_begin_request",
                                            {"session_id": s.id, "path": path}))
            assert ename == "InvalidPath", path
        inside(s, "import os\nos.symlink('/etc/shadow', '/data/output/link')\n"
                  "os.mkfifo('/data/output/fifo')")
        assert error_of(server.call("file_get_begin_request",
                                    {"session_id": s.id, "path": "link"}))[0] == "FileError"
        assert error_of(server.call("file_get_begin_request",
                                    {"session_id": s.id, "path": "fifo"}, timeout=10))[0] == "FileError"


def test_single_message_api_still_works(server, cb):  # noqa: F811
    with cb.session() as s:
        put = server.ok("file_put_request", {"session_id": s.id, "path": "small.txt"},
                        buffers=[b"hello"])["content"]
        assert put == {"status": "ok", "path": "/data/input/small.txt", "size": 5}
        inside(s, "open('/data/output/r.txt', 'w').write(open('/data/input/small.txt').read() * 2)")
        got = server.ok("file_get_request", {"session_id": s.id, "path": "r.txt"})
        assert got["buffers"] == [b"hellohello"] and got["content"]["size"] == 10


def test_a_file_rewritten_during_a_download_is_refused(server, cb):  # noqa: F811
    with cb.session() as s:
        inside(s, "open('/data/output/moving.bin', 'wb').write(b'a' * (12 << 20))")
        begin = server.ok("file_get_begin_request", {"session_id": s.id, "path": "moving.bin"})
        download = begin["content"]["download_id"]
        server.ok("file_get_chunk_request", {"session_id": s.id, "download_id": download, "offset": 0})
        inside(s, "open('/data/output/moving.bin', 'ab').write(b'more')")
        ename, _ = error_of(server.call("file_get_chunk_request",
                                        {"session_id": s.id, "download_id": download,
                                         "offset": 4 << 20}))
        assert ename == "FileChanged"


# ---------------------------------------------------------------- refusals: a reply and a log line

def _signed_frames(server, header, content_bytes):  # noqa: F811
    """Frames signed with the server's key around a content frame we choose."""
    parts = [json.dumps(header, default=str).encode(), b"{}", b"{}", content_bytes]
    digest = hmac.new(server.info["key"].encode(), digestmod=hashlib.sha256)
    for p in parts:
        digest.update(p)
    return [b"<IDS|MSG>", digest.hexdigest().encode(), *parts]


def _refused(server, msg_id, timeout=30):  # noqa: F811
    reply = server.receive(msg_id, timeout=timeout)
    assert reply is not None, f"no reply to {msg_id}; log:\n{server.log()[-2000:]}"
    return reply["content"]["ename"], reply["content"]["evalue"]


def test_refused_messages_get_a_reply_and_a_log_line(server):  # noqa: F811
    log_before = len(server.log())

    # Too large for one message: refused with the numbers, not dropped.
    msg_id = server.send("file_put_request", {"session_id": "x", "path": "big"},
                         buffers=[b"\0" * (70 * MiB)])
    ename, evalue = _refused(server, msg_id, timeout=60)
    numbers = [int(n) for n in re.findall(r"\d+", evalue)]
    assert ename == "MessageTooLarge" and numbers[0] > 70 * MiB > numbers[1], evalue
    assert "file_put_begin_request" in evalue

    # Unknown type, and something that is not a request.
    assert _refused(server, server.send("no_such_request", {}))[0] == "UnknownRequest"
    ename, evalue = _refused(server, server.send("status_reply", {}))
    assert ename == "InvalidRequest" and "not a request" in evalue

    # Signed, but the content frame is not JSON.
    header = server.session.msg_header("server_info_request")
    server.socket.send_multipart(_signed_frames(server, header, b"{not json"))
    ename, evalue = _refused(server, header["msg_id"])
    assert ename == "InvalidRequest" and "content" in evalue, evalue

    # Too many frames.
    msg_id = server.send("server_info_request", {}, buffers=[b"x"] * 100)
    ename, evalue = _refused(server, msg_id)
    assert ename == "InvalidRequest" and "frames" in evalue, evalue

    log = server.log()[log_before:]
    assert log.count("manager: refused") >= 4, log
    assert log.count("manager: rejected message") >= 1, log
    # ...and the server goes on answering.
    assert server.ok("server_info_request", {})["content"]["implementation"] == "cellblock"


# ---------------------------------------------------------------- the CLI

def test_cli_put_get_stream(server, cb, tmp_path):  # noqa: F811
    payload = os.urandom(9 * MiB)
    local = tmp_path / "cli.bin"
    local.write_bytes(payload)
    with cb.session() as s:
        out = server.cli("put", "--stream", s.id, str(local), "cli.bin")
        assert "/data/input/cli.bin" in out.stdout and sha(payload) in out.stdout, out.stdout
        assert "\r" not in out.stderr, "a progress bar on a pipe"
        inside(s, "import shutil\nshutil.copy('/data/input/cli.bin', '/data/output/back.bin')")
        back = tmp_path / "back.bin"
        out = server.cli("get", "--stream", s.id, "back.bin", str(back))
        assert back.read_bytes() == payload and sha(payload) in out.stdout
        puts = [e for e in s.history()["events"] if e["kind"] == "file_put"]
        assert len(puts) == 1 and "local copy" not in puts[0]["detail"], puts
        # By default, on the server's host: by descriptor, the same bytes.
        out = server.cli("put", s.id, str(local), "again.bin")
        assert "/data/input/again.bin" in out.stdout and sha(payload) in out.stdout, out.stdout
        puts = [e for e in s.history()["events"] if e["kind"] == "file_put"]
        assert len(puts) == 2 and "local copy" in puts[1]["detail"], puts
        back.unlink()
        out = server.cli("get", "--local", s.id, "back.bin", str(back))
        assert back.read_bytes() == payload and sha(payload) in out.stdout
        assert not os.path.exists(f"{back}.part")
        both = subprocess.run([CELLBLOCK_BIN, "put", "--state-dir", server.state_dir, "--local",
                               "--stream", s.id, str(local)], capture_output=True, text=True)
        assert both.returncode != 0 and "excludes" in both.stderr, both.stderr
        # On a terminal: a progress bar that reaches 100 %.
        child = pexpect.spawn(CELLBLOCK_BIN, ["put", "--state-dir", server.state_dir, s.id,
                                              str(local), "tty.bin"], timeout=60)
        child.expect(pexpect.EOF)
        text = child.before.decode(errors="replace")
        child.close()
        assert child.exitstatus == 0, text
        assert "100%" in text and "MiB" in text and "\r" in text, text
        assert "tty.bin" in input_listing(s)
