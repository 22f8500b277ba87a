"""The exact level of hibernation on runsc (docs/hibernation.md): a session
of an image with `"hibernate_level": "exact"` runs with its kernel's
channels bridged by its shim; hibernating it quiesces the shim, `runsc
checkpoint`s the whole sandbox and seals the image in the store; its next
request restores it into a new runsc sandbox, where everything is as it
was: threads still running, generators where they were, sockets with their
bytes, files open. Real server, real runsc, real jupyter_client."""
import json
import os
import shutil
import signal
import tempfile

import pytest

import server_helpers as sh

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None,
                                reason="runsc (Debian package runsc) is not installed")


def exact_image():
    with open(os.path.join(sh.SOURCE_DIR, "images", "host-gvisor", "image.json")) as f:
        definition = json.load(f)
    definition.update(name="gvisor-exact", hibernate_level="exact")
    return definition


def exact_server(*more):
    keys = tempfile.mkdtemp(prefix="cb-exact-keys-")
    srv, images = sh.start_server_with_image(
        exact_image(), ["--pool", "host=0", "--pool", "host-gvisor=0", "--pool", "gvisor-exact=0",
                        "--key-file", os.path.join(keys, "server.key"), *more])
    srv.images_dir = images
    yield srv
    try:
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    finally:
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(keys, ignore_errors=True)


@pytest.fixture
def server():
    yield from exact_server()


@pytest.fixture
def adopting_server():
    """One whose sandboxes outlive a crash (--adopt-grace): kill9() and start()."""
    yield from exact_server("--adopt-grace", "120")


def container_of(srv, sid):
    listed = srv.ok("session_list_request", {})["content"]["sessions"]
    return next(s for s in listed if s["session_id"] == sid).get("container_id")


def runsc_processes_of(container_id):
    return [pid for pid in sh.pgrep_full(container_id) if sh.cmdline(pid).startswith("runsc")]


def events(srv, sid, kind):
    return [e for e in srv.ok("session_history_request", {"session_id": sid})["content"]["events"]
            if e["kind"] == kind]


STATE = """
import itertools, os, socket, threading, time
x = 41
numbers = itertools.count(100)
next(numbers)
ticks = [0]
def tick():
    while True:
        ticks[0] += 1
        time.sleep(0.02)
ticker = threading.Thread(target=tick, daemon=True)
ticker.start()
a, b = socket.socketpair()
a.send(b'in flight')
f = open('/tmp/open.txt', 'w+')
f.write('written, not closed')
f.flush()
open('/data/output/result.txt', 'w').write('an output file')
marker = 'exact-marker-' * 1000
import numpy as np
arr = np.arange(1_000_000)
def double(v):
    return 2 * v
class Point:
    def __init__(self, x):
        self.x = x
p = Point(7)
def outer():
    kept = 5
    return lambda: kept
closure = outer()
open(os.path.expanduser('~/home.txt'), 'w').write('in home')
get_ipython().run_line_magic('store', 'x')
"""

CHECK = ("t0 = ticks[0]; time.sleep(0.3); f.seek(0); del x\n"
         "get_ipython().run_line_magic('store', '-r x')\n"
         "print(x + 1, next(numbers), ticker.is_alive() and ticks[0] > t0, b.recv(100).decode(),"
         " f.read(), open('/data/output/result.txt').read(), len(marker), int(arr.sum()),"
         " double(p.x), closure(), open(os.path.expanduser('~/home.txt')).read())")
EXPECTED = ("42 {n} True in flight written, not closed an output file 13000 499999500000 14 5"
            " in home")


def hibernate(srv, sid):
    return srv.ok("session_hibernate_request", {"session_id": sid}, timeout=180)["content"]


def test_an_exact_session_sleeps_whole_and_wakes_with_what_no_pickle_keeps(server):
    srv = server
    sid, kc, _ = srv.open_session(image="gvisor-exact")
    sh.run_ok(kc, STATE)
    first = container_of(srv, sid)
    assert first and runsc_processes_of(first), "the session runs in a runsc sandbox"
    # Its kernel binds inside the sandbox; in the ipc dir are the shim's sockets.
    reply, msgs = sh.execute(kc, "import json; print(json.load(open('/run/cellblock/kernel.json'))['ip'])")
    assert sh.stream_text(msgs).strip() == "/tmp/.cellblock-channels/k", msgs

    reply = hibernate(srv, sid)
    assert reply["state"] == "hibernated", reply
    assert reply["snapshot_bytes"] > 0, reply
    assert reply["snapshot"]["level"] == "exact", reply
    assert srv.info_of(sid)["snapshot"]["level"] == "exact"
    assert container_of(srv, sid) is None
    assert sh.wait_for(lambda: not runsc_processes_of(first), timeout=30)
    [slept] = events(srv, sid, "hibernated")
    assert "exact level" in slept["detail"], slept
    # Sealed at rest: nothing of the session in the clear (gVisor compresses
    # its image, so look at the output file's words too).
    store = os.path.join(srv.state_dir, "snapshots", sid)
    at_rest = b"".join(open(os.path.join(d, n), "rb").read()
                       for d, _, names in os.walk(store) for n in names)
    assert b"an output file" not in at_rest and b"exact-marker-" not in at_rest

    # The same client: its next cell wakes it, whole.
    reply, msgs = sh.execute(kc, CHECK, timeout=180)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).strip() == EXPECTED.format(n=101), msgs
    cb = reply["metadata"]["cellblock"]
    assert cb["resumed_ms"] > 0 and cb["lost"] == [], cb
    assert "not restored" not in sh.stream_text(msgs, "stderr")
    [woke] = events(srv, sid, "resumed")
    assert "exact level" in woke["detail"], woke
    second = container_of(srv, sid)
    assert second and second != first and runsc_processes_of(second), (first, second)
    assert sh.wait_for(lambda: not os.path.exists(store), timeout=30), "the image leaves the store"
    # The count goes on: the same kernel, not a new one that restored names.
    assert reply["content"]["execution_count"] == 3

    # Again, from the restored sandbox: its shim quiesces and is restored too.
    assert hibernate(srv, sid)["state"] == "hibernated"
    reply, msgs = sh.execute(kc, CHECK.replace("b.recv(100).decode()", "'in flight'"), timeout=180)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).strip() == EXPECTED.format(n=102), msgs
    srv.ok("session_close_request", {"session_id": sid})


def test_a_busy_exact_session_is_refused_and_keeps_running(server):
    srv = server
    sid, kc, _ = srv.open_session(image="gvisor-exact")
    running = kc.execute("import time; time.sleep(3); print('done')")
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "busy", timeout=30)
    refused = srv.call("session_hibernate_request", {"session_id": sid})["content"]
    assert refused["status"] == "error" and refused["ename"] == "HibernateFailed", refused
    reply, msgs, _ = sh.collect_execution(kc, running, timeout=60)
    assert reply["content"]["status"] == "ok" and sh.stream_text(msgs).strip() == "done"
    assert sh.run_ok(kc, "print(1 + 1)").strip() == "2"
    srv.ok("session_close_request", {"session_id": sid})


def test_an_exact_snapshot_outlives_a_restart_and_wakes_in_the_next_start(server):
    """SIGHUP: the next start takes the hibernated session over with its
    sealed image and key; the session's old client wakes it there, whole."""
    srv = server
    sid, kc, _ = srv.open_session(image="gvisor-exact")
    sh.run_ok(kc, STATE)
    assert hibernate(srv, sid)["state"] == "hibernated"
    srv.proc.send_signal(signal.SIGHUP)
    assert sh.wait_for(lambda: srv.log().count("cellblock serve: manager on") >= 2, timeout=180)
    assert srv.info_of(sid)["state"] == "hibernated"
    reply, msgs = sh.execute(kc, CHECK, timeout=180)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).strip() == EXPECTED.format(n=101), msgs
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert "taken_over" in kinds and kinds[-1] != "resume_failed", kinds
    [woke] = events(srv, sid, "resumed")
    assert "exact level" in woke["detail"], woke
    srv.ok("session_close_request", {"session_id": sid})


def test_a_changed_image_closes_the_session_with_resume_failed(server):
    srv = server
    sid, kc, _ = srv.open_session(image="gvisor-exact")
    sh.run_ok(kc, "x = 1")
    assert hibernate(srv, sid)["state"] == "hibernated"
    snapshot = os.path.join(srv.state_dir, "snapshots", sid, "snapshot")
    with open(snapshot, "r+b") as f:
        f.seek(os.path.getsize(snapshot) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    reply, _ = sh.execute(kc, "print(x)", timeout=180)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "SessionClosed", reply["content"]
    info = srv.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"].startswith("resume_failed:"), info
    assert "integrity" in info["close_reason"], info
    # Nothing of it is left: no snapshot, no sandbox begun for the wake.
    assert sh.wait_for(lambda: not os.path.exists(os.path.join(srv.state_dir, "snapshots", sid)),
                       timeout=30)
    assert sh.wait_for(lambda: not any(sh.session_sandboxes(srv.state_dir)), timeout=30), \
        sh.session_sandboxes(srv.state_dir)


def crash_and_restart(srv):
    """kill -9, and the next start on the same state dir and image folder."""
    srv.kill9()
    old = os.environ.get("CELLBLOCK_IMAGES_DIR")
    os.environ["CELLBLOCK_IMAGES_DIR"] = srv.images_dir
    try:
        srv.start()
    finally:
        if old is None:
            del os.environ["CELLBLOCK_IMAGES_DIR"]
        else:
            os.environ["CELLBLOCK_IMAGES_DIR"] = old


def test_after_a_crash_an_exact_session_is_adopted_and_still_sleeps_whole(adopting_server):
    """kill -9 while it is awake: the next start adopts its running sandbox
    (bridged, as its record says), which then still hibernates exact; kill
    -9 while it sleeps: the next start takes its sealed image back."""
    srv = adopting_server
    sid, kc, _ = srv.open_session(image="gvisor-exact")
    sh.run_ok(kc, STATE)
    crash_and_restart(srv)
    assert f"session {sid}: adopted" in srv.log(), srv.log()[-3000:]
    assert sh.run_ok(kc, "print(x + 1)", timeout=120).strip() == "42"
    assert hibernate(srv, sid)["snapshot"]["level"] == "exact"
    crash_and_restart(srv)
    assert srv.info_of(sid)["state"] == "hibernated"
    reply, msgs = sh.execute(kc, CHECK, timeout=180)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).strip() == EXPECTED.format(n=101), msgs
    [woke] = events(srv, sid, "resumed")
    assert "exact level" in woke["detail"], woke
    srv.ok("session_close_request", {"session_id": sid})
