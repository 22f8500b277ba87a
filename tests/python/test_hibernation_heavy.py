"""A thousand hibernated sessions on one host (docs/hibernation.md, issue
"Durable conversations I"): each is created with state of its own (values and
a file in /tmp), put to sleep, and later woken by a client holding its
connection file; each answers with its own state and nothing of another's.
While all sleep, none has a sandbox or a process on the host and the server
holds less than 1 MB per sleeping session. About 12 minutes here (a create
~0.3 s, a hibernate ~0.03 s, a wake and its answer ~0.3 s); plain pass only
(label "heavy")."""
import os
import time

import server_helpers as sh

SESSIONS = 1000
# Every 100th session's processes are looked up before it sleeps (a scan of
# /proc per session would take longer than the test) and must be gone after.
SAMPLED = 100


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
        for i in range(SESSIONS):
            sid, kc, reply = srv.open_session()
            sh.run_ok(kc, f"x = {i} * 7\nname = 'session-{i}'\n"
                          f"open('/tmp/mark', 'w').write({sid!r})\n", timeout=120)
            if idle_pss is None:
                # The server with its pool and one session awake: the
                # baseline the sleeping thousand are measured against.
                idle_pss = pss_bytes(srv.proc.pid)
            if i % SAMPLED == 0:
                sampled_pids += sh.session_pids(sid)
            slept = srv.ok("session_hibernate_request", {"session_id": sid},
                           timeout=120)["content"]
            assert slept["state"] == "hibernated", (i, slept)
            kc.stop_channels()
            srv.clients.remove(kc)
            sessions.append((i, sid, reply["connection"]))
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
        for i, sid, connection in sessions:
            kc = srv.connect(connection, ready_timeout=120)
            out = sh.run_ok(kc, "print(x, name, open('/tmp/mark').read())", timeout=120)
            assert out.strip() == f"{i * 7} session-{i} {sid}", (i, sid, out)
            kc.stop_channels()
            srv.clients.remove(kc)
            srv.ok("session_close_request", {"session_id": sid}, timeout=60)
        print(f"all {SESSIONS} woke and answered in {time.monotonic() - started:.0f} s")
        # Closing a session deletes its snapshot (off the server's loop).
        store = os.path.join(srv.state_dir, "snapshots")
        assert sh.wait_for(lambda: not [n for n in os.listdir(store)
                                        if not n.startswith(".removed-")], timeout=60), \
            os.listdir(store)[:10]
    finally:
        problems = srv.shutdown()
        assert not problems, problems
