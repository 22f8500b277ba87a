"""Figure 13: the Swarm backend (docs/scale-out.md), on a private three-node
swarm on this host (tests/swarm/testbed.py: a drained manager and two
docker-in-docker workers), in the same run as its baselines.

- session ready: create → first `1+1` result through a swarm session taken
  from the pool (pre-placed services), against a cold swarm placement (a
  server with no pool: the engine creates the service, picks a node, starts
  the container, the kernel boots).
- step: the round trip of `1+1` through a swarm-placed session, against a
  runc session on this host. Both go through the same front; the swarm
  session's inner hop crosses the worker's published port (the manager's
  docker-proxy to the worker's network namespace, the worker's DNAT to the
  session's bridge).
- PSS per session: the processes of idle swarm sessions (a booted kernel in
  each task) against idle runc sessions of this host (forked from the
  image's zygote), after one `1+1` each. A swarm task's processes are this
  host's (the workers are docker-in-docker containers, no user namespace)
  and each session's kernel has a uid of its own (docs/scale-out.md): the
  session's processes are those running with its uid.
- PSS per session with `serve --swarm-share-boot-memory` (docs/scale-out.md,
  "Density"): the same idle sessions, their kernels booted with a fixed
  layout and their boot memory marked for KSM, measured once this host's
  ksmd has scanned everything twice (ksmd runs for this row only: its
  settings are put back after). The nodes' engine profile is cellblock's
  (`cellblock seccomp-profile`), as deploy/swarm/README.md sets it.
- egress: one small GET and a 20 MB download through the egress gateway
  from a swarm session (the kernel's egress tunnel to the front, then the
  gateway) against a runc session of this host (the forwarder hands its
  socket to the gateway), same upstream on 127.0.0.1, same run.
"""
import contextlib
import os
import subprocess
import sys
import tempfile
import time

from client import BenchError
import egress
from figures import ONE_PLUS_ONE, MANY_STEPS, ab_blocks
from servers import CellblockServer, host_pids, pss_bytes, wait_ready
import servers
from stats import Row, ms, summary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "swarm"))
import testbed  # noqa: E402


def mb(values):
    return [v / (1 << 20) for v in values]


def swarm_args(bed):
    return ["--backend", "swarm", "--swarm-docker-host", bed.describe()["docker_host"],
            "--swarm-connect-host", "127.0.0.1"]


def ready_once(srv, wait_pool):
    """create → first 1+1 result, in seconds; the session is closed after."""
    if wait_pool:
        srv.wait_pool()
    t0 = time.monotonic()
    reply = srv.create({"limits": MANY_STEPS})
    ch = srv.open_channels(reply["connection"])
    try:
        wait_ready(ch, time.monotonic() + 120)
        ex = ch.execute(ONE_PLUS_ONE)
        took = time.monotonic() - t0
        if ex.status() != "ok":
            raise BenchError(f"1+1 failed in a swarm session: {ex.reply}")
        return took
    finally:
        ch.close()
        srv.close_session(reply["session_id"])


def uid_pids(uid):
    """Host pids whose real uid is `uid` (a swarm session's task: its shim and kernel)."""
    def real_uid(status):
        line = next((l for l in status.splitlines() if l.startswith("Uid:")), "Uid: -1")
        return int(line.split()[1])
    return host_pids("status", lambda status: real_uid(status) == uid)


KSM = "/sys/kernel/mm/ksm"


def ksm_value(name):
    with open(os.path.join(KSM, name)) as f:
        return f.read().strip()


@contextlib.contextmanager
def ksm_running():
    """This host's ksmd on and quick, for one row; its settings back after
    (run=0 stops it and leaves what it merged as it is)."""
    names = ("run", "pages_to_scan", "sleep_millisecs")
    before = {name: ksm_value(name) for name in names}
    try:
        for name, value in (("pages_to_scan", "10000"), ("sleep_millisecs", "20"), ("run", "1")):
            with open(os.path.join(KSM, name), "w") as f:
                f.write(value)
        yield
    finally:
        for name in reversed(names):
            with open(os.path.join(KSM, name), "w") as f:
                f.write(before[name])


def ksm_scanned_twice(timeout=180):
    """Waits until ksmd has gone twice over all the memory marked now."""
    start = int(ksm_value("full_scans"))
    deadline = time.monotonic() + timeout
    while int(ksm_value("full_scans")) < start + 2:
        if time.monotonic() > deadline:
            raise BenchError(f"ksmd made no two full scans in {timeout} s")
        time.sleep(0.5)


def idle_pss(srv, count, swarm, settle=None):
    """PSS (bytes) of `count` idle sessions of `srv`, each after one 1+1
    (and after `settle()`, when given)."""
    opened, values = [], []
    try:
        for _ in range(count):
            srv.wait_pool()
            reply = srv.create({"limits": MANY_STEPS})
            ch = srv.open_channels(reply["connection"])
            opened.append((reply["session_id"], ch))
            wait_ready(ch, time.monotonic() + 120)
            ex = ch.execute("import os; print(os.getuid()); 1+1", keep_outputs=True)
            if ex.status() != "ok":
                raise BenchError(f"a session failed to say its uid: {ex.reply}")
            opened[-1] += (int(ex.stream_text().strip()),)
        time.sleep(1)  # the last reply's buffers settle
        if settle:
            settle()
        for sid, _, uid in opened:
            pids = uid_pids(uid) if swarm else srv.session_pids(sid)
            sizes = [v for v in (pss_bytes(p) for p in pids) if v]
            if not sizes:
                raise BenchError(f"no processes found for session {sid} (uid {uid})")
            values.append(sum(sizes))
    finally:
        for opened_session in opened:
            opened_session[1].close()
            srv.close_session(opened_session[0])
    return values


def load_host_image(bed, work):
    """`cellblock image export host`, loaded into every node of the testbed."""
    tar = os.path.join(work, "host.tar")
    out = subprocess.run([servers.CELLBLOCK, "image", "export", "host", "-o", tar],
                         check=True, capture_output=True, text=True, timeout=300)
    # The tag it prints ends with the shim's digest.
    tag = [l for l in out.stdout.splitlines() if l.strip().startswith("docker import ")]
    if not tag:
        raise BenchError(f"cellblock image export printed no tag: {out.stdout}")
    bed.load_image(tar, tag[0].split()[-1])
    os.unlink(tar)


def egress_rows(bench, bed):
    """A small GET and a 20 MB download through the gateway, from a swarm
    session and from a runc session, interleaved."""
    upstream = egress.serve()
    port = upstream.server_address[1]
    args = ["--egress-allow", f"{egress.HOST}:{port}",
            "--egress-resolve", f"{egress.HOST}=127.0.0.1",
            "--egress-private", "127.0.0.1/32", "--egress-no-dns"]
    limits = {"limits": {**MANY_STEPS, "network": {"mode": "gateway", "max_bytes": 64 << 30}}}
    base = f"http://{egress.HOST}:{port}"
    small_n, big_n, big = bench.n(100, 20), bench.n(9, 3), 20 * egress.MB
    rows = []
    try:
        with CellblockServer("swarm-egress", {"host": 1},
                             extra_args=swarm_args(bed) + args) as ssrv, \
                CellblockServer("swarm-egress-runc", {"host": 1}, extra_args=args) as rsrv:
            sreply, rreply = ssrv.create(limits), rsrv.create(limits)
            sch = ssrv.open_channels(sreply["connection"])
            rch = rsrv.open_channels(rreply["connection"])
            try:
                wait_ready(sch, time.monotonic() + 120)
                wait_ready(rch, time.monotonic() + 120)
                bench.log(f"swarm: egress, {small_n} small GETs and {big_n}× 20 MB each side")
                s_small, r_small, s_big, r_big = [], [], [], []
                batch = max(1, small_n // 10)
                for _ in range(small_n // batch):
                    s_small += egress.in_session(sch, f"{base}/small", batch, False)["times"]
                    r_small += egress.in_session(rch, f"{base}/small", batch, False)["times"]
                for _ in range(big_n):
                    for ch, out in ((sch, s_big), (rch, r_big)):
                        got = egress.in_session(ch, f"{base}/bytes/{big}", 1, False)
                        if got["size"] != big:
                            raise BenchError(f"egress: got {got['size']} of {big} bytes")
                        out.append(big / egress.MB / got["times"][0])
            finally:
                sch.close()
                rch.close()
                ssrv.close_session(sreply["session_id"])
                rsrv.close_session(rreply["session_id"])
    finally:
        upstream.shutdown()
        upstream.server_close()
    s, r = summary(ms(s_small)), summary(ms(r_small))
    rows.append(Row("13", "Swarm: one small GET through the egress gateway (new connection)",
                    "ms", s, r, "a runc session on this host, same gateway and upstream",
                    note=f"{s['median'] - r['median']:+.2f} ms at the median"))
    s, r = summary(s_big), summary(r_big)
    rows.append(Row("13", "Swarm: 20 MB download through the egress tunnel and gateway", "MB/s",
                    s, r, "a runc session on this host, same gateway and upstream",
                    higher_is_better=True, note=f"{s['median'] / r['median']:.2f}× runc"))
    bench.raw["swarm_egress"] = {"swarm_small_ms": ms(s_small), "runc_small_ms": ms(r_small),
                                 "swarm_mb_s": s_big, "runc_mb_s": r_big}
    return rows


def swarm_figure(bench):
    work = tempfile.mkdtemp(prefix="cellblock-bench-swarm-", dir="/var/tmp")
    try:
        profile = work + ".seccomp.json"
        try:
            with open(profile, "w") as f:
                subprocess.run([servers.CELLBLOCK, "seccomp-profile"], stdout=f, check=True,
                               timeout=60)
            bed = testbed.up(work, engine_profile=profile)
        finally:
            if os.path.exists(profile):
                os.unlink(profile)
    except testbed.DaemonStartFailed as e:
        raise BenchError(f"dockerd cannot start here: {e}")
    rows = []
    try:
        load_host_image(bed, work)

        reps = bench.n(15, 4)
        pooled, cold = [], []
        with CellblockServer("swarm-pool", {"host": 2}, extra_args=swarm_args(bed)) as srv:
            bench.log(f"swarm: {reps} sessions ready from the pool")
            for _ in range(reps):
                pooled.append(ready_once(srv, wait_pool=True))
        with CellblockServer("swarm-cold", {"host": 0}, extra_args=swarm_args(bed)) as srv:
            bench.log(f"swarm: {reps} cold placements")
            for _ in range(reps):
                cold.append(ready_once(srv, wait_pool=False))
        p, c = summary(ms(pooled)), summary(ms(cold))
        rows.append(Row("13", "Swarm: session ready (create → first 1+1) from the pool", "ms",
                        p, c, "a cold swarm placement (no pool)",
                        note=f"{c['median'] / p['median']:.1f}× faster at the median"))
        bench.raw["swarm_ready"] = {"pooled_ms": ms(pooled), "cold_ms": ms(cold)}

        steps = bench.n(200, 40)
        warmup = bench.n(30, 10)
        with CellblockServer("swarm-step", {"host": 1}, extra_args=swarm_args(bed)) as ssrv, \
                CellblockServer("swarm-step-runc", {"host": 1}) as rsrv:
            ssrv.wait_pool()
            rsrv.wait_pool()
            sreply = ssrv.create({"limits": MANY_STEPS})
            rreply = rsrv.create({"limits": MANY_STEPS})
            sch = ssrv.open_channels(sreply["connection"])
            rch = rsrv.open_channels(rreply["connection"])
            try:
                wait_ready(sch, time.monotonic() + 120)
                wait_ready(rch, time.monotonic() + 120)
                ssrv.wait_pool()
                rsrv.wait_pool()
                bench.log(f"swarm: step 1+1, {warmup} warm-up + {steps} reps each side")
                for _ in range(warmup):
                    sch.execute(ONE_PLUS_ONE)
                    rch.execute(ONE_PLUS_ONE)
                sx, rx, _, _ = ab_blocks(lambda: sch.execute(ONE_PLUS_ONE),
                                         lambda: rch.execute(ONE_PLUS_ONE), steps)
                s = summary(ms([e.round_trip for e in sx]))
                r = summary(ms([e.round_trip for e in rx]))
                rows.append(Row("13", "Swarm: execute round trip of 1+1", "ms", s, r,
                                "a runc session on this host, same run",
                                note=f"{s['median'] - r['median']:+.2f} ms at the median"))
                bench.raw["swarm_step"] = {"swarm_ms": ms([e.round_trip for e in sx]),
                                           "runc_ms": ms([e.round_trip for e in rx])}
            finally:
                sch.close()
                rch.close()
                ssrv.close_session(sreply["session_id"])
                rsrv.close_session(rreply["session_id"])

        count = bench.n(4, 2)
        with CellblockServer("swarm-pss", {"host": 1}, extra_args=swarm_args(bed)) as ssrv, \
                CellblockServer("swarm-pss-runc", {"host": 1}) as rsrv:
            bench.log(f"swarm: PSS of {count} idle sessions each side")
            swarm_pss = idle_pss(ssrv, count, swarm=True)
            runc_pss = idle_pss(rsrv, count, swarm=False)
        sp, rp = summary(mb(swarm_pss)), summary(mb(runc_pss))
        rows.append(Row("13", "Swarm: PSS per idle session (after 1+1; a booted kernel per task)",
                        "MB", sp, rp, "a runc session on this host (forked from the zygote)",
                        note=f"{sp['median'] / rp['median']:.1f}× at the median; "
                             f"{24 * 1024 / sp['median']:.0f} swarm sessions per 24 GiB node "
                             f"by PSS alone"))
        bench.raw["swarm_pss"] = {"swarm_bytes": swarm_pss, "runc_bytes": runc_pss}
        if os.path.exists(os.path.join(KSM, "run")):
            shared_args = swarm_args(bed) + ["--swarm-share-boot-memory"]
            with ksm_running(), \
                    CellblockServer("swarm-pss-shared", {"host": 1}, extra_args=shared_args) as dsrv:
                bench.log(f"swarm: PSS of {count} idle sessions sharing their boot memory")
                shared_pss = idle_pss(dsrv, count, swarm=True, settle=ksm_scanned_twice)
            dp = summary(mb(shared_pss))
            rows.append(Row("13", "Swarm --swarm-share-boot-memory: PSS per idle session "
                            "(after 1+1; ksmd on)", "MB", dp, rp,
                            "a runc session on this host (forked from the zygote)",
                            note=f"{dp['median'] / rp['median']:.1f}× at the median, against "
                                 f"{sp['median']:.1f} MB without; "
                                 f"{24 * 1024 / dp['median']:.0f} per 24 GiB node by PSS alone"))
            bench.raw["swarm_pss"]["shared_bytes"] = shared_pss
        else:
            bench.log("swarm: this kernel has no KSM: no row for --swarm-share-boot-memory")

        rows += egress_rows(bench, bed)
    finally:
        residue = testbed.down(work)
        if residue:
            bench.log(f"swarm: the testbed left {residue}")
    return rows
