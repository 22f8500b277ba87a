"""Hibernation end to end (docs/hibernation.md): a real `cellblock serve`, real
runc sandboxes and a real jupyter_client holding the session's connection
file throughout. A hibernated session has no sandbox and no process on the
host; its next request wakes it in a new sandbox with its namespace and files
back, and what could not be carried is named."""
import os

import pytest

import server_helpers as sh
from server_helpers import server_factory  # noqa: F401


def hibernate(srv, sid, timeout=120):
    return srv.ok("session_hibernate_request", {"session_id": sid}, timeout=timeout)["content"]


def test_a_session_sleeps_without_a_sandbox_and_wakes_with_its_state(server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "import math as m\nrows = [1, 2, 3]\nalias = rows\n"
                  "def double(x):\n    return 2 * x\n"
                  "class Point:\n    def __init__(self, x): self.x = x\n"
                  "p = Point(7)\n"
                  "gen = (i for i in range(3))\n"
                  "open('/tmp/note.txt', 'w').write('in tmp')\n"
                  "open('/data/output/result.csv', 'w').write('a,b\\n1,2\\n')\n")
    pids = sh.session_pids(sid)
    assert pids, "the session's sandbox runs processes before it sleeps"
    reply = hibernate(srv, sid)
    assert reply["state"] == "hibernated", reply
    assert reply["snapshot_bytes"] > 0, reply
    info = srv.info_of(sid)
    assert info["state"] == "hibernated", info
    assert info["snapshot_bytes"] == reply["snapshot_bytes"]
    # No sandbox and no process of the session is left on the host.
    sh.wait_for(lambda: not sh.alive(pids), timeout=15)
    listed = srv.ok("session_list_request", {})["content"]["sessions"]
    entry = next(s for s in listed if s["session_id"] == sid)
    assert entry["state"] == "hibernated" and "container_id" not in entry, entry
    # The same client, with the same connection file: its next cell wakes it.
    reply, msgs = sh.execute(kc, "print(double(m.sqrt(16)), alias is rows, p.x, "
                                 "open('/tmp/note.txt').read(), "
                                 "open('/data/output/result.csv').read().splitlines()[1])",
                             timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).strip() == "8.0 True 7 in tmp 1,2"
    cb = reply["metadata"]["cellblock"]
    assert cb["resumed_ms"] > 0, cb
    assert [name for name, why in cb["lost"]] == ["gen"], cb
    assert "gen" in sh.stream_text(msgs, "stderr"), msgs
    assert srv.info_of(sid)["state"] == "idle"
    # The snapshot leaves the store and the new sandbox's /data/input.
    assert not os.listdir(os.path.join(srv.state_dir, "snapshots"))
    assert sh.run_ok(kc, "import os; print(sorted(os.listdir('/data/input')))").strip() == "[]"
    # The history has both, with their figures.
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert "hibernated" in kinds and "resumed" in kinds, kinds


def test_a_busy_session_is_refused_and_keeps_running(server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    msg = kc.session.msg("execute_request", {"code": "import time; time.sleep(3); x = 5",
                                             "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False,
                                             "stop_on_error": True})
    kc.shell_channel.send(msg)
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "busy", timeout=30)
    reply = srv.call("session_hibernate_request", {"session_id": sid})["content"]
    assert reply["status"] == "error" and reply["ename"] == "HibernateFailed", reply
    assert "busy" in reply["evalue"], reply
    sh.collect_execution(kc, msg["header"]["msg_id"], timeout=60)
    assert sh.run_ok(kc, "print(x)").strip() == "5"


def test_resume_wakes_it_and_the_cli_does_both(server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "kept = 'yes'")
    out = srv.cli("hibernate", sid, timeout=180).stdout
    assert "hibernated" in out and "snapshot" in out, out
    out = srv.cli("resume", sid, timeout=180).stdout
    assert "idle" in out, out
    assert srv.info_of(sid)["state"] == "idle"
    assert sh.run_ok(kc, "print(kept)").strip() == "yes"


def test_closing_a_hibernated_session_removes_its_snapshot(server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "y = 1")
    hibernate(srv, sid)
    assert os.listdir(os.path.join(srv.state_dir, "snapshots")) == [sid]
    srv.ok("session_close_request", {"session_id": sid})
    assert not os.listdir(os.path.join(srv.state_dir, "snapshots"))
    assert srv.info_of(sid)["state"] == "closed"


def test_a_snapshot_the_disk_cannot_hold_leaves_the_session_awake(server_factory):  # noqa: F811
    srv = server_factory()
    # The kernel writes the snapshot into /data/output (output_mb): 12 MB of
    # random bytes in a variable cannot go through 4 MB.
    sid, kc, _ = srv.open_session(limits={"output_mb": 4})
    sh.run_ok(kc, "import os\nblob = os.urandom(12 << 20)")
    reply = srv.call("session_hibernate_request", {"session_id": sid}, timeout=120)["content"]
    assert reply["status"] == "error" and reply["ename"] == "HibernateFailed", reply
    assert "No space left on device" in reply["evalue"], reply
    assert srv.info_of(sid)["state"] == "idle"
    assert sh.run_ok(kc, "print(len(blob), os.listdir('/data/output'))").strip() == \
        f"{12 << 20} []"
