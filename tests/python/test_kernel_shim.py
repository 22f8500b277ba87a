"""The kernel shim's own helpers (kernel-shim/cellblock_ipykernel.py) that a
forked kernel uses to start from its zygote's state without touching all of
it (docs/zygote.md, "What a fork's kernel does not touch"). Checked here on
the interpreter running the tests; test_zygote.py checks the same behaviour
in real forked sessions. The file transfers over control
(cellblock_files.FileTransfers) are checked against the real kernel process
too."""
import contextlib
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", "../.."), "kernel-shim"))
import cellblock_files  # noqa: E402
import cellblock_ipykernel as shim  # noqa: E402


@pytest.fixture
def fake_modules():
    added = []

    def add(name):
        sys.modules[name] = types.ModuleType(name)
        added.append(name)

    yield add
    for name in added:
        sys.modules.pop(name, None)


def test_the_modules_at_start_are_the_zygotes_and_those_imported_since(fake_modules):
    fake_modules("cb_shim_test_before")
    at_start = shim._ModulesAtStart()
    fake_modules("cb_shim_test_after_1")
    fake_modules("cb_shim_test_after_2")
    now = at_start.now()
    assert now == set(sys.modules)
    assert {"cb_shim_test_before", "cb_shim_test_after_1", "cb_shim_test_after_2"} <= now
    # Made from the zygote's set, not built anew from sys.modules.
    assert now is at_start.names


def test_the_modules_at_start_are_built_anew_when_one_of_the_zygotes_is_gone(fake_modules):
    fake_modules("cb_shim_test_gone")
    fake_modules("cb_shim_test_stays")
    at_start = shim._ModulesAtStart()
    del sys.modules["cb_shim_test_gone"]
    fake_modules("cb_shim_test_new")
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_gone" not in now and "cb_shim_test_new" in now
    assert now is not at_start.names


def test_the_modules_at_start_are_built_anew_when_the_zygotes_last_is_gone(fake_modules):
    fake_modules("cb_shim_test_last")
    at_start = shim._ModulesAtStart()
    assert at_start.last == "cb_shim_test_last"
    fake_modules("cb_shim_test_since")
    del sys.modules["cb_shim_test_last"]
    fake_modules("cb_shim_test_last")  # back, at the end: after one added since
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_since" in now


def test_only_the_finders_of_the_homes_import_path_entries_are_forgotten(tmp_path, monkeypatch):
    home = str(tmp_path / "home")
    packages = os.path.join(home, ".local", "packages")
    elsewhere = str(tmp_path / "elsewhere")
    missing = str(tmp_path / "missing")
    not_on_path = os.path.join(home, "not-on-path")
    monkeypatch.setattr(sys, "path", [packages, elsewhere, missing, *sys.path])
    cache = dict(sys.path_importer_cache)
    monkeypatch.setattr(sys, "path_importer_cache", cache)
    marker = object()
    cache.update({packages: marker, elsewhere: marker, missing: None, home: marker,
                  not_on_path: marker})
    shim._forget_finders_under(home)
    assert packages not in cache and missing not in cache and home not in cache
    assert cache[elsewhere] is marker
    # Not on the import path: not looked at (a package's own dir, say).
    assert cache[not_on_path] is marker


@contextlib.contextmanager
def _running_kernel(tmp_path, info_fields=(), env_fields=()):
    """The shim's kernel, a real process outside any sandbox, on 127.0.0.1.
    Yields the connection info as rewritten by ipykernel with its ports."""
    import json
    import subprocess
    import time

    path = tmp_path / "kernel.json"
    info = {"transport": "tcp", "ip": "127.0.0.1", "shell_port": 0, "iopub_port": 0,
            "stdin_port": 0, "control_port": 0, "hb_port": 0, "key": "inner-key",
            "signature_scheme": "hmac-sha256", "kernel_name": "host", **dict(info_fields)}
    path.write_text(json.dumps(info))
    env = dict(os.environ, HOME=str(tmp_path), IPYTHONDIR=str(tmp_path / "ipython"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), **dict(env_fields))
    log = open(tmp_path / "kernel.log", "wb")
    kernel = subprocess.Popen([sys.executable, os.path.abspath(shim.__file__), "-f", str(path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                written = json.loads(path.read_text() or "{}")
            except (ValueError, FileNotFoundError):
                # ipykernel rewrites it by removing it and writing a new one
                # (jupyter_core's secure_write): absent, then half-written.
                written = {}
            if written.get("shell_port") and written.get("hb_port"):
                break
            assert kernel.poll() is None, (tmp_path / "kernel.log").read_text()
            assert time.monotonic() < deadline, "the kernel wrote no ports in 60 s"
            time.sleep(0.1)
        yield dict(written, _process=kernel)
    finally:
        kernel.kill()
        kernel.wait()
        log.close()


@pytest.fixture
def curve_kernel(tmp_path):
    """The shim's kernel with a connection file naming a CurveZMQ secret key
    (as the Swarm backend's secret does). Yields (connection info, the
    kernel's public key)."""
    import zmq

    public, secret = zmq.curve_keypair()
    with _running_kernel(tmp_path, {"curve_secret_key": secret.decode()}) as info:
        yield info, public


def _kernel_info(info, context, server_key=None, wait_s=60):
    """kernel_info_request on shell as a DEALER (a CURVE client when
    `server_key` is given); the reply's content, or None after `wait_s`."""
    import zmq
    from jupyter_client.session import Session

    session = Session(key=info["key"].encode())
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if server_key:
        client_public, client_secret = zmq.curve_keypair()
        sock.curve_serverkey = server_key
        sock.curve_publickey = client_public
        sock.curve_secretkey = client_secret
    sock.connect(f"tcp://127.0.0.1:{info['shell_port']}")
    try:
        session.send(sock, "kernel_info_request", {})
        if not sock.poll(wait_s * 1000):
            return None
        _, msg = session.feed_identities(sock.recv_multipart(), copy=True)
        return session.deserialize(msg)["content"]
    finally:
        sock.close()


def test_a_connection_file_with_a_curve_key_makes_every_channel_a_curve_server(curve_kernel):
    import zmq

    from server_helpers import zmtp_mechanism

    info, public = curve_kernel
    # ipykernel writes its file again, without cellblock's field.
    assert "curve_secret_key" not in info
    # Each of the five ports greets with the CURVE mechanism.
    for channel in ("shell", "iopub", "stdin", "control", "hb"):
        assert zmtp_mechanism(info[f"{channel}_port"]) == "CURVE", channel

    context = zmq.Context()
    try:
        # With the kernel's public key: answered, as by any kernel.
        reply = _kernel_info(info, context, server_key=public)
        assert reply is not None and reply["status"] == "ok", reply
        hb = context.socket(zmq.REQ)
        hb.linger = 0
        hb.curve_serverkey = public
        hb.curve_publickey, hb.curve_secretkey = zmq.curve_keypair()
        hb.connect(f"tcp://127.0.0.1:{info['hb_port']}")
        hb.send(b"ping")
        assert hb.poll(10000) and hb.recv() == b"ping"
        hb.close()
        # Without it (the NULL mechanism of a plain Jupyter client), or with
        # another key: the handshake fails and nothing is answered.
        assert _kernel_info(info, context, wait_s=3) is None
        other_public, _ = zmq.curve_keypair()
        assert _kernel_info(info, context, server_key=other_public, wait_s=3) is None
    finally:
        context.term()


class _KernelClient:
    """A DEALER on the kernel's control and one on its shell, plain (no
    CURVE), signing with the connection's key."""

    def __init__(self, info):
        import zmq
        from jupyter_client.session import Session

        self.session = Session(key=info["key"].encode())
        self.context = zmq.Context()
        self.sockets = {}
        for channel in ("control", "shell"):
            sock = self.context.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://127.0.0.1:{info[f'{channel}_port']}")
            self.sockets[channel] = sock

    def close(self):
        for sock in self.sockets.values():
            sock.close()
        self.context.term()

    def send(self, channel, msg_type, content, buffers=()):
        return self.session.send(self.sockets[channel], msg_type, content,
                                 buffers=list(buffers))["header"]["msg_id"]

    def reply(self, channel, msg_id, wait_s=60):
        """The reply to `msg_id` on `channel`: (msg_type, content, buffers)."""
        import time

        sock = self.sockets[channel]
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(left * 1000), f"no reply on {channel} in {wait_s} s"
            _, frames = self.session.feed_identities(sock.recv_multipart(), copy=True)
            msg = self.session.deserialize(frames)
            if msg["parent_header"].get("msg_id") == msg_id:
                return (msg["header"]["msg_type"], msg["content"],
                        [bytes(b) for b in msg["buffers"]])

    def start_cell(self, code, started):
        """Sends a cell that creates the file `started`, then runs `code`;
        returns its msg_id once the file exists (60 s at most): it runs."""
        import time

        msg_id = self.send("shell", "execute_request",
                           {"code": f"open({str(started)!r}, 'w').close()\n{code}",
                            "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True})
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline, "the cell did not start in 60 s"
            time.sleep(0.05)
        return msg_id

    def control(self, msg_type, content, buffers=()):
        """A control request's reply: (content, buffers); the reply's type
        checked."""
        reply_type, content, buffers = self.reply("control", self.send("control", msg_type,
                                                                       content, buffers))
        assert reply_type == msg_type.replace("_request", "_reply")
        return content, buffers

    def write(self, transfer, path, offset, chunk, last):
        return self.control("cellblock_file_write_request",
                            {"transfer": transfer, "path": path, "offset": offset, "last": last},
                            [chunk])[0]

    def read(self, transfer, path, offset, length):
        return self.control("cellblock_file_read_request",
                            {"transfer": transfer, "path": path, "offset": offset,
                             "length": length})

    def upload(self, transfer, path, data, chunk_bytes):
        """Sends `data` in chunks; the last reply."""
        offset = 0
        while True:
            chunk = data[offset:offset + chunk_bytes]
            last = offset + len(chunk) >= len(data)
            reply = self.write(transfer, path, offset, chunk, last)
            assert reply["status"] == "ok", reply
            offset += len(chunk)
            if last:
                return reply
            assert reply["written"] == offset

    def download(self, transfer, path, chunk_bytes):
        """(the bytes, each reply's content)."""
        data, replies = b"", []
        while True:
            reply, buffers = self.read(transfer, path, len(data), chunk_bytes)
            replies.append(reply)
            if reply["status"] != "ok":
                return data, replies
            assert reply["offset"] == len(data) and len(buffers) == 1
            data += buffers[0]
            if reply["eof"]:
                return data, replies

    def listing(self, **content):
        return self.control("cellblock_file_list_request", content)[0]


@pytest.fixture
def files_kernel(tmp_path):
    """The shim's kernel (plain channels) with its input and output dirs in
    tmp_path. Yields (a _KernelClient, input dir, output dir)."""
    input_dir = tmp_path / "input"
    output_dir = tmp_path / "output"
    input_dir.mkdir()
    output_dir.mkdir()
    env = {"CELLBLOCK_INPUT_DIR": str(input_dir), "CELLBLOCK_OUTPUT_DIR": str(output_dir)}
    with _running_kernel(tmp_path, env_fields=env) as info:
        client = _KernelClient(info)
        try:
            yield client, input_dir, output_dir
        finally:
            client.close()


MiB = 1 << 20


def _partials(input_dir):
    partial_dir = input_dir / ".cellblock-partial"
    return sorted(p.name for p in partial_dir.iterdir()) if partial_dir.exists() else []


def test_an_upload_in_three_chunks_lands_whole_with_its_sha256(files_kernel):
    import hashlib

    client, input_dir, _ = files_kernel
    data = os.urandom(3 * MiB - 1000)
    reply = client.upload("up-1", "sub/dir/data.bin", data, MiB)
    assert reply == {"status": "ok", "transfer": "up-1", "written": len(data),
                     "sha256": hashlib.sha256(data).hexdigest(), "path": "sub/dir/data.bin"}
    assert (input_dir / "sub/dir/data.bin").read_bytes() == data
    assert _partials(input_dir) == []
    # An empty file, in one empty chunk.
    assert client.upload("up-2", "empty", b"", MiB)["sha256"] == hashlib.sha256(b"").hexdigest()
    assert (input_dir / "empty").read_bytes() == b""


def test_an_upload_at_a_wrong_offset_is_refused_and_leaves_nothing(files_kernel):
    client, input_dir, _ = files_kernel
    assert client.write("up-1", "late.bin", 0, b"x" * 1000, False)["written"] == 1000
    assert _partials(input_dir) == ["up-1"]
    reply = client.write("up-1", "late.bin", 2000, b"y" * 1000, True)
    assert reply["status"] == "error" and reply["ename"] == "FileError", reply
    assert reply["transfer"] == "up-1" and "traceback" not in reply
    assert "2000" in reply["evalue"] and "1000" in reply["evalue"], reply
    assert _partials(input_dir) == [] and not (input_dir / "late.bin").exists()
    # The transfer is forgotten: its next chunk is refused too.
    assert client.write("up-1", "late.bin", 1000, b"y", True)["ename"] == "FileError"
    assert not (input_dir / "late.bin").exists()
    # A transfer id outside [0-9a-zA-Z_-]{1,64}.
    for transfer in ("a/b", "", "x" * 65, 7):
        reply = client.write(transfer, "id.bin", 0, b"z", True)
        assert reply["ename"] == "FileError" and reply["transfer"] == transfer, reply
    assert not (input_dir / "id.bin").exists()


def test_paths_that_leave_their_directory_are_refused(files_kernel):
    client, input_dir, output_dir = files_kernel
    (output_dir / "a").mkdir()
    (output_dir / "a" / "b").write_bytes(b"b")
    for path in ("../x", "/etc/x", "a//b", "./a", "a/./b", "a/..", "", "a/", "a\0b",
                 "x" * 4097):
        reply = client.write("bad", path, 0, b"data", True)
        assert reply["status"] == "error" and reply["ename"] == "InvalidPath", (path, reply)
        reply, buffers = client.read("bad", path, 0, 100)
        assert reply["ename"] == "InvalidPath" and buffers == [], (path, reply)
    assert os.listdir(input_dir) == []
    assert not (input_dir.parent / "x").exists()


def test_nothing_is_written_through_a_link_the_sandbox_planted(files_kernel, tmp_path):
    client, input_dir, _ = files_kernel
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (input_dir / "sub").symlink_to(elsewhere)
    reply = client.write("up-1", "sub/x.bin", 0, b"payload", True)
    assert reply["ename"] == "FileError" and "symbolic link" in reply["evalue"], reply
    assert str(input_dir / "sub") in reply["evalue"]
    assert os.listdir(elsewhere) == [] and _partials(input_dir) == []
    # Deeper: a link as the second component.
    (input_dir / "real").mkdir()
    (input_dir / "real" / "inner").symlink_to(elsewhere)
    reply = client.write("up-2", "real/inner/deep/x.bin", 0, b"payload", True)
    assert reply["ename"] == "FileError" and "symbolic link" in reply["evalue"], reply
    assert os.listdir(elsewhere) == []
    # A link as the target itself is replaced, not written through.
    victim = elsewhere / "victim"
    victim.write_bytes(b"untouched")
    (input_dir / "target.bin").symlink_to(victim)
    assert client.upload("up-3", "target.bin", b"new", 1024)["written"] == 3
    assert victim.read_bytes() == b"untouched"
    assert not (input_dir / "target.bin").is_symlink()
    assert (input_dir / "target.bin").read_bytes() == b"new"
    # The partial dir, or a partial file, made a link or a FIFO.
    (input_dir / ".cellblock-partial" / "up-4").symlink_to(elsewhere / "partial")
    reply = client.write("up-4", "p.bin", 0, b"payload", True)
    assert reply["ename"] == "FileError" and "symbolic link" in reply["evalue"], reply
    os.mkfifo(input_dir / ".cellblock-partial" / "up-5")
    reply = client.write("up-5", "p.bin", 0, b"payload", True)
    assert reply["ename"] == "FileError", reply
    assert _partials(input_dir) == []
    os.rmdir(input_dir / ".cellblock-partial")
    (input_dir / ".cellblock-partial").symlink_to(elsewhere)
    reply = client.write("up-6", "p.bin", 0, b"payload", True)
    assert reply["ename"] == "FileError" and "symbolic link" in reply["evalue"], reply
    assert sorted(os.listdir(elsewhere)) == ["victim"]
    assert not (input_dir / "p.bin").exists()
    # A directory where the file should go.
    (input_dir / "adir").mkdir()
    os.unlink(input_dir / ".cellblock-partial")
    reply = client.write("up-7", "adir", 0, b"payload", True)
    assert reply["ename"] == "FileError" and "directory" in reply["evalue"], reply
    assert _partials(input_dir) == []


def test_a_download_in_chunks_returns_the_file_and_its_sha256(files_kernel):
    import hashlib

    client, _, output_dir = files_kernel
    data = os.urandom(2 * MiB + 12345)
    (output_dir / "results").mkdir()
    (output_dir / "results" / "model.bin").write_bytes(data)
    got, replies = client.download("down-1", "results/model.bin", MiB)
    assert got == data
    assert [r["offset"] for r in replies] == [0, MiB, 2 * MiB]
    assert [r["eof"] for r in replies] == [False, False, True]
    assert all(r["size"] == len(data) and r["transfer"] == "down-1" for r in replies)
    assert "sha256" not in replies[0] and replies[-1]["sha256"] == hashlib.sha256(data).hexdigest()
    # The transfer ended with its last chunk.
    reply, _ = client.read("down-1", "results/model.bin", len(data), MiB)
    assert reply["ename"] == "FileError", reply
    # An empty file: one reply, at eof.
    (output_dir / "empty").write_bytes(b"")
    reply, buffers = client.read("down-2", "empty", 0, MiB)
    assert (reply["size"], reply["eof"], buffers) == (0, True, [b""]), reply
    # A missing file, or directory; a chunk too large; a wrong offset.
    for path in ("missing.bin", "nowhere/missing.bin"):
        reply, _ = client.read("down-3", path, 0, MiB)
        assert reply["ename"] == "FileNotFound" and path in reply["evalue"], reply
    reply, _ = client.read("down-4", "results/model.bin", 0, 8 * MiB + 1)
    assert reply["ename"] == "FileError", reply
    assert client.read("down-5", "results/model.bin", 0, 100)[0]["status"] == "ok"
    reply, _ = client.read("down-5", "results/model.bin", 50, 100)
    assert reply["ename"] == "FileError" and "50" in reply["evalue"], reply


def test_a_file_that_shrinks_while_read_is_refused(files_kernel):
    client, _, output_dir = files_kernel
    (output_dir / "log.txt").write_bytes(b"x" * 3000)
    reply, buffers = client.read("down-1", "log.txt", 0, 1000)
    assert reply["size"] == 3000 and len(buffers[0]) == 1000
    with open(output_dir / "log.txt", "r+b") as f:
        f.truncate(1500)
    reply, buffers = client.read("down-1", "log.txt", 1000, 1000)
    assert reply["ename"] == "FileError" and "changed while being read" in reply["evalue"], reply


def test_a_link_in_the_output_dir_is_neither_read_nor_listed(files_kernel, tmp_path):
    client, _, output_dir = files_kernel
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the front")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"f")
    (output_dir / "secret.txt").symlink_to(secret)
    (output_dir / "linkdir").symlink_to(tmp_path / "elsewhere")
    (output_dir / "plain.txt").write_bytes(b"plain")
    os.mkfifo(output_dir / "pipe")
    for path in ("secret.txt", "linkdir/f"):
        reply, buffers = client.read("down-1", path, 0, 1000)
        assert reply["ename"] == "FileError" and "symbolic link" in reply["evalue"], reply
        assert buffers == []
    # A FIFO is refused at once, not waited on.
    reply, _ = client.read("down-2", "pipe", 0, 1000)
    assert reply["ename"] == "FileError" and "regular file" in reply["evalue"], reply
    listing = client.listing()
    assert [f["path"] for f in listing["files"]] == ["plain.txt"], listing
    assert listing["truncated"] is False


def test_the_listing_names_regular_files_in_order_and_says_when_it_is_cut(files_kernel):
    client, input_dir, output_dir = files_kernel
    for path, size in (("b.txt", 3), ("a/z.bin", 10), ("a-b", 1), ("a/deep/er/f", 0),
                       (".cellblock-snapshot", 5), (".cellblock-partial/x", 1)):
        (output_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / path).write_bytes(b"x" * size)
    os.utime(output_dir / "b.txt", (1000000000.5, 1000000000.5))
    listing = client.listing()
    assert listing["status"] == "ok" and listing["truncated"] is False, listing
    assert [(f["path"], f["size"]) for f in listing["files"]] == [
        ("a-b", 1), ("a/deep/er/f", 0), ("a/z.bin", 10), ("b.txt", 3)]
    assert next(f["mtime"] for f in listing["files"] if f["path"] == "b.txt") == 1000000000.5
    listing = client.listing(max_files=2)
    assert [f["path"] for f in listing["files"]] == ["a-b", "a/deep/er/f"]
    assert listing["truncated"] is True
    assert client.listing(max_files=4)["truncated"] is False
    listing = client.listing(max_depth=1)
    assert [f["path"] for f in listing["files"]] == ["a-b", "a/z.bin", "b.txt"]
    assert listing["truncated"] is True
    assert client.listing(max_files=-1)["ename"] == "FileError"
    # No output dir at all: nothing to list.
    os.rename(output_dir, input_dir / "moved")
    assert client.listing() == {"status": "ok", "files": [], "truncated": False}


def test_files_move_while_a_cell_executes(files_kernel, tmp_path):
    """The control thread answers transfers while the shell runs a cell: the
    cell waits for a file the test makes only once both moves are done (no
    clock in the verdict: a slow machine cannot fail it)."""
    import hashlib

    client, input_dir, output_dir = files_kernel
    started, release = tmp_path / "cell-started", tmp_path / "cell-release"
    (output_dir / "out.bin").write_bytes(b"o" * 100000)
    execution = client.start_cell(f"import os, time\nwhile not os.path.exists({str(release)!r}):\n"
                                  "    time.sleep(0.05)", started)
    data = os.urandom(300000)
    assert client.upload("up-1", "during.bin", data, 100000)["sha256"] == \
        hashlib.sha256(data).hexdigest()
    got, replies = client.download("down-1", "out.bin", 40000)
    assert got == b"o" * 100000 and replies[-1]["eof"]
    # The cell is still running (it waits for `release`): its reply has not come.
    assert not client.sockets["shell"].poll(0)
    release.touch()
    reply_type, content, _ = client.reply("shell", execution, wait_s=60)
    assert (reply_type, content["status"]) == ("execute_reply", "ok")
    assert (input_dir / "during.bin").read_bytes() == data


def test_abort_ends_a_transfer_and_a_ninth_is_refused(files_kernel):
    client, input_dir, output_dir = files_kernel
    (output_dir / "big").write_bytes(b"b" * 5000)
    for n in range(7):
        assert client.write(f"t{n}", f"f{n}", 0, b"part", False)["status"] == "ok"
    assert client.read("t7", "big", 0, 1000)[0]["eof"] is False
    assert _partials(input_dir) == [f"t{n}" for n in range(7)]
    reply = client.write("t8", "f8", 0, b"part", False)
    assert reply["ename"] == "FileError" and "8 file transfers are open" in reply["evalue"]
    assert "t8" not in _partials(input_dir)
    reply, _ = client.read("t8", "big", 0, 1000)
    assert reply["ename"] == "FileError" and "8 file transfers are open" in reply["evalue"]
    # Starting one again at offset 0 replaces it: still 8.
    assert client.write("t0", "f0", 0, b"again", False)["written"] == 5
    abort = "cellblock_file_abort_request"
    assert client.control(abort, {"transfer": "t0"})[0] == \
        {"status": "ok", "transfer": "t0", "aborted": True}
    assert "t0" not in _partials(input_dir) and not (input_dir / "f0").exists()
    assert client.control(abort, {"transfer": "t7"})[0]["aborted"] is True
    assert client.control(abort, {"transfer": "t7"})[0]["aborted"] is False
    assert client.write("t8", "f8", 0, b"part", True)["status"] == "ok"
    assert (input_dir / "f8").read_bytes() == b"part"


def test_a_transfer_untouched_for_120_s_is_dropped(tmp_path, monkeypatch):
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    monkeypatch.setenv("CELLBLOCK_INPUT_DIR", str(input_dir))
    now = [1000.0]
    transfers = cellblock_files.FileTransfers(clock=lambda: now[0])
    write = "cellblock_file_write_request"

    def chunk(transfer, offset, last=False):
        return transfers.answer(write, {"transfer": transfer, "path": transfer, "offset": offset,
                                        "last": last}, [b"1234"])[0]

    assert chunk("old", 0)["written"] == 4
    now[0] += 60
    assert chunk("new", 0)["written"] == 4
    now[0] += 60.5  # "old" untouched for 120.5 s, "new" for 60.5 s
    assert chunk("new", 4)["written"] == 8
    assert transfers.open_count() == 1
    assert sorted(os.listdir(input_dir / ".cellblock-partial")) == ["new"]
    reply = chunk("old", 4, last=True)
    assert reply["ename"] == "FileError" and not (input_dir / "old").exists(), reply


def test_an_exit_request_on_control_ends_the_kernel_while_a_cell_runs(tmp_path):
    """What the server sends before it removes a Swarm service (whose shim
    holds the engine's SIGTERM): the kernel exits from its control thread,
    whatever its shell runs."""
    started = tmp_path / "cell-started"
    with _running_kernel(tmp_path) as info:
        client = _KernelClient(info)
        try:
            client.start_cell("while True: pass", started)
            client.send("control", "cellblock_exit_request", {})
            assert info["_process"].wait(timeout=60) == 0
        finally:
            client.close()
