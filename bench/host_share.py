"""Figure 16: a long legitimate cell beside host processes (issue "One session
cannot slow another", §4).

A pandas computation calibrated to about `target` seconds alone runs beside 2
sessions spinning in their own cells and 2 processes spinning on the host
outside cellblock (plain `/usr/bin/python3` loops at the default nice, each in
a session of its own: with the scheduler's autogroups, as Debian enables them,
each login or service session weighs one process whatever it runs). Five
runnable things on the machine's cores: an equal share of the machine would
take (5 / cores) × alone on a 2-core host (2.5×); the target is ≤ 3×, which
holds only if no session gets less than a host process does.

Reported: the computation's time against the same computation alone (before
and after, the host is shared), and the cores each group used meanwhile.
"""
import os
import signal
import subprocess
import time

from figures import CPU_SPIN, MANY_STEPS, PANDAS_SETUP, PANDAS_WORK
from servers import CellblockServer, cgroup_cpu_s, host_cpu_s, wait_ready
from stats import Row, summary

HOST_SPINNERS = 2
SESSION_SPINNERS = 2


def process_cpu_s(pid):
    """CPU seconds of process `pid` (user + system) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_share(bench):
    target_s = bench.n(6, 3)
    rows, raw = [], {}
    with CellblockServer("hostshare", {"host": 1}) as srv:
        replies = [srv.create({"limits": dict(MANY_STEPS, exec_timeout_s=1800)})
                   for _ in range(1 + SESSION_SPINNERS)]
        chans = [srv.open_channels(r["connection"]) for r in replies]
        for ch in chans:
            wait_ready(ch, time.monotonic() + 300)
        comp, spinners = chans[0], chans[1:]
        comp.execute(PANDAS_SETUP, timeout=300)
        probe = comp.execute(PANDAS_WORK.format(n=3), timeout=300).round_trip / 3
        n = max(1, round(target_s / probe))
        work = PANDAS_WORK.format(n=n)
        alone = [comp.execute(work, timeout=900).round_trip]
        bench.log(f"host share: {n} groupby rounds, {alone[0]:.1f} s alone")
        for ch in spinners:
            ch.send_execute(CPU_SPIN)
        host = [subprocess.Popen(["/usr/bin/python3", "-c", "while True: pass"],
                                 start_new_session=True) for _ in range(HOST_SPINNERS)]
        try:
            time.sleep(3)   # the spinners are under way, as in the report
            ids = {"the computation": [replies[0]["session_id"]],
                   "spinning sessions": [r["session_id"] for r in replies[1:]]}
            before = {g: sum(cgroup_cpu_s(s) or 0 for s in v) for g, v in ids.items()}
            host_before = [process_cpu_s(p.pid) for p in host]
            busy_before, wall_before = host_cpu_s(), time.monotonic()
            took = comp.execute(work, timeout=1800).round_trip
            wall = time.monotonic() - wall_before
            cores = {g: (sum(cgroup_cpu_s(s) or 0 for s in v) - before[g]) / wall
                     for g, v in ids.items()}
            cores["host spinners (each)"] = sum(
                process_cpu_s(p.pid) - b for p, b in zip(host, host_before)) / wall / HOST_SPINNERS
            cores["the host, all of it"] = (host_cpu_s() - busy_before) / wall
        finally:
            for p in host:
                p.send_signal(signal.SIGKILL)
                p.wait()
        weight = srv.manager.call("server_info_request", {}, check=False).get("sandboxes_weight")
        for ch, r in zip(chans, replies):
            ch.close()
            srv.close_session(r["session_id"])
        srv.wait_sessions_gone([r["session_id"] for r in replies])
    # Alone again, in a fresh server: the spinners' sessions are gone.
    with CellblockServer("hostshare-after", {"host": 1}) as srv:
        r = srv.create({"limits": dict(MANY_STEPS, exec_timeout_s=1800)})
        ch = srv.open_channels(r["connection"])
        wait_ready(ch, time.monotonic() + 300)
        ch.execute(PANDAS_SETUP, timeout=300)
        ch.execute(PANDAS_WORK.format(n=3), timeout=300)
        alone.append(ch.execute(work, timeout=900).round_trip)
        ch.close()
        srv.close_session(r["session_id"])
    split = "; ".join(f"{g} {v:.2f}" for g, v in cores.items())
    entities = 1 + SESSION_SPINNERS + HOST_SPINNERS
    equal = entities / os.cpu_count()
    bench.log(f"host share: {took:.1f} s beside the spinners ({took / alone[0]:.2f}x); "
              f"alone again {alone[1]:.1f} s; cores: {split}; sandboxes' weight {weight}")
    raw = {"alone_s": alone, "beside_s": took, "cores": cores, "groupby_rounds": n,
           "sandboxes_weight_at_end": weight}
    bench.raw["host_share"] = raw
    base = summary([a * 1000 for a in alone])
    rows.append(Row("16", f"A long cell beside {SESSION_SPINNERS} spinning sessions and "
                          f"{HOST_SPINNERS} host processes spinning: pandas computation", "ms",
                    summary([took * 1000]), base, "the same alone, before and after",
                    ratio_on="median", target="≤ 3× alone",
                    met=took * 1000 <= 3 * base["median"],
                    note=f"an equal share of {os.cpu_count()} cores among {entities}: "
                         f"{equal:.1f}× alone",
                    detail=f"{n} groupby rounds; cores used while it ran: {split}"))
    return rows
