"""Session creation under sustained load, in short (bench/soak.py is the long run).

Closed sessions cost only what they hold: they do not count against
--max-sessions and release their channels after --closed-window. Creates are
served first come, first served, a wait past --max-create-wait is ServerBusy
with the queue's length, and a create whose client has given up (its
timeout_s) is never handed a session. A closed session's figures are kept,
a server killed by SIGKILL is known dead at once, and `cellblock ls` shows
every sandbox with its pids.
"""
import os
import subprocess
import sys
import time

import pytest

from server_helpers import (sandbox_running, server_factory, session_pids,  # noqa: F401
                            session_sandboxes, wait_for)

sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", "../.."), "clients", "python"))
import cellblock  # noqa: E402


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_ids(srv):
    return {s["session_id"] for s in
            srv.ok("session_list_request", {"open_only": True})["content"]["sessions"]}


def pool_ready(srv, n):
    return wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == n,
                    timeout=120, interval=0.2)


def collect_in_arrival_order(srv, ids, timeout=180):
    """The replies to `ids` in the order they arrive: [(msg_id, content)]."""
    order = []
    deadline = time.monotonic() + timeout
    while len(order) < len(ids):
        left = deadline - time.monotonic()
        assert left > 0 and srv.socket.poll(int(left * 1000) + 1), \
            f"{len(ids) - len(order)} of {len(ids)} creates unanswered after {timeout} s"
        _, msg = srv.session.feed_identities(srv.socket.recv_multipart())
        reply = srv.session.deserialize(msg)
        parent = reply["parent_header"].get("msg_id")
        if parent in ids:
            order.append((parent, reply["content"]))
            if reply["content"]["status"] == "ok":
                srv.session_ids.add(reply["content"]["session_id"])
    return order


def test_closed_sessions_do_not_count_against_max_sessions(server_factory):
    srv = server_factory(["--max-sessions", "2", "--pool", "host=1"])
    for cycle in range(3):
        reply = srv.call("session_create_request", {}, timeout=120)["content"]
        assert reply["status"] == "ok", (f"create {cycle + 1} with {cycle} closed sessions and "
                                         f"none open", reply)
        srv.session_ids.add(reply["session_id"])
        srv.ok("session_close_request", {"session_id": reply["session_id"]})
    # The limit still holds for sessions actually open (and starting).
    held = [srv.create()["session_id"] for _ in range(2)]
    refused = srv.call("session_create_request", {})["content"]
    assert refused["status"] == "error" and refused["ename"] == "TooManySessions", refused
    assert "2 sessions open" in refused["evalue"] and "--max-sessions" in refused["evalue"], refused
    for sid in held:
        srv.ok("session_close_request", {"session_id": sid})


def test_closed_sessions_release_their_channels(server_factory):
    srv = server_factory(["--pool", "host=2", "--closed-window", "2"])
    assert pool_ready(srv, 2)
    pid = srv.proc.pid
    time.sleep(0.5)
    baseline = fd_count(pid)
    closed = []
    for _ in range(6):
        sid, kc, _ = srv.open_session()
        closed.append((sid, kc))
        srv.ok("session_close_request", {"session_id": sid})
    # Within the window a request on the session's own channel is answered...
    sid, kc = closed[-1]
    msg_id = kc.execute("1+1")
    reply = kc.get_shell_msg(timeout=10)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["ename"] == "SessionClosed", reply["content"]
    srv.close_clients()
    # ...after it the sockets are gone, and the registry still answers.
    assert pool_ready(srv, 2)
    settled = wait_for(lambda: fd_count(pid) <= baseline, timeout=30, interval=0.5)
    assert settled, f"server fds {baseline} at start, {fd_count(pid)} 30 s after 6 closes"
    info = srv.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"] == "closed_by_request", info
    again = srv.call("session_close_request", {"session_id": sid})["content"]
    assert again["ename"] == "SessionClosed" and "closed_by_request" in again["evalue"], again


def test_creates_are_served_in_the_order_they_came(server_factory):
    srv = server_factory(["--pool", "host=0", "--pool-workers", "2"])
    ids = [srv.send("session_create_request", {"metadata": {"n": n}}) for n in range(6)]
    order = collect_in_arrival_order(srv, ids)
    assert all(c["status"] == "ok" for _, c in order), order
    assert [m for m, _ in order] == ids, \
        f"replies came in the order {[ids.index(m) for m, _ in order]}"
    for _, c in order:
        srv.ok("session_close_request", {"session_id": c["session_id"]})


def test_a_create_past_the_wait_bound_is_server_busy(server_factory):
    srv = server_factory(["--pool", "host=0", "--pool-workers", "1", "--max-create-wait", "1"])
    # Enough that one worker cannot start them all within 1 s: a session
    # forked from a zygote starts in about a tenth of a second, one booted in
    # about one, and the first create also starts the zygote.
    creates = 24
    ids = [srv.send("session_create_request", {}) for _ in range(creates)]
    order = collect_in_arrival_order(srv, ids)
    busy = [c for _, c in order if c["status"] == "error"]
    assert busy, f"{creates} cold starts on one worker all within 1 s? {order}"
    for c in busy:
        assert c["ename"] == "ServerBusy", c
        assert "creates waiting" in c["evalue"] and "max_create_wait_s is 1" in c["evalue"], c
    served = {c["session_id"] for _, c in order if c["status"] == "ok"}
    # Sandboxes started for refused creates are destroyed, never left open.
    assert wait_for(lambda: open_ids(srv) == served and
                    len(session_sandboxes(srv.state_dir)) == len(served),
                    timeout=60, interval=0.5), (open_ids(srv), session_sandboxes(srv.state_dir),
                                                served)
    for sid in served:
        srv.ok("session_close_request", {"session_id": sid})


def test_an_abandoned_create_is_never_handed_out(server_factory):
    srv = server_factory(["--pool", "host=0", "--pool-workers", "1"])
    # The one worker is busy with the first create; the second's client gives up at once.
    first = srv.send("session_create_request", {})
    gone = srv.send("session_create_request", {"timeout_s": 0.3})
    order = dict(collect_in_arrival_order(srv, [first, gone]))
    assert order[first]["status"] == "ok", order[first]
    assert order[gone]["ename"] == "ServerBusy", order[gone]
    assert "client's timeout_s 0.3" in order[gone]["evalue"], order[gone]
    time.sleep(3)  # long enough for a sandbox that should not exist to be handed out
    assert open_ids(srv) == {order[first]["session_id"]}
    assert len(session_sandboxes(srv.state_dir)) == 1, session_sandboxes(srv.state_dir)
    assert "session_create abandoned" in srv.log()
    bad = srv.call("session_create_request", {"timeout_s": "soon"})["content"]
    assert bad["ename"] == "InvalidRequest", bad
    srv.ok("session_close_request", {"session_id": order[first]["session_id"]})


def test_a_closed_session_keeps_its_peak_memory_and_cpu(server_factory):
    srv = server_factory(["--pool", "host=1"])
    sid, kc, _ = srv.open_session()
    kc.execute_interactive("b = bytearray(80 << 20)\nimport time\nt = time.process_time()\n"
                           "while time.process_time() - t < 0.4: pass", timeout=60)
    srv.ok("session_close_request", {"session_id": sid})
    usage = srv.info_of(sid)["usage"]
    assert usage["memory_peak_bytes"] > 80 << 20, usage
    assert usage["cpu_ms"] >= 300, usage
    history = srv.cli("history", sid).stdout
    assert f"peak memory {usage['memory_peak_bytes'] / (1 << 20):.1f} MB" in history, history
    assert f"CPU {usage['cpu_ms']} ms" in history, history


def test_a_killed_server_is_known_dead_at_once(server_factory):
    srv = server_factory(["--pool", "host=0"])
    # A second server on the same state dir is refused before it touches anything.
    second = subprocess.run([os.environ.get("CELLBLOCK_BIN", "cellblock"), "serve", "--state-dir",
                             srv.state_dir, "--pool", "host=0"], capture_output=True, text=True,
                            timeout=60)
    assert second.returncode != 0
    assert f"another cellblock server (pid {srv.proc.pid}) runs" in second.stderr, second.stderr
    srv.kill9()
    assert os.path.exists(os.path.join(srv.state_dir, "server.json"))
    t0 = time.monotonic()
    with pytest.raises(cellblock.ServerNotFound, match="no server running"):
        cellblock.connect(state_dir=srv.state_dir, timeout=30)
    ls = srv.cli("ls", check=False, timeout=30)
    took = time.monotonic() - t0
    assert ls.returncode != 0 and "no server running" in ls.stderr, ls.stderr
    assert took < 5, f"took {took:.1f} s to find the server dead"
    srv.start()  # the next server takes over the state dir (and reaps)


def test_ls_shows_every_sandbox_with_its_pids(server_factory):
    srv = server_factory(["--pool", "host=1"])
    sid = srv.create()["session_id"]
    assert pool_ready(srv, 1)
    listing = srv.ok("session_list_request", {"open_only": True})["content"]
    entry = next(s for s in listing["sessions"] if s["session_id"] == sid)
    assert entry["pids"] == session_pids(sid) and entry["pids"], (entry, session_pids(sid))
    (warm,) = listing["warm_sandboxes"]
    assert sandbox_running(srv.state_dir, warm["container_id"])
    assert sandbox_running(srv.state_dir, f"cb-{sid}")
    out = srv.cli("ls").stdout
    line = next(l for l in out.splitlines() if l.startswith(sid))
    assert ",".join(map(str, entry["pids"])) in line, out
    assert "(pool)" in out and warm["container_id"] in out, out
    assert f"runc --root {srv.state_dir}/runtime list" in out, out
    srv.ok("session_close_request", {"session_id": sid})
