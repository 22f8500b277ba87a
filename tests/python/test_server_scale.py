"""`cellblock serve` under load: many sessions at once, many sessions in turn.

The host is checked directly afterwards (runc state, session dirs, mounts,
cgroups, processes) through server_helpers.
"""
import collections
import os
import queue
import threading
import time

from server_helpers import (assert_session_present, execute, mounts_under, pids_rooted_in,  # noqa: F401
                            is_zygote, kernel_client, running_sandboxes, server_factory,
                            session_pids,
                            session_residue,
                            sessions_on_disk, stream_text, wait_for)

SESSIONS = 20
CELLS = 20
# Under ASan+UBSan (scripts/test.sh sets ASAN_OPTIONS) a cycle costs several
# times more; 80 still cross the pool's refills many times over, and LSan
# checks the server's exit after them (the CI budget: docs/field-notes.md).
CYCLES = 80 if os.environ.get("ASAN_OPTIONS") else 200


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


def run_session(srv, sid, connection, results, errors):
    """One client thread: CELLS cells, every message it receives kept for the checks."""
    kc = kernel_client()
    try:
        kc.load_connection_info(connection)
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        shell, iopub, sent = [], [], []
        for i in range(CELLS):
            code = f"print('TOK-{sid}-{i}')\n'{sid}:{i}'"
            msg_id = kc.execute(code)
            sent.append(msg_id)
            deadline = time.monotonic() + 120
            while not any(m["parent_header"].get("msg_id") == msg_id for m in shell):
                assert time.monotonic() < deadline, f"{sid}: no reply to cell {i}"
                try:
                    shell.append(kc.get_shell_msg(timeout=1))
                except queue.Empty:
                    pass
            while not any(m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                          and m["content"]["execution_state"] == "idle" for m in iopub):
                assert time.monotonic() < deadline, f"{sid}: no idle for cell {i}"
                try:
                    iopub.append(kc.get_iopub_msg(timeout=1))
                except queue.Empty:
                    pass
        # Anything late (a duplicate reply, stray output) shows up here.
        for get, into in ((kc.get_shell_msg, shell), (kc.get_iopub_msg, iopub)):
            while True:
                try:
                    into.append(get(timeout=1.0))
                except queue.Empty:
                    break
        results[sid] = (sent, shell, iopub)
    except BaseException as e:  # reported by the main thread
        errors.append(f"{sid}: {type(e).__name__}: {e}")
    finally:
        kc.stop_channels()


def check_session(sid, sent, shell, iopub, all_ids):
    problems = []
    replies = collections.Counter(m["parent_header"].get("msg_id") for m in shell
                                  if m["msg_type"] == "execute_reply")
    for i, msg_id in enumerate(sent):
        if replies[msg_id] != 1:
            problems.append(f"cell {i}: {replies[msg_id]} execute_replies")
    strangers = set(replies) - set(sent)
    if strangers:
        problems.append(f"execute_replies to requests this client never sent: {strangers}")
    for m in shell:
        if m["msg_type"] == "execute_reply" and m["parent_header"].get("msg_id") in sent:
            i = sent.index(m["parent_header"]["msg_id"])
            if m["content"]["status"] != "ok" or m["content"]["execution_count"] != i + 1:
                problems.append(f"cell {i}: reply {m['content']}")
    by_parent = collections.defaultdict(list)
    for m in iopub:
        by_parent[m["parent_header"].get("msg_id")].append(m)
    for i, msg_id in enumerate(sent):
        msgs = by_parent.get(msg_id, [])
        if stream_text(msgs) != f"TOK-{sid}-{i}\n":
            problems.append(f"cell {i}: stdout {stream_text(msgs)!r}")
        results = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
        if results != [f"'{sid}:{i}'"]:
            problems.append(f"cell {i}: execute_result {results}")
        states = [m["content"]["execution_state"] for m in msgs if m["msg_type"] == "status"]
        if states != ["busy", "idle"]:
            problems.append(f"cell {i}: statuses {states}")
    everything = "".join(str(m["content"]) for m in shell + iopub)
    for other in all_ids:
        if other != sid and other in everything:
            problems.append(f"output of session {other} reached this client")
    for m in iopub:
        parent = m["parent_header"].get("msg_id")
        if parent and parent not in sent and m["msg_type"] not in ("status",):
            problems.append(f"iopub {m['msg_type']} with a foreign parent {parent}")
    return problems


def test_twenty_sessions_in_parallel(server_factory):
    srv = server_factory(["--pool", "host=4", "--pool-workers", "2"])
    assert wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 4,
                    timeout=120)
    t0 = time.monotonic()
    replies = srv.call_many([("session_create_request", {})] * SESSIONS, timeout=300)
    created_in = time.monotonic() - t0
    for r in replies:
        assert r["content"]["status"] == "ok", r["content"]
    sessions = {r["content"]["session_id"]: r["content"]["connection"] for r in replies}
    srv.session_ids |= set(sessions)
    assert len(sessions) == SESSIONS
    assert len({c["shell_port"] for c in sessions.values()}) == SESSIONS
    assert sum(r["content"]["warm"] for r in replies) >= 4

    results, errors = {}, []
    threads = [threading.Thread(target=run_session, args=(srv, sid, conn, results, errors))
               for sid, conn in sessions.items()]
    t1 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    ran_in = time.monotonic() - t1
    assert not any(t.is_alive() for t in threads), "client threads still running"
    assert not errors, errors
    problems = {sid: check_session(sid, *results[sid], sessions) for sid in sessions}
    problems = {sid: p for sid, p in problems.items() if p}
    assert not problems, problems

    # Twenty real sandboxes on the host, each with its own processes.
    pids = {}
    for sid in sessions:
        pids[sid] = assert_session_present(srv.state_dir, sid)["processes"]
    flat = [p for ps in pids.values() for p in ps]
    assert len(flat) == len(set(flat))
    listed = srv.ok("session_list_request", {"open_only": True})["content"]["sessions"]
    counts = {s["session_id"]: s["executions"] for s in listed}
    assert all(counts.get(sid) == CELLS for sid in sessions), counts

    closes = srv.call_many([("session_close_request", {"session_id": sid}) for sid in sessions])
    assert all(r["content"]["status"] == "ok" for r in closes)
    wait_for(lambda: not any(session_residue(srv.state_dir, sid, pids[sid]) for sid in sessions), timeout=30)
    left = {sid: session_residue(srv.state_dir, sid, pids[sid]) for sid in sessions}
    assert not any(left.values()), {k: v for k, v in left.items() if v}
    print(f"\n{SESSIONS} sessions created in {created_in:.1f} s; {SESSIONS}x{CELLS} cells in {ran_in:.1f} s")


def test_create_close_cycles_leave_nothing(server_factory):
    srv = server_factory(["--pool", "host=4", "--pool-workers", "2"])
    assert wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 4,
                    timeout=120)
    server_pid = srv.proc.pid
    fds_before, threads_before = fd_count(server_pid), thread_count(server_pid)
    ids = []
    warm = 0
    t0 = time.monotonic()
    for i in range(CYCLES):
        create = srv.call("session_create_request", {}, timeout=120)
        assert create["content"]["status"] == "ok", \
            (f"cycle {i}: server fds {fd_count(server_pid)}", create["content"])
        reply = create["content"]
        sid = reply["session_id"]
        srv.session_ids.add(sid)
        ids.append(sid)
        warm += reply["warm"]
        if i % 20 == 19:
            kc = srv.connect(reply["connection"])
            rep, iopub = execute(kc, "1+1", timeout=60)
            assert rep["content"]["status"] == "ok", (i, rep["content"])
            assert [m["content"]["data"]["text/plain"] for m in iopub
                    if m["msg_type"] == "execute_result"] == ["2"], (i, iopub)
            kc.stop_channels()
            srv.clients.remove(kc)
        closed = srv.call("session_close_request", {"session_id": sid})
        assert closed["content"]["status"] == "ok", (i, closed["content"], srv.log()[-3000:])
    took = time.monotonic() - t0
    assert len(set(ids)) == CYCLES

    def leftovers():
        out = {}
        for sid in ids:
            r = session_residue(srv.state_dir, sid)
            if r:
                out[sid] = r
        return out

    settle_start = time.monotonic()
    wait_for(lambda: not leftovers(), timeout=30, interval=0.5)
    settled_in = time.monotonic() - settle_start
    left = leftovers()
    assert not left, f"{len(left)} of {CYCLES} sessions left residue, e.g. {list(left.items())[:3]}"

    # What remains in the state dir is the warm pool only, and all of it is live.
    pool = sessions_on_disk(srv.state_dir)
    assert not set(pool) & set(ids)
    zygotes = [s for s in pool if is_zygote(srv.state_dir, s)]
    assert len(pool) - len(zygotes) <= 4 and len(zygotes) <= 1, pool
    assert running_sandboxes(srv.state_dir) == {f"cb-{s}" for s in pool}, \
        (running_sandboxes(srv.state_dir), pool)
    for mount in mounts_under(srv.state_dir):
        assert any(f"/sessions/{s}/" in mount + "/" for s in pool), f"stray mount {mount}"
    for pid in pids_rooted_in(srv.state_dir):
        assert any(pid in session_pids(s) for s in pool), f"stray process {pid} rooted in the state dir"

    # No thread per session is left behind. (Descriptors are only reported:
    # a closed session keeps its sockets for --closed-window (30 s) to answer
    # SessionClosed; test_soak.py checks that they go after it.)
    fds_after, threads_after = fd_count(server_pid), thread_count(server_pid)
    assert threads_after <= threads_before + 2, (threads_before, threads_after)
    info = srv.ok("server_info_request", {})["content"]
    assert info["sessions"]["open"] == 0, info["sessions"]
    print(f"\n{CYCLES} create/close cycles in {took:.1f} s ({warm} warm); residue settled in "
          f"{settled_in:.1f} s; server fds {fds_before} -> {fds_after}, threads {threads_before} -> "
          f"{threads_after}")

    # ...and the server still serves: a few more sessions, each running code.
    for n in range(5):
        reply = srv.call("session_create_request", {}, timeout=120)
        assert reply["content"]["status"] == "ok", \
            (f"session_create after {CYCLES + n} create/close cycles (server fds {fd_count(server_pid)}): "
             f"{reply['content']}")
        srv.session_ids.add(reply["content"]["session_id"])
        kc = srv.connect(reply["content"]["connection"])
        rep, iopub = execute(kc, "print(6*7)", timeout=60)
        assert rep["content"]["status"] == "ok" and stream_text(iopub) == "42\n", rep["content"]
        srv.ok("session_close_request", {"session_id": reply["content"]["session_id"]})
