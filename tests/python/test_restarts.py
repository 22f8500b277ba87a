"""Planned restarts (docs/restarts.md): SIGHUP hands every session to the
server's next start, the same program exec'd in the same process, which binds
each session's ports with the same keys and holds it hibernated; the clients
keep their connection info and their state. SIGUSR2 hands over and exits: the
next `cellblock serve` on the state dir takes the sessions. Real servers,
real runc sandboxes, jupyter_client and the Python client."""
import json
import os
import queue
import shutil
import signal
import sys
import threading

import pytest

import server_helpers as sh
from server_helpers import send_execute, server_factory  # noqa: F401

sys.path.insert(0, os.path.join(sh.SOURCE_DIR, "clients", "python"))
import cellblock  # noqa: E402


def starts(srv):
    """How many times this server's process has started (its log, one line each)."""
    return srv.log().count("cellblock serve: manager on")


def events_of(srv, sid):
    return [e["kind"] for e in srv.ok("session_history_request",
                                      {"session_id": sid})["content"]["events"]]


def test_sighup_hands_every_session_over_and_their_clients_go_on(
        server_factory, tmp_path):  # noqa: F811
    key = tmp_path / "keys" / "server.key"
    srv = server_factory(["--key-file", str(key)])
    pid = srv.proc.pid
    # A: jupyter_client, awake with state; B: hibernated already; C: the
    # Python client, through the manager's endpoint and key.
    sid_a, kc_a, _ = srv.open_session(limits={"max_executions": 5})
    sh.run_ok(kc_a, "x = 41\nimport numpy as np\narr = np.arange(5)")
    sid_b, kc_b, _ = srv.open_session()
    sh.run_ok(kc_b, "word = 'kept'")
    srv.ok("session_hibernate_request", {"session_id": sid_b}, timeout=120)
    client = cellblock.connect(state_dir=srv.state_dir)
    try:
        s = client.session()
        assert s.run("y = 7").ok
        sid_c = s.id

        srv.proc.send_signal(signal.SIGHUP)
        # Sent while the server restarts: answered after, by the next start.
        during = send_execute(kc_a, "print(x + 1, arr.sum())")
        sh.wait_for(lambda: starts(srv) >= 2, timeout=180)
        assert srv.proc.poll() is None and srv.proc.pid == pid
        assert not os.stat(key).st_mode & 0o077, oct(os.stat(key).st_mode)

        reply, iopub, _ = sh.collect_execution(kc_a, during, timeout=180)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert sh.stream_text(iopub).strip() == "42 10"
        # The count and the cap go on from where they were.
        assert reply["content"]["execution_count"] == 2
        assert reply["metadata"]["cellblock"]["executions_left"] == 3, reply["metadata"]
        assert sh.run_ok(kc_b, "print(word)").strip() == "kept"
        assert s.run("print(y * 6)").stdout == "42\n"
        # A and C ran on (adopted by the next start); B, asleep, was taken over.
        for sid, taken in ((sid_a, "adopted"), (sid_b, "taken_over"), (sid_c, "adopted")):
            kinds = events_of(srv, sid)
            assert "handed_over" in kinds and taken in kinds, (sid, kinds)
            assert srv.info_of(sid)["state"] == "idle"
        # The next start serves new sessions as before.
        _, kc_d, _ = srv.open_session()
        assert sh.run_ok(kc_d, "print(6 * 7)").strip() == "42"
        s.close()
    finally:
        client.close()


def test_a_handover_that_cannot_be_opened_closes_its_sessions_with_why(
        server_factory, tmp_path):  # noqa: F811
    key = tmp_path / "server.key"
    srv = server_factory(["--key-file", str(key)])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "z = 1")
    kc.stop_channels()
    srv.clients.clear()
    srv.proc.send_signal(signal.SIGUSR2)  # hand over and exit
    assert srv.proc.wait(timeout=180) == 0, srv.log()[-3000:]
    assert "1 session(s) handed over" in srv.log()
    # Another key under the same name: the rows open to nothing.
    os.unlink(key)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    srv.start()
    info = srv.info_of(sid)
    assert info["state"] == "closed", info
    assert info["close_reason"].startswith("restore_failed: its handover row:"), info
    assert "integrity check" in info["close_reason"], info
    assert not os.path.exists(os.path.join(srv.state_dir, "snapshots", sid))


def test_a_key_file_others_can_read_is_refused_and_the_server_goes_on(
        server_factory, tmp_path):  # noqa: F811
    key = tmp_path / "server.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o644)
    srv = server_factory(["--key-file", str(key)])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "w = 3")
    srv.proc.send_signal(signal.SIGHUP)
    sh.wait_for(lambda: "cannot be handed over" in srv.log(), timeout=60)
    assert "mode 0644 lets others read it" in srv.log()
    # Nothing was handed over: the session goes on in the same server.
    assert sh.run_ok(kc, "print(w)").strip() == "3"
    assert starts(srv) == 1


@pytest.mark.parametrize("wait", ["2"])
def test_a_session_still_busy_past_the_takeover_wait_is_closed_with_why(
        server_factory, tmp_path, wait):  # noqa: F811
    # Without adoption a session must hibernate to be handed over.
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--takeover-wait", wait,
                          "--adopt-grace", "0"])
    sid, kc, _ = srv.open_session()
    running = send_execute(kc, "import time\ntime.sleep(600)")
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "busy", timeout=60)
    srv.proc.send_signal(signal.SIGHUP)
    reply, _, _ = sh.collect_execution(kc, running, timeout=120)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "ServerShuttingDown", reply["content"]
    sh.wait_for(lambda: starts(srv) >= 2, timeout=120)
    info = srv.info_of(sid)
    assert info["state"] == "closed"
    assert info["close_reason"] == f"server_restart: still busy after --takeover-wait {wait} s", \
        info


def test_a_busy_session_runs_on_across_sighup_in_the_same_kernel(
        server_factory, tmp_path):  # noqa: F811
    """With adoption on, SIGHUP leaves a session's sandbox running, busy or
    not: its execution goes on in the same kernel process through the
    restart, is answered once, and keeps what no snapshot could (a live
    generator). A request sent meanwhile waits and runs after it."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--takeover-wait", "1"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "g = (i for i in range(10))\nnext(g)")
    running = send_execute(kc, "import time\ntime.sleep(4)\ndone = 'yes'")
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "busy", timeout=60)
    srv.proc.send_signal(signal.SIGHUP)
    waiting = send_execute(kc, "print(done, next(g))")
    sh.wait_for(lambda: starts(srv) >= 2, timeout=120)
    reply, _, _ = sh.collect_execution(kc, running, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["content"]["execution_count"] == 2
    reply, iopub, _ = sh.collect_execution(kc, waiting, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(iopub).strip() == "yes 1"
    # Answered once: no second reply to either.
    with pytest.raises(queue.Empty):
        kc.get_shell_msg(timeout=1)
    kinds = events_of(srv, sid)
    assert "handed_over" in kinds and "adopted" in kinds, kinds
    assert "hibernated" not in kinds, kinds
    assert "left running for the next start to adopt" in srv.log()


def test_the_cli_asks_again_while_the_server_restarts(server_factory, tmp_path):  # noqa: F811
    """A create sent while a planned restart is under way is refused
    ServerRestarting by the process handing over; `cellblock new` (and
    `cellblock mcp`: the same C++ manager client) and the Python client ask
    again until the next start serves it, once each. Before, the CLI exited
    1, and a copy sent again as the old process's socket closed was lost
    (the client waited out its timeout)."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--takeover-wait", "8"])
    sid, kc, _ = srv.open_session()
    running = send_execute(kc, "import time\ntime.sleep(5)")
    sh.wait_for(lambda: srv.info_of(sid)["state"] == "busy", timeout=60)
    srv.proc.send_signal(signal.SIGHUP)
    # The busy session holds the handover open for its 5 s: the create
    # reaches the process that hands over.
    assert sh.wait_for(lambda: "handing 1 session(s) to the next start" in srv.log(),
                       timeout=30), srv.log()[-2000:]
    assert starts(srv) == 1
    # The Python client at the same time, in a thread.
    client = cellblock.connect(state_dir=srv.state_dir)
    made = {}
    t = threading.Thread(target=lambda: made.setdefault("s", client.session(timeout=120)))
    t.start()
    out = tmp_path / "new.json"
    try:
        result = srv.cli("new", "-o", str(out), timeout=120, check=False)
        t.join(timeout=150)
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert starts(srv) >= 2, "served by the next start"
        with open(out) as f:
            created = json.load(f)
        kc2 = srv.connect(created)
        assert sh.run_ok(kc2, "print(6 * 7)").strip() == "42"
        assert made["s"].run("print(7 * 6)").stdout == "42\n"
        # Each create ran once: the first session and these two.
        assert len(srv.ok("session_list_request", {"open_only": True})["content"]["sessions"]) == 3
    finally:
        client.close()
    reply, _, _ = sh.collect_execution(kc, running, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]


def test_an_upgrade_under_load_refuses_nothing_and_answers_every_step_once(
        tmp_path, monkeypatch):
    """The binary the server runs is replaced (a rebuilt one renamed over
    it, as `install` does), then SIGHUP: agents stepping all along see every
    step answered once, in order, and the server runs the new file."""
    build_bin = os.path.dirname(os.path.abspath(sh.CELLBLOCK_BIN))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "cellblock"
    shutil.copy2(sh.CELLBLOCK_BIN, exe)
    os.symlink(os.path.join(build_bin, "cellblock-gateway"), bindir / "cellblock-gateway")
    (tmp_path / "libexec").mkdir()
    os.symlink(os.path.join(os.path.dirname(build_bin), "libexec", "cellblock"),
               tmp_path / "libexec" / "cellblock")
    monkeypatch.setattr(sh, "CELLBLOCK_BIN", str(exe))
    srv = sh.start_server(["--key-file", str(tmp_path / "server.key")])
    client = cellblock.connect(state_dir=srv.state_dir)
    upgraded = threading.Event()
    results, errors = {}, []

    def agent(name):
        try:
            s = client.session()
            seen = results.setdefault(name, [])
            steps_after = 0
            while steps_after < 3:
                r = s.run("n = globals().get('n', 0) + 1\nprint(n)")
                assert r.ok, r.error
                seen.append(int(r.stdout))
                if upgraded.is_set():
                    steps_after += 1
            s.close()
        except Exception as e:  # reported below with the agent's name
            errors.append(f"{name}: {type(e).__name__}: {e}")

    agents = [threading.Thread(target=agent, args=(f"agent{i}",)) for i in range(3)]
    try:
        for t in agents:
            t.start()
        sh.wait_for(lambda: len(results) == 3 and all(len(v) >= 3 for v in results.values()),
                    timeout=180)
        new = bindir / "cellblock.new"
        shutil.copy2(sh.CELLBLOCK_BIN, new)
        os.rename(new, exe)
        srv.proc.send_signal(signal.SIGHUP)
        sh.wait_for(lambda: starts(srv) >= 2, timeout=180)
        upgraded.set()
        for t in agents:
            t.join(timeout=300)
        assert not errors, errors
        for name, seen in results.items():
            assert seen == list(range(1, len(seen) + 1)), (name, seen)
        # The process runs the file now at the path, not the one replaced.
        assert os.stat(f"/proc/{srv.proc.pid}/exe").st_ino == os.stat(exe).st_ino
        assert "ServerRestarting" not in srv.log()
    finally:
        upgraded.set()
        client.close()
        problems = srv.shutdown(keep_log=bool(errors))
    assert not problems, "\n".join(problems)


def test_a_session_whose_port_was_taken_meanwhile_is_closed_with_why(
        server_factory, tmp_path):  # noqa: F811
    import socket
    srv = server_factory(["--key-file", str(tmp_path / "server.key")])
    sid, kc, created = srv.open_session()
    other, kc2, created2 = srv.open_session()
    sh.run_ok(kc2, "kept = 'yes'")
    for c in (kc, kc2):
        c.stop_channels()
    srv.clients.clear()
    srv.proc.send_signal(signal.SIGUSR2)
    assert srv.proc.wait(timeout=180) == 0, srv.log()[-3000:]
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", created["connection"]["shell_port"]))
    squatter.listen()
    try:
        srv.start()
        info = srv.info_of(sid)
        assert info["state"] == "closed", info
        assert info["close_reason"].startswith("restore_failed: "), info
        assert "in use" in info["close_reason"], info
        # The other session goes on.
        again = srv.connect(created2["connection"])
        assert sh.run_ok(again, "print(kept)").strip() == "yes"
    finally:
        squatter.close()
