"""Hibernation end to end (docs/hibernation.md): a real `cellblock serve`, real
runc sandboxes and a real jupyter_client holding the session's connection
file throughout. A hibernated session has no sandbox and no process on the
host; its next request wakes it in a new sandbox with its namespace and files
back, and what could not be carried is named."""
import json
import os
import shutil

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
    # The snapshot leaves the new sandbox's /data/input before the first
    # reply, and the store (its files deleted off the server's loop) just after.
    assert sh.run_ok(kc, "import os; print(sorted(os.listdir('/data/input')))").strip() == "[]"
    sh.wait_for(lambda: not os.listdir(os.path.join(srv.state_dir, "snapshots")), timeout=30)
    # The history has both, with their figures.
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert "hibernated" in kinds and "resumed" in kinds, kinds


def test_a_session_that_forges_its_snapshot_report_harms_only_its_own_history(
        server_factory):  # noqa: F811
    """The kernel's report is the session's code speaking: one that replaces
    it with wrong types (once, a string where a number belonged ended the
    server) is taken for what it can be, and every session goes on."""
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    other, okc, _ = srv.open_session()
    sh.run_ok(kc, "import cellblock_snapshot as cs\n"
                  "class R(dict):\n    def _repr_json_(self): return dict(self)\n"
                  "cs.report = lambda: R({'saved': 'x', 'bytes': -1, 'lost': [[1, 2], 'é' * 5000,"
                  " ['n' * 5000, 'why']], 'ms': {'write': 'z', 'namespace': 1e308, 'evil': 5}})\n"
                  "x = 41")
    assert hibernate(srv, sid)["state"] == "hibernated"
    assert sh.run_ok(kc, "print(x + 1)").strip() == "42"
    assert sh.run_ok(okc, "print(2 + 2)").strip() == "4"
    events = srv.ok("session_history_request", {"session_id": sid})["content"]["events"]
    slept = next(e["detail"] for e in events if e["kind"] == "hibernated")
    # Only what the report could truthfully say: no count, one bounded lost
    # name, the known step clamped, the unknown one dropped.
    assert "0 value(s) kept, 1 lost" in slept and "namespace 1000000000 ms" in slept, slept
    assert "evil" not in slept and "write" not in slept, slept
    assert srv.info_of(other)["state"] == "idle"


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


def test_idle_past_hibernate_after_it_sleeps_and_an_old_connection_file_wakes_it(
        server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, created = srv.open_session(limits={"hibernate_after_s": 2})
    connection_file = os.path.join(srv.state_dir, "old-connection.json")
    with open(connection_file, "w") as f:
        json.dump(created["connection"], f)
    sh.run_ok(kc, "import numpy as np\narr = np.arange(10)\ntotal = int(arr.sum())")
    kc.stop_channels()
    # Nobody asks anything: it hibernates on its own.
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "hibernated", timeout=120)
    info = srv.info_of(sid)
    assert info["snapshot"]["bytes"] > 0 and info["snapshot"]["age_s"] >= 0, info
    assert info["limits"]["hibernate_after_s"] == 2
    listed = srv.ok("session_list_request", {})["content"]["sessions"]
    entry = next(s for s in listed if s["session_id"] == sid)
    assert entry["snapshot"]["bytes"] == info["snapshot"]["bytes"], entry
    out = srv.cli("ls").stdout
    assert "hibernated" in out and "snapshot" in out, out
    # A new client from the old connection file: its first request wakes it.
    from jupyter_client import BlockingKernelClient
    again = BlockingKernelClient(connection_file=connection_file)
    again.load_connection_file()
    again.start_channels()
    try:
        reply, msgs = sh.execute(again, "print(total, arr[-1])", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert sh.stream_text(msgs).strip() == "45 9"
        assert reply["metadata"]["cellblock"]["resumed_ms"] > 0
    finally:
        again.stop_channels()
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert kinds.count("hibernated") >= 1 and "resumed" in kinds, kinds


def test_a_copied_state_dir_reveals_nothing_and_a_changed_snapshot_is_refused(
        server_factory):  # noqa: F811
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    secret = "zq-secret-" + os.urandom(6).hex()
    # Built inside from hex, so the code the audit keeps does not hold it.
    make = f"bytes.fromhex({secret.encode().hex()!r}).decode()"
    sh.run_ok(kc, f"kept = {make}\n"
                  f"open('/tmp/t.txt', 'w').write({make})\n"
                  f"open('/data/output/o.txt', 'w').write({make})\n")
    srv.ok("file_put_request", {"session_id": sid, "path": "in.txt"}, buffers=[secret.encode()])
    hibernate(srv, sid)

    def plain_copies():
        """Every file under the state dir holding the secret in the clear."""
        found = []
        for root, _dirs, files in os.walk(srv.state_dir):
            for name in files:
                path = os.path.join(root, name)
                try:
                    with open(path, "rb") as f:
                        if secret.encode() in f.read():
                            found.append(path)
                except OSError:
                    pass
        return found
    # The old sandbox's own directory goes with its disposal, just after.
    sh.wait_for(lambda: not plain_copies(), timeout=30)
    assert os.path.getsize(os.path.join(srv.state_dir, "snapshots", sid, "input", "in.txt")) > 0
    # One changed byte: the resume fails with a reason, never a wrong state.
    snapshot = os.path.join(srv.state_dir, "snapshots", sid, "snapshot")
    with open(snapshot, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    reply, _ = sh.execute(kc, "print(kept)", timeout=120)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "SessionClosed", reply["content"]
    info = srv.info_of(sid)
    assert info["state"] == "closed", info
    assert info["close_reason"].startswith("resume_failed:"), info
    assert "integrity" in info["close_reason"], info
    assert not os.path.exists(os.path.join(srv.state_dir, "snapshots", sid))


def test_a_snapshot_over_the_cap_is_storage_full_and_the_session_stays(server_factory):  # noqa: F811
    srv = server_factory(["--snapshot-max-mb", "2"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "import os\nblob = os.urandom(6 << 20)")
    reply = srv.call("session_hibernate_request", {"session_id": sid}, timeout=120)["content"]
    assert reply["status"] == "error" and reply["ename"] == "StorageFull", reply
    assert "cap of 2 MB" in reply["evalue"] and "--snapshot-max-mb" in reply["evalue"], reply
    assert srv.info_of(sid)["state"] == "idle"
    assert not os.listdir(os.path.join(srv.state_dir, "snapshots"))
    assert sh.run_ok(kc, "print(len(blob))").strip() == str(6 << 20)


def test_the_servers_default_limit_puts_idle_sessions_to_sleep(server_factory):  # noqa: F811
    srv = server_factory(["--default-limit", "hibernate_after_s=2"])
    sid, kc, _ = srv.open_session()
    assert srv.info_of(sid)["limits"]["hibernate_after_s"] == 2
    sh.run_ok(kc, "kept = 'by default'")
    assert sh.wait_for(lambda: srv.info_of(sid)["state"] == "hibernated", timeout=120), \
        srv.info_of(sid)
    assert sh.run_ok(kc, "print(kept)", timeout=120).strip() == "by default"


def test_a_bad_default_limit_stops_the_server_with_why():
    for item, words in (("hibernate_after_s=0", "hibernate_after_s"),
                        ("hibernate_after_s=99999999", "hibernate_after_s"),
                        ("no_such_limit=1", "no_such_limit")):
        run = sh.serve_once("--default-limit", item)
        assert run.returncode != 0, (item, run.stdout, run.stderr)
        assert words in run.stderr + run.stdout, (item, run.stderr)


def test_prometheus_sees_sleeping_sessions_and_their_snapshots(server_factory):  # noqa: F811
    from test_metrics import http_get, metrics_address, sample
    srv = server_factory(["--metrics", "127.0.0.1:0", "--snapshots-max-mb", "4096"])
    address = metrics_address(srv)
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "x = 1")
    image = srv.info_of(sid)["image"]
    hibernate(srv, sid)

    def scrape():
        status, _, text = http_get(f"http://{address}/metrics")
        assert status == 200
        return text
    # The gauges are refreshed every second.
    assert sh.wait_for(lambda: sample(scrape(), "cellblock_sessions", image=image,
                                      state="hibernated") == 1, timeout=10), scrape()
    text = scrape()
    assert sample(text, "cellblock_hibernations_total", image=image, outcome="hibernated") == 1
    assert sample(text, "cellblock_snapshot_bytes") > 0
    assert sample(text, "cellblock_snapshot_max_bytes") == 4096 << 20
    sh.run_ok(kc, "print(x)", timeout=120)
    assert sh.wait_for(lambda: sample(scrape(), "cellblock_snapshot_bytes") == 0, timeout=10)
    assert sample(scrape(), "cellblock_hibernations_total", image=image, outcome="resumed") == 1


def test_a_file_request_to_a_hibernated_session_is_refused_with_the_way_out(
        server_factory):  # noqa: F811
    """A hibernated session has no sandbox: a file request says so (the server
    dereferenced the missing sandbox before) and the server serves on; once
    resumed, its files move again."""
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "z = 2")
    srv.ok("file_put_request", {"session_id": sid, "path": "before.txt"}, buffers=[b"one"])
    hibernate(srv, sid)
    for msg_type, content, buffers in (
            ("file_put_request", {"path": "a.txt"}, [b"two"]),
            ("file_get_request", {"path": "a.txt"}, None),
            ("file_list_request", {}, None)):
        reply = srv.call(msg_type, {"session_id": sid, **content}, buffers=buffers)
        assert reply["content"]["status"] == "error", reply["content"]
        assert reply["content"]["ename"] == "FileError", reply["content"]
        assert "hibernated" in reply["content"]["evalue"], reply["content"]
        assert "session_resume_request" in reply["content"]["evalue"], reply["content"]
    assert srv.ok("server_info_request", {})["content"]["status"] == "ok"
    srv.ok("session_resume_request", {"session_id": sid}, timeout=180)
    srv.ok("file_put_request", {"session_id": sid, "path": "a.txt"}, buffers=[b"two"])
    assert sh.run_ok(kc, "print(open('/data/input/a.txt').read(), z)").strip() == "two 2"


def test_links_raced_at_the_snapshots_name_never_bring_a_host_file_in(server_factory,  # noqa: F811
                                                                      tmp_path):
    """The server reads the kernel's snapshot from the session's /data/output
    while it is written (docs/hibernation.md, "Storage"). A process of the
    session that swaps a link to a host file in for the kernel's file, mid
    write, makes the hibernation fail, and never gets the host file sealed,
    placed or restored: the session stays awake with its own state. (The
    link's target exists in the sandbox too, so the kernel's own save
    usually finishes and the server's checks are what refuse it; a link that
    lands between the kernel's removal of an old file and its exclusive
    create makes the kernel's save refuse it instead: FileExistsError.)"""
    secret = tmp_path / "host-secret"
    secret.write_text("host-secret-bytes")
    srv = server_factory()
    sid, kc, _ = srv.open_session()
    flip = ("import os, threading\n"
            f"target = {str(secret)!r}\n"
            "os.makedirs(os.path.dirname(target), exist_ok=True)\n"
            "open(target, 'w').write('a decoy in the sandbox')\n"
            "name = '/data/output/.cellblock-snapshot'\n"
            "def flip():\n"
            "    while True:\n"
            "        try:\n"
            "            if os.path.isfile(name) and not os.path.islink(name):\n"
            "                os.symlink(target, name + '.link')\n"
            "                os.replace(name + '.link', name)\n"
            "        except OSError:\n"
            "            pass\n"
            "threading.Thread(target=flip, daemon=True).start()\n")
    sh.run_ok(kc, "import os\nx = 41\nblob = os.urandom(40 << 20)\n" + flip)
    refusals = []
    for _ in range(6):
        reply = srv.call("session_hibernate_request", {"session_id": sid}, timeout=120)["content"]
        if reply["status"] == "ok":
            # The swap came after the server's checks: what it kept is the kernel's.
            assert sh.run_ok(kc, "print(x + 1, len(blob))", timeout=120).strip() == \
                f"42 {40 << 20}"
            sh.run_ok(kc, flip)  # its thread was not carried: raced again
            continue
        assert reply["ename"] == "HibernateFailed", reply
        assert "stays awake" in reply["evalue"], reply
        refusals.append(reply["evalue"])
        assert srv.info_of(sid)["state"] == "idle"
        assert sh.run_ok(kc, "print(x + 1, len(blob))").strip() == f"42 {40 << 20}"
        if len(refusals) >= 2:
            break
    assert refusals, "the swap never came while the server read the snapshot"
    for why in refusals:
        assert ("replaced or changed" in why or "not a regular file" in why
                or ("could not save its snapshot: FileExistsError" in why)), refusals
    assert secret.read_text() == "host-secret-bytes"
    assert sh.run_ok(kc, "print(sorted(os.listdir('/data/input')))").strip() == "[]"
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert "resume_failed" not in kinds and "closed" not in kinds, kinds


def runsc_processes_of(container_id):
    """Pids of the runsc-sandbox / runsc-gofer processes of container `container_id`."""
    return [pid for pid in sh.pgrep_full(container_id) if sh.cmdline(pid).startswith("runsc")]


@pytest.mark.skipif(shutil.which("runsc") is None,
                    reason="runsc (Debian package runsc) is not installed")
def test_a_gvisor_session_sleeps_and_wakes_in_a_new_gvisor_sandbox(server_factory):  # noqa: F811
    """The portable level on runsc (docs/hibernation.md, "Levels"): a session
    of the `host-gvisor` image hibernates with its namespace and files, its
    runsc sandbox goes, and its next request wakes it in a new runsc sandbox
    (not a runc one from the pool) with everything back and nothing lost."""
    srv = server_factory(["--pool", "host=0", "--pool", "host-gvisor=0"])
    sid, kc, _ = srv.open_session(image="host-gvisor")
    sh.run_ok(kc, "blob = bytes(range(256)) * 40000\n"
                  "def triple(x):\n    return 3 * x\n"
                  "class Box:\n    def __init__(self, v): self.v = v\n"
                  "box = Box('kept')\n"
                  f"open('/tmp/mark', 'w').write('{sid}')\n"
                  "open('/data/output/o.txt', 'w').write('out')\n")

    def container():
        listed = srv.ok("session_list_request", {})["content"]["sessions"]
        return next(s for s in listed if s["session_id"] == sid).get("container_id")

    first = container()
    assert first and runsc_processes_of(first), "the session runs in a runsc sandbox"
    assert hibernate(srv, sid)["state"] == "hibernated"
    assert container() is None
    assert sh.wait_for(lambda: not runsc_processes_of(first), timeout=30)
    reply, msgs = sh.execute(kc, "print(len(blob), blob[-1], triple(14), box.v, "
                                 "open('/tmp/mark').read(), open('/data/output/o.txt').read())",
                             timeout=180)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(msgs).split() == ["10240000", "255", "42", "kept", sid, "out"]
    assert reply["metadata"]["cellblock"]["lost"] == [], reply["metadata"]["cellblock"]
    woken = container()
    assert woken and woken != first and runsc_processes_of(woken), (first, woken)
