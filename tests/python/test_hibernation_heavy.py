"""A thousand hibernated sessions on one host (docs/hibernation.md, issue
"Durable conversations I"): each is created with state of its own (values and
a file in /tmp), put to sleep, and later woken by a client holding its
connection file; each answers with its own state and nothing of another's.
While all sleep, none has a sandbox or a process on the host and the server
holds less than 1 MB per sleeping session. Sessions go BATCH at a time (a
create, a hibernate, a wake each sent for the whole batch before any reply
is awaited). Plain pass only (label "heavy"); CELLBLOCK_HEAVY_SESSIONS sets
the count (default 1000)."""
import os
import time

import server_helpers as sh

SESSIONS = int(os.environ.get("CELLBLOCK_HEAVY_SESSIONS", "1000"))
# Sessions in flight at once: the server starts two sandboxes at a time
# (--pool-workers 2), and one by one the test spent most of its time waiting
# on its own round trips.
BATCH = int(os.environ.get("CELLBLOCK_HEAVY_BATCH", "4"))
# Every 100th session's processes are looked up before it sleeps (a scan of
# /proc per session would take longer than the test) and must be gone after.
SAMPLED = 100


def batches(items):
    for start in range(0, len(items), BATCH):
        yield items[start:start + BATCH]


def run_side_by_side(kcs, codes, timeout=120):
    """Runs codes[i] on kcs[i], all sent before any is awaited; returns each
    one's stdout (asserting each succeeded)."""
    sent = [sh.send_execute(kc, code) for kc, code in zip(kcs, codes)]
    return [sh.ok_text(*sh.collect_execution(kc, msg_id, timeout=timeout)[:2])
            for kc, msg_id in zip(kcs, sent)]


def let_go(srv, kcs):
    for kc in kcs:
        kc.stop_channels()
        srv.clients.remove(kc)


def pss_bytes(pid):
    """The proportional set size of process `pid` (/proc/<pid>/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss in /proc/{pid}/smaps_rollup")


def test_a_thousand_sessions_sleep_on_one_host_and_each_wakes_with_its_own_state():
    srv = sh.start_server(args=["--max-sessions", str(SESSIONS + 10)])
    try:
        started = time.monotonic()
        sessions, sampled_pids = [], []
        idle_pss = None
        for group in batches(list(range(SESSIONS))):
            created = [r["content"] for r in srv.call_many(
                [("session_create_request", {})] * len(group), timeout=180, drain_s=0)]
            assert all(c["status"] == "ok" for c in created), created
            sids = [c["session_id"] for c in created]
            srv.session_ids.update(sids)
            kcs = srv.connect_many([c["connection"] for c in created], ready_timeout=120)
            run_side_by_side(kcs, [f"x = {i} * 7\nname = 'session-{i}'\n"
                                   f"open('/tmp/mark', 'w').write({sid!r})\n"
                                   for i, sid in zip(group, sids)])
            if idle_pss is None:
                # The server with its pool and a few sessions awake: the
                # baseline the sleeping thousand are measured against.
                idle_pss = pss_bytes(srv.proc.pid)
            for i, sid in zip(group, sids):
                if i % SAMPLED == 0:
                    sampled_pids += sh.session_pids(sid)
            slept = srv.call_many([("session_hibernate_request", {"session_id": sid})
                                   for sid in sids], timeout=180, drain_s=0)
            for i, reply in zip(group, slept):
                assert reply["content"].get("state") == "hibernated", (i, reply["content"])
            let_go(srv, kcs)
            sessions += [(i, sid, c["connection"]) for i, sid, c in zip(group, sids, created)]
        asleep_s = time.monotonic() - started

        listed = {s["session_id"]: s for s in
                  srv.ok("session_list_request", {})["content"]["sessions"]}
        for i, sid, _ in sessions:
            entry = listed[sid]
            assert entry["state"] == "hibernated" and "container_id" not in entry, (i, entry)
        assert sampled_pids, "the sampled sessions ran processes while awake"
        assert sh.wait_for(lambda: not sh.alive(sampled_pids), timeout=60), \
            f"processes of sleeping sessions still run: {sh.alive(sampled_pids)}"
        asleep_pss = pss_bytes(srv.proc.pid)
        per_session = (asleep_pss - idle_pss) / SESSIONS
        print(f"{SESSIONS} sessions asleep after {asleep_s:.0f} s; the server's PSS "
              f"{idle_pss / 2**20:.1f} MB with one awake, {asleep_pss / 2**20:.1f} MB with "
              f"{SESSIONS} asleep: {per_session / 2**10:.0f} kB per sleeping session")
        assert per_session < 2**20, f"{per_session / 2**20:.2f} MB per sleeping session"

        started = time.monotonic()
        for group in batches(sessions):
            # Each is woken by a client holding only its old connection file.
            kcs = srv.connect_many([connection for _, _, connection in group], ready_timeout=120)
            outs = run_side_by_side(kcs, ["print(x, name, open('/tmp/mark').read())"] * len(group))
            for (i, sid, _), out in zip(group, outs):
                assert out.strip() == f"{i * 7} session-{i} {sid}", (i, sid, out)
            let_go(srv, kcs)
            closed = srv.call_many([("session_close_request", {"session_id": sid})
                                    for _, sid, _ in group], timeout=60, drain_s=0)
            assert all(r["content"]["status"] == "ok" for r in closed), closed
        print(f"all {SESSIONS} woke and answered in {time.monotonic() - started:.0f} s")
        # The batches' manager calls skipped their drains: no request got two replies.
        srv.extra_replies()
        # Closing a session deletes its snapshot (off the server's loop).
        store = os.path.join(srv.state_dir, "snapshots")
        assert sh.wait_for(lambda: not [n for n in os.listdir(store)
                                        if not n.startswith(".removed-")], timeout=60), \
            os.listdir(store)[:10]
    finally:
        problems = srv.shutdown()
        assert not problems, problems
