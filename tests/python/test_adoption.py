"""Sessions that outlive a crashed server (docs/restarts.md, phase 2): a
server killed by SIGKILL leaves each session's sandbox running for
--adopt-grace, and the next start on the same state dir adopts it: the same
five ports and key, the same kernel with its variables, the counters going
on. A sandbox no server adopts ends itself at the end of its grace; one whose
record cannot be opened is reaped, never adopted. Real servers, real runc
sandboxes, jupyter_client and the Python client."""
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import zmq

import server_helpers as sh
from server_helpers import send_execute, server_factory  # noqa: F401

sys.path.insert(0, os.path.join(sh.SOURCE_DIR, "clients", "python"))
import cellblock  # noqa: E402


def shim_log(srv, sid):
    return sh.shim_log(srv, sid)


def keeper_of(srv):
    """The pid of the server the state dir's keeper watches (keeper.lock)."""
    try:
        with open(os.path.join(srv.state_dir, "keeper.lock")) as f:
            return (f.read().split() or [""])[0]
    except OSError:
        return ""


def alive(pids):
    return [p for p in pids if sh.proc_state(p) not in (None, "Z")]


def test_a_killed_servers_sessions_are_adopted_with_their_state(
        server_factory, tmp_path):  # noqa: F811
    key = tmp_path / "server.key"
    srv = server_factory(["--key-file", str(key), "--adopt-grace", "120", "--pool", "host=0"])
    # A: jupyter_client with state and a cap; B: the Python client through
    # the manager's endpoint and key (server.json).
    sid_a, kc_a, _ = srv.open_session(limits={"max_executions": 4})
    sh.run_ok(kc_a, "x = 41\nimport numpy as np\narr = np.arange(5)")
    client = cellblock.connect(state_dir=srv.state_dir)
    try:
        s = client.session()
        assert s.run("y = 7").ok
        sid_b = s.id
        pids = {sid: sh.session_pids(sid) for sid in (sid_a, sid_b)}
        assert all(pids.values()), pids

        watch = sh.ShellWatch(kc_a)
        srv.kill9()
        # The sandboxes outlive the server: their shims wait for the next one.
        assert sh.wait_for(lambda: all("waits 120000 ms" in shim_log(srv, sid)
                                       for sid in pids), timeout=30), \
            {sid: shim_log(srv, sid)[-500:] for sid in pids}
        time.sleep(1)
        for sid, ps in pids.items():
            assert alive(ps) == ps, (sid, ps, alive(ps))
        # Sent while no server runs (once A's client has seen it go):
        # answered once the next one adopts A.
        assert watch.wait_closed(timeout=60)
        during = send_execute(kc_a, "print(x + 1, arr.sum())")

        srv.start()
        log = srv.log()
        for sid in pids:
            assert f"session {sid}: adopted" in log, log[-3000:]
        # The dead server's keeper ended; the new server's watches it.
        assert sh.wait_for(lambda: keeper_of(srv) == str(srv.proc.pid), timeout=30), \
            keeper_of(srv)
        # The old keeper sees the new one come and ends (a moment later).
        def keepers():
            return [p for p in sh.pgrep_full("cellblock keep")
                    if srv.state_dir in sh.cmdline(p) and sh.proc_state(p) not in (None, "Z")]
        assert sh.wait_for(lambda: len(keepers()) == 1, timeout=30), \
            [sh.cmdline(p) for p in keepers()]
        reply, iopub, _ = sh.collect_execution(kc_a, during, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert sh.stream_text(iopub).strip() == "42 10"
        # The same kernel: its count, and the cap, go on.
        assert reply["content"]["execution_count"] == 2
        assert reply["metadata"]["cellblock"]["executions_left"] == 2, reply["metadata"]
        assert s.run("print(y * 6)").stdout == "42\n"
        for sid, ps in pids.items():
            info = srv.info_of(sid)
            assert info["state"] == "idle", info
            kinds = [e["kind"] for e in srv.ok("session_history_request",
                                               {"session_id": sid})["content"]["events"]]
            assert "adopted" in kinds, (sid, kinds)
            assert sh.session_pids(sid) == ps, (sid, ps)
            assert "adopted by a restarted server" in shim_log(srv, sid)
        # A second crash: the adopting server wrote its own records (a
        # fork's names its zygote again), so the next start adopts them too.
        srv.kill9()
        srv.start()
        log = srv.log()
        for sid in pids:
            assert log.count(f"session {sid}: adopted") == 2, log[-3000:]
            assert sh.session_pids(sid) == pids[sid], sid
        assert s.run("print(y * 6)").stdout == "42\n"
        # The cap holds across the crashes: 4 in all.
        sh.run_ok(kc_a, "x = 1")
        sh.run_ok(kc_a, "x = 2")
        capped = sh.execute(kc_a, "x = 3")[0]["content"]
        assert capped["status"] == "error" and capped["ename"] == "ExecutionLimitExceeded", capped
        s.close()
    finally:
        client.close()


def test_requests_in_flight_at_the_crash_are_answered(server_factory, tmp_path):  # noqa: F811
    """What a session had open when its server died: an execution still
    running is answered by its kernel after the adoption (its reply marked:
    what it published meanwhile reached no one); one queued behind it runs
    after; one the kernel finished while no server ran is answered by the
    reply its kernel kept (and its idle status, published to no one, is
    published again). A kernel that kept nothing (here: its keeper turned
    off by code in the session) has its request answered ServerRestarting
    naming that: never left unanswered."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    sid_a, kc_a, _ = srv.open_session()
    sid_b, kc_b, _ = srv.open_session()
    sid_c, kc_c, _ = srv.open_session()
    sh.run_ok(kc_c, "for k in get_ipython().kernel._cellblock_kept_replies.values():\n"
                    "    k.max_messages = 0")
    running = send_execute(kc_a, "import time\ntime.sleep(10)\nprint('slept')")
    queued = send_execute(kc_a, "print('second')")
    finished = send_execute(kc_b, "import time\ntime.sleep(1)\nprint('lost')\n6 * 7")
    dropped = send_execute(kc_c, "import time\ntime.sleep(1)\nprint('lost')")
    sh.wait_for(lambda: all(srv.info_of(sid)["state"] == "busy" for sid in (sid_a, sid_b, sid_c)),
                timeout=60)
    time.sleep(0.5)
    srv.kill9()
    time.sleep(3)  # B's and C's executions end while no server runs
    srv.start()
    reply, _, _ = sh.collect_execution(kc_a, running, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    # 'slept' came after the adoption: nothing of A's went to no one.
    lost = reply["metadata"]["cellblock"]["server_restarted"]["outputs_lost"]
    assert lost["messages"] == 0 and lost["at_least"], reply["metadata"]
    assert "cellblock_source" not in reply["metadata"], reply["metadata"]
    reply, iopub, _ = sh.collect_execution(kc_a, queued, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sh.stream_text(iopub).strip() == "second"
    # B: the kernel's own reply, kept while no server ran; its idle status too.
    reply, iopub, _ = sh.collect_execution(kc_b, finished, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["content"]["execution_count"] == 1, reply["content"]
    # Its 'lost' line and its result were published to no one, and counted.
    lost = reply["metadata"]["cellblock"]["server_restarted"]["outputs_lost"]
    assert lost == {"messages": 2, "bytes": len("lost\n") + len("42"), "at_least": True}, lost
    assert [m for m in iopub if m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"], iopub
    # C: nothing kept, the loss named.
    reply, _, _ = sh.collect_execution(kc_c, dropped, timeout=120)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "ServerRestarting", reply["content"]
    assert "the kernel's reply was lost" in reply["content"]["evalue"], reply["content"]
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid_c})["content"]["events"]]
    assert "reply_lost" in kinds, kinds
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid_b})["content"]["events"]]
    assert "reply_lost" not in kinds, kinds
    # All go on.
    assert sh.run_ok(kc_b, "print(_ + 1)").strip() == "43"
    assert sh.run_ok(kc_c, "print(6 * 7)").strip() == "42"


def test_a_request_sent_again_after_the_crash_is_not_run_twice(
        server_factory, tmp_path):  # noqa: F811
    """A client whose connection dropped cannot tell whether the dead server
    read its request, or died with the reply: it sends it again, under the
    same msg_id (cellblock's clients do). The next start runs it no second
    time: the kernel's own reply, which the kernel keeps and sends again when
    adopted, answers it."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    msg = kc.session.msg("execute_request", {
        "code": "n = globals().get('n', 0) + 1\nn", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    kc.shell_channel.send(msg)
    first, _, _ = sh.collect_execution(kc, msg["header"]["msg_id"])
    assert first["content"]["status"] == "ok", first["content"]
    srv.kill9()
    srv.start()
    kc.shell_channel.send(msg)
    again, _, _ = sh.collect_execution(kc, msg["header"]["msg_id"], timeout=120)
    assert again["content"]["status"] == "ok", again["content"]
    assert again["content"]["execution_count"] == first["content"]["execution_count"]
    assert "outputs_lost" in again["metadata"]["cellblock"]["server_restarted"], again["metadata"]
    assert sh.run_ok(kc, "print(n)").strip() == "1", "run once"
    assert "sent again" not in srv.log() or "not run twice" in srv.log()


def test_the_python_client_sends_again_across_a_crash_and_nothing_runs_twice(
        server_factory, tmp_path):  # noqa: F811
    """The Python client sends its open request again when its shell
    connection comes back; the adopting server, which carried it, drops the
    copy, and the kernel's reply answers the run once."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    client = cellblock.connect(state_dir=srv.state_dir)
    try:
        s = client.session()
        assert s.run("n = 0").ok
        done = {}
        t = threading.Thread(target=lambda: done.setdefault(
            "ex", s.run("import time\ntime.sleep(4)\nn += 1\nn", timeout=120)))
        t.start()
        assert sh.wait_for(lambda: srv.info_of(s.id)["state"] == "busy", timeout=60)
        time.sleep(0.5)
        srv.kill9()
        time.sleep(1)
        srv.start()
        t.join(timeout=150)
        ex = done["ex"]
        assert ex.ok, (ex.status, ex.error)
        assert ex.budget["server_restarted"], ex.budget
        assert "sent again (still open): not run twice" in srv.log(), srv.log()[-3000:]
        assert s.run("print(n)").stdout == "1\n"
        s.close()
    finally:
        client.close()


def test_a_client_that_subscribes_late_still_gets_what_ran_meanwhile(
        server_factory, tmp_path):  # noqa: F811
    """The adoption waits up to adopt_settle (2 s) for a client to subscribe
    on iopub again before it runs what waited; a client slower than that (a
    loaded host, 100 sessions adopted at once) used to get the reply and none
    of the outputs or the idle status, published to no one. Now the iopub
    keeps them for its first subscriber."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "x = 41")
    kc.iopub_channel.stop()  # this client's iopub is away across the restart
    watch = sh.ShellWatch(kc)
    srv.kill9()
    # Sent once the client's libzmq has seen the connection close: written
    # before that, it would go into the dead socket (lost once in CI).
    assert watch.wait_closed(), "the client never saw the server's connection close"
    during = send_execute(kc, "print(x + 1)")
    srv.start()
    deadline = time.monotonic() + 120
    reply = None
    while reply is None:
        assert time.monotonic() < deadline, "no reply after the restart"
        try:
            msg = kc.get_shell_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == during:
            reply = msg
    assert reply["content"]["status"] == "ok", reply["content"]
    time.sleep(3)  # well past the settle's bound: it ran with no one subscribed
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(kc._make_url("iopub"))
    try:
        got = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                for m in got):
            if sub.poll(500):
                _, m = kc.session.recv(sub, mode=zmq.NOBLOCK)
                if m and m["parent_header"].get("msg_id") == during:
                    got.append(m)
        kinds = [(m["msg_type"], m["content"].get("execution_state") or m["content"].get("text"))
                 for m in got]
        assert ("stream", "42\n") in kinds, kinds
        assert kinds[0] == ("status", "busy") and kinds[-1] == ("status", "idle"), kinds
    finally:
        sub.close(linger=0)
    # The server logs it after the sends: the client may have read them first.
    assert sh.wait_for(lambda: "delivered the" in srv.log(), timeout=10), srv.log()[-3000:]


def test_a_sandbox_no_server_adopts_ends_itself_after_its_grace(
        server_factory, tmp_path):  # noqa: F811
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "2",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "z = 1")
    pids = sh.session_pids(sid)
    srv.close_clients()
    srv.kill9()
    started = time.monotonic()
    assert sh.wait_for(lambda: not alive(pids), timeout=60, interval=0.2), alive(pids)
    lived = time.monotonic() - started
    assert "no server adopted the sandbox within its grace" in shim_log(srv, sid), \
        shim_log(srv, sid)
    # It waited its grace (less the kill's own time), not one second more than it must.
    assert lived >= 1.0, lived
    srv.start()
    info = srv.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"] == "server_restart", info
    assert f"session {sid}: not adopted" in srv.log(), srv.log()[-3000:]
    sh.assert_session_gone(srv.state_dir, sid, pids)


def test_when_no_server_comes_back_the_keeper_leaves_nothing(
        server_factory, tmp_path):  # noqa: F811
    """No server starts after the crash: the sandbox ends itself at its grace,
    and the keeper the server started (`cellblock keep`, its own session)
    reaps what the sandbox cannot: its dir, mounts, cgroups and record, and
    marks the session closed in the registry, naming why."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "2",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "z = 1")
    pids = sh.session_pids(sid)
    sh.assert_session_present(srv.state_dir, sid)
    keepers = [p for p in sh.pgrep_full("cellblock keep") if srv.state_dir in sh.cmdline(p)]
    assert len(keepers) == 1, keepers
    srv.close_clients()
    srv.kill9()
    # The grace, the keeper's margin (3 s), its polls: nothing left after.
    sh.assert_session_gone(srv.state_dir, sid, pids, timeout=60)
    assert sh.wait_for(lambda: sh.proc_state(keepers[0]) in (None, "Z"), timeout=30)
    db = sqlite3.connect(os.path.join(srv.state_dir, "cellblock.db"))
    try:
        (state, reason), = db.execute("SELECT state, close_reason FROM sessions WHERE id = ?",
                                      (sid,)).fetchall()
        details = [d for (d,) in db.execute(
            "SELECT detail FROM events WHERE session_id = ? AND kind = 'closed'", (sid,))]
        live = db.execute("SELECT count(*) FROM handover WHERE name LIKE 'live/%'").fetchone()
    finally:
        db.close()
    assert (state, reason) == ("closed", "server_restart"), (state, reason)
    assert any("no server took it back within --adopt-grace" in d for d in details), details
    assert live == (0,), live
    assert "cellblock keep: reaped the sandbox of session " + sid in srv.log(), srv.log()[-3000:]
    # A server starts on it as on any state dir.
    srv.start()
    assert srv.info_of(sid)["state"] == "closed"


def test_a_keeper_puts_nothing_into_a_state_dir_being_removed(tmp_path):
    """The keeper starts as its own process, a moment after its server; a
    server stopped at once and its state dir removed (what every test's
    teardown does) must not find a file the keeper made meanwhile. Its
    server makes keeper.lock; a keeper that finds none ends, making none."""
    import subprocess
    state = tmp_path / "state"
    state.mkdir()
    done = subprocess.run(
        [sh.CELLBLOCK_BIN, "keep", "--state-dir", str(state), "--libexec-dir", str(tmp_path),
         "--server-pid", str(os.getpid()), "--server-start", "1", "--grace-ms", "1000"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert os.listdir(state) == []


def test_a_session_hibernated_at_the_crash_is_taken_back_with_its_state(
        server_factory, tmp_path):  # noqa: F811
    """A hibernated session has no sandbox to adopt: its snapshot and its
    sealed row (the one a planned restart writes) are there from the moment
    it hibernates, so a crash takes it back as SIGHUP would, twice over, and
    its client's next request wakes it with its variables."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "kept = [1, 2, 3]")
    assert srv.ok("session_hibernate_request", {"session_id": sid},
                  timeout=120)["content"]["state"] == "hibernated"
    rows = sqlite3.connect(os.path.join(srv.state_dir, "cellblock.db")).execute(
        "SELECT name FROM handover").fetchall()
    assert (sid,) in rows, rows
    for crash in range(2):
        srv.kill9()
        srv.start()
        info = srv.info_of(sid)
        assert info["state"] == "hibernated", info
        assert srv.log().count(f"session {sid}: taken over (hibernated") == crash + 1, \
            srv.log()[-3000:]
    assert sh.run_ok(kc, "print(sum(kept))").strip() == "6"
    assert srv.info_of(sid)["state"] == "idle"
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert kinds.count("taken_over") == 2, kinds
    # Awake again: its row is the live one now, and the hibernation row is gone.
    rows = sqlite3.connect(os.path.join(srv.state_dir, "cellblock.db")).execute(
        "SELECT name FROM handover").fetchall()
    assert (sid,) not in rows and (f"live/{sid}",) in rows, rows


def test_a_hibernation_is_answered_once_its_row_is_on_the_disk_too(
        server_factory, tmp_path):  # noqa: F811
    """The snapshot is synced before the hibernation is answered; so is the
    row a crash or a restart of the host takes the session back by (the
    store syncs its WAL only at checkpoints otherwise): both, or the synced
    snapshot is worth nothing after a power cut. Seen with strace on the
    server: a sync of cellblock.db-wal before the answer."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "kept = 1")
    out = str(tmp_path / "strace.txt")
    tracer = subprocess.Popen(["strace", "-f", "-y", "-qq", "-e", "trace=fsync,fdatasync",
                               "-o", out, "-p", str(srv.proc.pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Attached once it reports a syscall of the server's: the loop's
        # heartbeat syncs nothing, so wait for strace's own attach instead.
        assert sh.wait_for(lambda: sh.proc_state(srv.proc.pid) is not None and any(
            line.startswith("TracerPid:") and line.split()[1] != "0"
            for line in open(f"/proc/{srv.proc.pid}/status")), timeout=30)
        assert srv.ok("session_hibernate_request", {"session_id": sid},
                      timeout=120)["content"]["state"] == "hibernated"
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)
    with open(out) as f:
        synced = f.read()
    assert "cellblock.db-wal>" in synced, synced[-3000:]
    assert sh.run_ok(kc, "print(kept)").strip() == "1"


def power_off(srv):
    """What a restart of the host leaves of a server: its state dir on disk,
    and no process, mount or cgroup of it. Only this server's: the kill -9
    of the server, its keeper and every process of its sandboxes (sessions,
    pool and zygotes), then its mounts and cgroups gone as a reboot drops
    them. The host-wide lease dirs under /run are other servers' too and
    stay. Returns the ids of the sandboxes it ended."""
    ids = set(sh.sessions_on_disk(srv.state_dir))
    ids |= {c[3:] for c in sh.runc_list(srv.state_dir) if c.startswith("cb-")}
    assert ids, "a server with sessions runs sandboxes"
    srv.kill9()

    def ours():
        pids = set(sh.pids_rooted_in(srv.state_dir))
        pids |= {p for p in sh.pgrep_full(srv.state_dir) if p != os.getpid()}
        for sid in ids:
            pids |= set(sh.session_pids(sid))
        return sorted(pids)

    for _ in range(100):
        pids = ours()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    assert not ours(), ours()
    for mount in sorted(sh.mounts_under(srv.state_dir), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
    assert not sh.mounts_under(srv.state_dir), sh.mounts_under(srv.state_dir)
    for sid in ids:
        for cgroup in sh.session_cgroups(sid):
            for parent, dirs, _ in sorted(os.walk(cgroup), key=lambda w: -len(w[0])):
                for d in dirs:
                    os.rmdir(os.path.join(parent, d))
            os.rmdir(cgroup)
    return ids


def test_after_a_restart_of_the_host_a_hibernated_session_wakes_with_its_state(
        server_factory, tmp_path):  # noqa: F811
    """A host restart, as far as one server sees it: nothing of it runs and
    nothing of it is mounted, only its state dir is left. A session asleep
    then wakes with its variables and files on the next start (its sealed
    row and snapshot were on disk before its hibernation was answered); one
    that was awake lost its kernel with the host, and is closed naming why;
    what the old sandboxes left in the state dir is cleaned (the fixture's
    teardown checks that nothing of any is left once the server ends)."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120"])
    asleep, kc, _ = srv.open_session()
    sh.run_ok(kc, "kept = [1, 2, 3]\nopen('/tmp/note.txt', 'w').write('before the restart')")
    awake, kc_awake, _ = srv.open_session()
    sh.run_ok(kc_awake, "lost = 1")
    assert srv.ok("session_hibernate_request", {"session_id": asleep},
                  timeout=120)["content"]["state"] == "hibernated"
    ended = power_off(srv)
    assert awake in ended, (ended, awake)
    srv.start()
    info = srv.info_of(asleep)
    assert info["state"] == "hibernated", info
    assert f"session {asleep}: taken over (hibernated" in srv.log(), srv.log()[-3000:]
    gone = srv.info_of(awake)
    assert gone["state"] == "closed" and gone["close_reason"] == "server_restart", gone
    assert f"session {awake}: not adopted" in srv.log(), srv.log()[-3000:]
    sh.assert_session_gone(srv.state_dir, awake, timeout=60)
    assert sh.run_ok(kc, "print(sum(kept), open('/tmp/note.txt').read())").strip() == \
        "6 before the restart"
    assert srv.info_of(asleep)["state"] == "idle"
    # None of the sandboxes that ran before the restart is known to runc or
    # left on disk now (the pool and the zygotes were started again).
    left = [c for c in sh.runc_list(srv.state_dir) if c[3:] in ended]
    assert left == [], left
    assert [s for s in sh.sessions_on_disk(srv.state_dir) if s in ended - {asleep}] == []
    # The server's teardown (server_factory) then finds nothing of any of them.


def test_a_record_that_does_not_open_is_reaped_not_adopted(
        server_factory, tmp_path):  # noqa: F811
    """A row sealed under another key (or altered): the sandbox is reaped and
    the session closed, naming why; nothing of it is left."""
    key = tmp_path / "server.key"
    srv = server_factory(["--key-file", str(key), "--adopt-grace", "120", "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, "secret = 1")
    pids = sh.session_pids(sid)
    srv.close_clients()
    srv.kill9()
    db = sqlite3.connect(os.path.join(srv.state_dir, "cellblock.db"))
    with db:
        (sealed,) = db.execute("SELECT sealed FROM handover WHERE name = ?",
                               (f"live/{sid}",)).fetchone()
        tampered = bytearray(sealed)
        tampered[len(tampered) // 2] ^= 0x01
        db.execute("UPDATE handover SET sealed = ? WHERE name = ?",
                   (bytes(tampered), f"live/{sid}"))
    db.close()
    srv.start()
    log = srv.log()
    assert f"session {sid}: not adopted: its record:" in log, log[-3000:]
    info = srv.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"] == "server_restart", info
    kinds = {e["kind"]: e["detail"] for e in srv.ok("session_history_request",
                                                     {"session_id": sid})["content"]["events"]}
    assert kinds.get("closed", "").startswith("not adopted: its record:"), kinds
    sh.assert_session_gone(srv.state_dir, sid, pids)


IMPOSTOR = r"""
import os, socket, threading, time
PATH = "/run/cellblock/lifeline.sock"
impostor = []
def listen():
    # A listener of the sandbox's own at the path the shim connects to while
    # it waits for a server.
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(PATH)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        impostor.append("the shim came")
        conn.close()
def connect():
    # And a caller that connects, as the shim would, to the listener a
    # server puts there (not the sandbox's: someone else owns it).
    while True:
        try:
            if os.stat(PATH).st_uid != os.getuid():
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(PATH)
                impostor.append(c)
        except OSError:
            pass
        time.sleep(0.01)
threading.Thread(target=listen, daemon=True).start()
threading.Thread(target=connect, daemon=True).start()
"""


def test_the_kernel_can_neither_catch_the_shim_nor_pose_as_it(
        server_factory, tmp_path):  # noqa: F811
    """Attack: the kernel listens at the path the waiting shim connects to, and
    connects to the next server's listener there as if it were the shim. The
    shim takes only a listener outside the sandbox's PID namespace; the
    server only the init's connection. The sandbox is adopted through both.
    (The init is stopped while the server listens, so that the kernel's
    connection surely comes first.)"""
    key = tmp_path / "server.key"
    srv = server_factory(["--key-file", str(key), "--adopt-grace", "120", "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, IMPOSTOR + "\nkept = 'yes'")
    with open(os.path.join(srv.state_dir, "sessions", sid, "init.pid")) as f:
        init = int(f.read().strip())
    srv.kill9()
    assert sh.wait_for(lambda: "a lifeline listener inside the sandbox was refused"
                       in shim_log(srv, sid), timeout=30), shim_log(srv, sid)[-1000:]
    os.kill(init, signal.SIGSTOP)
    starting = threading.Thread(target=srv.start)
    try:
        starting.start()
        assert sh.wait_for(lambda: "refused (not the init" in srv.log(), timeout=60), \
            srv.log()[-3000:]
    finally:
        os.kill(init, signal.SIGCONT)
        starting.join(timeout=120)
    log = srv.log()
    assert f"session {sid}: adopted" in log, log[-3000:]
    assert sh.run_ok(kc, "print(kept)").strip() == "yes"
    # The kernel's caller reached the server's listener, and nothing came of it.
    assert int(sh.run_ok(kc, "print(sum(1 for i in impostor if i != 'the shim came'))")) >= 1
    # The shim's lifeline is the server's: closing the session ends the sandbox.
    pids = sh.session_pids(sid)
    srv.close_clients()
    srv.ok("session_close_request", {"session_id": sid}, timeout=60)
    sh.assert_session_gone(srv.state_dir, sid, pids)


# The kernel's listener at the shim's path that never accepts, its backlog
# filled by connections of its own: a shim that waited on connect() there
# would never reach the end of its grace.
STALLING_LISTENER = r"""
import socket, threading, time
PATH = "/run/cellblock/lifeline.sock"
stall = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
stall.bind(PATH)
stall.listen(0)
fillers = []
def fill():
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(PATH)
            fillers.append(c)
        except OSError:
            c.close()
            time.sleep(0.01)
threading.Thread(target=fill, daemon=True).start()
"""


def test_a_listener_that_never_accepts_cannot_keep_the_sandbox_past_its_grace(
        server_factory, tmp_path):  # noqa: F811
    """Attack on "nothing runs unowned": the kernel binds the path the waiting
    shim connects to and never accepts. The shim's connect does not wait (it
    fails at once on a full backlog), so the sandbox still ends at its grace."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "3",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    sh.run_ok(kc, STALLING_LISTENER + "\ntime.sleep(0.5)\nassert fillers")
    pids = sh.session_pids(sid)
    srv.close_clients()
    srv.kill9()
    # The shim itself ends it (read before the keeper, 3 s later, reaps the
    # dir with its log): a shim stuck in connect() would leave it to the keeper.
    ended = []
    assert sh.wait_for(lambda: ended.append(shim_log(srv, sid)) or not alive(pids),
                       timeout=60, interval=0.1), alive(pids)
    assert any("no server adopted the sandbox within its grace" in log for log in ended), \
        ended[-1][-1000:]
    srv.start()
    assert srv.info_of(sid)["state"] == "closed"
    sh.assert_session_gone(srv.state_dir, sid, pids)



def test_an_adopted_gateway_session_has_its_way_out_again(server_factory, tmp_path):  # noqa: F811
    # The egress gateway is the server's child and ends with it: the adopting
    # server hands the session's ipc dir a listener of its own gateway.
    import http.server
    import json

    import test_egress as egress
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), egress.Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = upstream.server_address[1]
    try:
        srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                              "--pool", "host=0",
                              "--egress-allow", f"{egress.API}:{port}",
                              "--egress-resolve", f"{egress.API}=127.0.0.1",
                              "--egress-private", "127.0.0.1/32", "--egress-no-dns"])
        sid, kc, _ = srv.open_session(limits={"network": {"mode": "gateway"}})
        echo = f"http://{egress.API}:{port}/echo"
        assert egress.fetch(kc, echo)["status"] == 200
        # The gateway reports a request once it has closed it, over a pipe the
        # server reads in its loop: the kernel can hold the reply first.
        assert sh.wait_for(lambda: egress.egress_events(srv, sid), timeout=30)
        watch = sh.ShellWatch(kc)
        srv.kill9()
        assert sh.wait_for(lambda: "waits 120000 ms" in shim_log(srv, sid), timeout=30), \
            shim_log(srv, sid)[-500:]
        assert watch.wait_closed(timeout=60)
        srv.start()
        assert f"session {sid}: adopted" in srv.log(), srv.log()[-3000:]
        got = egress.fetch(kc, echo)
        assert got["status"] == 200 and json.loads(got["body"])["path"] == "/echo", got
        def verdicts():
            return [e["verdict"] for e in egress.egress_events(srv, sid)]
        assert sh.wait_for(lambda: verdicts().count("allowed") >= 2, timeout=30), verdicts()
    finally:
        upstream.shutdown()
        upstream.server_close()


# A thread that spins until state["until"] (a time), left by a cell.
SPIN_UNTIL = """
import threading, time
state = {"until": float("inf")}
def _spin():
    while time.time() < state["until"]:
        pass
threading.Thread(target=_spin, daemon=True).start()
"""


def test_an_adopted_session_starts_over_at_the_interactive_cpu_level(
        server_factory, tmp_path):  # noqa: F811
    """The next server's balancer starts over with an adopted session, and so
    does its sandbox: a session the crashed server had demoted (a thread
    left spinning) comes back with the interactive weight, quota and slice,
    not with the demotion for good (docs/restarts.md)."""
    import test_fairness as fair
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    sid, kc, _ = srv.open_session()
    fair.need_cpu_controller(sid)
    interactive = (fair.cpu_shares(sid), fair.cpu_quota(sid))
    default_slice = fair.slice_of(os.getpid())
    slices = fair.task_values(sid, fair.slice_of)
    sh.run_ok(kc, SPIN_UNTIL)
    assert sh.wait_for(lambda: fair.cpu_shares(sid) < interactive[0], timeout=60), \
        fair.cpu_shares(sid)
    demoted = (fair.cpu_shares(sid), fair.cpu_quota(sid))
    # The spinning ends 3 s from now, while no server runs: the crashed
    # server cannot have put the session back first.
    sh.run_ok(kc, "state['until'] = time.time() + 3", timeout=120)
    watch = sh.ShellWatch(kc)
    srv.kill9()
    assert sh.wait_for(lambda: "waits 120000 ms" in shim_log(srv, sid), timeout=30), \
        shim_log(srv, sid)[-500:]
    assert watch.wait_closed(timeout=60)
    time.sleep(4)
    assert (fair.cpu_shares(sid), fair.cpu_quota(sid)) == demoted, "the demotion outlives its server"
    srv.start()
    assert f"session {sid}: adopted" in srv.log(), srv.log()[-3000:]
    assert (fair.cpu_shares(sid), fair.cpu_quota(sid)) == interactive, \
        (fair.cpu_shares(sid), fair.cpu_quota(sid), demoted)
    if default_slice not in (None, 100) and slices == {100}:
        assert fair.task_values(sid, fair.slice_of) == {100}
    sh.run_ok(kc, "print(1 + 1)", timeout=60)
