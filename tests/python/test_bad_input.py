"""Hostile input on a cellblock kernel's shell channel, spoken as raw ZMQ.

A raw DEALER socket talks to the shell port of a running cellblock kernel
(connection info from its KernelManager), building legitimate messages with
jupyter_client's Session and then breaking them. For each bad message:
no reply comes back, the server logs why it rejected it (its stderr is
captured to a file), the kernel never runs it, nothing crashes, and a
legitimate client keeps working.
"""
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time

import pytest
import zmq
from jupyter_client.manager import KernelManager
from jupyter_client.session import Session

from conftest import KERNEL_NAME, STATE_DIR, run_cell, stream_text, wait_for
from server_helpers import routing_identity

DELIM = b"<IDS|MSG>"
NO_REPLY_WAIT = 1.5  # seconds a rejected message is given to (wrongly) produce a reply


# ---------------------------------------------------------------- helpers

class ServerLog:
    """The cellblock process's stderr, captured to a file; read from an offset."""

    def __init__(self, path):
        self.path = path
        self.offset = 0

    def text(self):
        with open(self.path, errors="replace") as f:
            return f.read()

    def mark(self):
        self.offset = len(self.text())

    def since_mark(self):
        return self.text()[self.offset:]

    def wait_for_line(self, *needles, timeout=5):
        def find():
            return [line for line in self.since_mark().splitlines()
                    if all(n in line for n in needles)]
        return wait_for(find, timeout=timeout)


class RawShell:
    """A DEALER on the kernel's shell port, with an identity of our own."""

    def __init__(self, ctx, info):
        self.identity = routing_identity()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.connect(f"{info['transport']}://{info['ip']}:{info['shell_port']}")
        self.session = Session(key=info["key"], signature_scheme=info["signature_scheme"],
                               username="bad-input-test")

    @property
    def identity_hex(self):
        return self.identity.hex()

    def frames(self, msg_type, content):
        """A legitimate, correctly signed message as wire frames (no routing id)."""
        msg = self.session.msg(msg_type, content)
        frames = self.session.serialize(msg)
        assert frames[0] == DELIM
        return msg["header"]["msg_id"], frames

    def sign(self, *json_frames):
        return self.session.sign(list(json_frames))

    def send(self, frames):
        self.sock.send_multipart(frames, copy=True)

    def recv(self, timeout):
        """Every message that arrives within timeout seconds, verified and decoded."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                return out
            raw = self.sock.recv_multipart()
            _, parts = self.session.feed_identities(raw)
            out.append(self.session.deserialize(parts))

    def round_trip(self, timeout=30):
        """A legitimate kernel_info_request must get its reply."""
        msg_id, frames = self.frames("kernel_info_request", {})
        self.send(frames)
        replies = self.recv_until(msg_id, timeout)
        assert replies, "no kernel_info_reply to a legitimate request"
        assert replies[0]["header"]["msg_type"] == "kernel_info_reply"
        assert replies[0]["content"].get("status") == "ok", replies[0]["content"]

    def recv_until(self, msg_id, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.recv(min(0.5, deadline - time.monotonic())):
                if msg["parent_header"].get("msg_id") == msg_id:
                    return [msg]
        return []

    def close(self):
        self.sock.close(0)


def execute_content(code):
    return {"code": code, "silent": False, "store_history": False,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}


@pytest.fixture(scope="module")
def server():
    """A cellblock kernel with its stderr in a file, a jupyter_client client, a raw shell socket."""
    log_fd, log_path = tempfile.mkstemp(prefix="cellblock-bad-input-", suffix=".log")
    log_file = os.fdopen(log_fd, "w")
    km = KernelManager(kernel_name=KERNEL_NAME)
    km.start_kernel(env=dict(os.environ), stderr=log_file)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    reply, _ = run_cell(kc, "bad_hits = []")
    assert reply["status"] == "ok", reply
    ctx = zmq.Context()
    raw = RawShell(ctx, km.get_connection_info())
    raw.round_trip()
    log = ServerLog(log_path)
    yield {"km": km, "kc": kc, "raw": raw, "log": log}
    raw.close()
    ctx.term()
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    log_file.close()
    os.unlink(log_path)


def assert_still_serving(server):
    """Nothing crashed, the kernel never ran a bad message, legit clients work."""
    km, kc, raw = server["km"], server["kc"], server["raw"]
    proc = km.provisioner.process
    assert proc.poll() is None, f"cellblock exited with {proc.returncode}:\n{server['log'].text()}"
    assert km.is_alive()
    crash = [line for line in server["log"].since_mark().splitlines()
             if " error]" in line or "critical" in line or "closed (" in line]
    assert crash == [], crash
    reply, outputs = run_cell(kc, "1+1", timeout=30)
    assert reply["status"] == "ok", reply
    results = [m["content"]["data"]["text/plain"] for m in outputs
               if m["msg_type"] == "execute_result"]
    assert results == ["2"], outputs
    reply, outputs = run_cell(kc, "print(bad_hits)", timeout=30)
    assert stream_text(outputs).strip() == "[]", "the kernel ran a rejected message: " + \
        stream_text(outputs)
    raw.round_trip()


def assert_rejected(server, frames, reason, msg_id=None):
    """Sends frames on the raw socket; no reply, a logged rejection, a healthy server."""
    raw, log = server["raw"], server["log"]
    log.mark()
    raw.send(frames)
    replies = raw.recv(NO_REPLY_WAIT)
    assert replies == [], f"a rejected message got a reply: {replies}"
    lines = log.wait_for_line("rejected message", raw.identity_hex, reason)
    assert lines, f"no rejection '{reason}' from {raw.identity_hex} logged; log since send:\n" + \
        log.since_mark()
    if msg_id is not None:
        # IOPub saw nothing for it either (the kernel never became busy on it).
        stray = [m for m in _drain_iopub(server["kc"]) if m["parent_header"].get("msg_id") == msg_id]
        assert stray == [], stray
    assert_still_serving(server)


def _drain_iopub(kc, timeout=0.3):
    msgs = []
    while True:
        try:
            msgs.append(kc.get_iopub_msg(timeout=timeout))
        except Exception:
            return msgs


# ---------------------------------------------------------------- cases

def bad_execute(raw, case):
    """A legitimate execute_request whose code would leave a trace if it ever ran."""
    return raw.frames("execute_request", execute_content(f"bad_hits.append({case!r})"))


def test_legitimate_message_gets_a_reply(server):
    raw = server["raw"]
    msg_id, frames = raw.frames("execute_request", execute_content("40 + 2"))
    raw.send(frames)
    replies = raw.recv_until(msg_id, timeout=30)
    assert replies and replies[0]["header"]["msg_type"] == "execute_reply", replies
    assert replies[0]["content"]["status"] == "ok", replies[0]["content"]
    assert_still_serving(server)


def test_bad_signature(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "bad signature")
    sig = frames[1].decode()
    frames[1] = (sig[:-1] + ("0" if sig[-1] != "0" else "1")).encode()
    assert_rejected(server, frames, "bad signature", msg_id)


def test_signed_with_another_key(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "other key")
    other = hmac.new(secrets.token_hex(32).encode(), digestmod=hashlib.sha256)
    for part in frames[2:6]:
        other.update(part)
    frames[1] = other.hexdigest().encode()
    assert_rejected(server, frames, "bad signature", msg_id)


def test_missing_signature(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "no signature")
    frames[1] = b""
    assert_rejected(server, frames, "bad signature", msg_id)


def test_signature_of_another_message(server):
    raw = server["raw"]
    _, donor = raw.frames("kernel_info_request", {})
    msg_id, frames = bad_execute(raw, "borrowed signature")
    frames[1] = donor[1]
    assert_rejected(server, frames, "bad signature", msg_id)


def test_content_tampered_after_signing(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "tampered")
    frames[5] = frames[5].replace(b"tampered", b"tampereD")
    assert_rejected(server, frames, "bad signature", msg_id)


def test_truncated_to_delimiter_and_signature(server):
    raw = server["raw"]
    _, frames = bad_execute(raw, "truncated")
    assert_rejected(server, frames[:2], "too few frames after delimiter")


def test_truncated_after_header(server):
    raw = server["raw"]
    _, frames = bad_execute(raw, "truncated header")
    assert_rejected(server, frames[:3], "too few frames after delimiter")


def test_no_delimiter(server):
    raw = server["raw"]
    _, frames = bad_execute(raw, "no delimiter")
    assert_rejected(server, frames[1:], "missing delimiter")


def test_content_not_json(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "not json")
    frames[5] = b'{"code": "bad_hits.append(\'not json\')", '  # cut off: not JSON
    frames[1] = raw.sign(*frames[2:6])  # correctly signed: only the JSON check can catch it
    assert_rejected(server, frames, "frame 5 is not a JSON object", msg_id)


def test_content_json_but_not_an_object(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "array")
    frames[5] = json.dumps(["bad_hits.append('array')"]).encode()
    frames[1] = raw.sign(*frames[2:6])
    assert_rejected(server, frames, "frame 5 is not a JSON object", msg_id)


def test_header_not_json(server):
    raw = server["raw"]
    _, frames = bad_execute(raw, "header")
    frames[2] = b"\xff\xfe not json at all"
    frames[1] = raw.sign(*frames[2:6])
    assert_rejected(server, frames, "frame 2 is not a JSON object")


def test_json_nested_too_deep(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "deep")
    # Valid JSON, 5000 arrays deep: a recursive parser would blow its stack.
    deep = "[" * 5000 + '"x"' + "]" * 5000
    frames[5] = frames[5][:-1] + b', "metadata_bomb": ' + deep.encode() + b"}"
    frames[1] = raw.sign(*frames[2:6])
    assert_rejected(server, frames, "frame 5 is not a JSON object", msg_id)


def test_header_without_msg_type(server):
    raw = server["raw"]
    _, frames = bad_execute(raw, "no msg_type")
    header = json.loads(frames[2])
    del header["msg_type"]
    frames[2] = json.dumps(header).encode()
    frames[1] = raw.sign(*frames[2:6])
    assert_rejected(server, frames, "header lacks msg_id or msg_type")


def test_reply_sent_as_a_request(server):
    raw = server["raw"]
    msg_id, frames = raw.frames("execute_reply", {"status": "ok", "execution_count": 1})
    assert_rejected(server, frames, "is not a request", msg_id)


def test_too_many_frames(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "frames")
    frames += [b"buffer"] * 2000
    assert_rejected(server, frames, "too many frames", msg_id)


def test_too_many_routing_identities(server):
    raw = server["raw"]
    msg_id, frames = bad_execute(raw, "identities")
    # The ROUTER adds our real identity in front of these 20 forged ones.
    frames = [b"forged-%d" % i for i in range(20)] + frames
    assert_rejected(server, frames, "too many identities", msg_id)


@pytest.mark.parametrize("channel,msg_type", [("control", "kernel_info_request"),
                                              ("stdin", "input_reply")])
def test_bad_signature_on_other_channels(server, channel, msg_type):
    km, raw, log = server["km"], server["raw"], server["log"]
    info = km.get_connection_info()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    ident = routing_identity()
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(f"{info['transport']}://{info['ip']}:{info[channel + '_port']}")
    try:
        content = {"value": "bad_hits.append('stdin')"} if channel == "stdin" else {}
        msg = raw.session.msg(msg_type, content)
        frames = raw.session.serialize(msg)
        frames[1] = secrets.token_hex(32).encode()
        log.mark()
        sock.send_multipart(frames)
        assert not sock.poll(int(NO_REPLY_WAIT * 1000)), f"a bad message on {channel} got a reply"
        assert log.wait_for_line(f" {channel}: rejected message", ident.hex(), "bad signature"), \
            f"no rejection logged for {channel}:\n{log.since_mark()}"
        # The same socket, with a good signature, still gets an answer on control.
        if channel == "control":
            good = raw.session.msg(msg_type, {})
            sock.send_multipart(raw.session.serialize(good))
            assert sock.poll(30000), "no reply on control to a legitimate request"
            _, parts = raw.session.feed_identities(sock.recv_multipart())
            reply = raw.session.deserialize(parts)
            assert reply["parent_header"]["msg_id"] == good["header"]["msg_id"], reply
    finally:
        sock.close(0)
    assert_still_serving(server)


def test_replayed_message_gets_no_second_reply(server):
    raw, kc = server["raw"], server["kc"]
    run_cell(kc, "replay_runs = 0")
    msg_id, frames = raw.frames("execute_request",
                                execute_content("replay_runs += 1\nreplay_runs"))
    captured = [bytes(f) for f in frames]
    raw.send(captured)
    first = raw.recv_until(msg_id, timeout=30)
    assert first and first[0]["content"]["status"] == "ok", first
    # The exact same frames again.
    assert_rejected(server, list(captured), "replayed message")
    reply, outputs = run_cell(kc, "replay_runs")
    results = [m["content"]["data"]["text/plain"] for m in outputs
               if m["msg_type"] == "execute_result"]
    assert results == ["1"], "the replayed execute_request ran again"


def test_replay_from_another_socket_or_channel(server):
    """An eavesdropper replays a captured request from its own sockets."""
    raw, kc, km, log = server["raw"], server["kc"], server["km"], server["log"]
    run_cell(kc, "replay_runs_2 = 0")
    msg_id, frames = raw.frames("execute_request",
                                execute_content("replay_runs_2 += 1\nreplay_runs_2"))
    captured = [bytes(f) for f in frames]
    raw.send(captured)
    first = raw.recv_until(msg_id, timeout=30)
    assert first and first[0]["content"]["status"] == "ok", first

    info = km.get_connection_info()
    ctx = zmq.Context.instance()
    for channel in ("shell", "control"):
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief_id = routing_identity()
        thief.setsockopt(zmq.IDENTITY, thief_id)
        thief.connect(f"{info['transport']}://{info['ip']}:{info[channel + '_port']}")
        try:
            log.mark()
            thief.send_multipart(captured)
            assert not thief.poll(int(NO_REPLY_WAIT * 1000)), \
                f"the replay on {channel} from another socket got a reply"
            assert log.wait_for_line("rejected message", thief_id.hex(), "replayed message"), \
                f"{channel}: no replay rejection logged:\n{log.since_mark()}"
        finally:
            thief.close(0)
    assert_still_serving(server)
    reply, outputs = run_cell(kc, "replay_runs_2")
    results = [m["content"]["data"]["text/plain"] for m in outputs
               if m["msg_type"] == "execute_result"]
    assert results == ["1"], "a replayed execute_request ran again"


def test_junk_does_not_flush_the_replay_history(server):
    """Unverified junk must not push a captured message's digest out of the history."""
    raw, kc = server["raw"], server["kc"]
    run_cell(kc, "replay_runs_3 = 0")
    msg_id, frames = raw.frames("execute_request",
                                execute_content("replay_runs_3 += 1\nreplay_runs_3"))
    captured = [bytes(f) for f in frames]
    raw.send(captured)
    assert raw.recv_until(msg_id, timeout=30), "no reply to the legitimate request"
    for _ in range(3000):
        _, junk = raw.frames("kernel_info_request", {})
        junk[1] = secrets.token_hex(32).encode()  # well-formed, unverifiable
        raw.send(junk)
    assert raw.recv(NO_REPLY_WAIT) == [], "junk got a reply"
    assert_rejected(server, list(captured), "replayed message")
    reply, outputs = run_cell(kc, "replay_runs_3")
    results = [m["content"]["data"]["text/plain"] for m in outputs
               if m["msg_type"] == "execute_result"]
    assert results == ["1"], "the replayed execute_request ran again"


def test_server_log_names_every_rejection(server):
    """The log is the audit: every rejection above was logged as a warning."""
    text = server["log"].text()
    raw = server["raw"]
    lines = [line for line in text.splitlines()
             if "rejected message" in line and raw.identity_hex in line]
    assert len(lines) >= 15, text
    assert all(" warning]" in line for line in lines), lines
    # Nothing in the session's shim.log says the sandbox suffered.
    sessions = os.path.join(STATE_DIR, "sessions")
    pid = server["km"].provisioner.process.pid
    session_dirs = {os.path.dirname(os.readlink(os.path.join(f"/proc/{pid}/fd", fd)))
                    for fd in os.listdir(f"/proc/{pid}/fd")
                    if os.readlink(os.path.join(f"/proc/{pid}/fd", fd)).startswith(sessions)}
    assert len(session_dirs) == 1, session_dirs
    with open(os.path.join(session_dirs.pop(), "log", "shim.log"), errors="replace") as f:
        shim_log = f.read()
    assert "kernel-exit" not in shim_log and "server gone" not in shim_log, shim_log
