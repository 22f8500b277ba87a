"""Figure 13b: files of real size in a Swarm session, against a runc session
of this host in the same run: the seeds' analyst's case (tests/python/
gib_workload.py). A generated CSV (1 GiB unless --file-mb says otherwise)
goes up streamed through the manager socket (what a client off the front's
host does), pandas aggregates it in the session and the totals come back
(checked against the expected aggregate), then a 1 GiB file the session
writes comes back streamed with the sha256 the session computed.

A runc session's files are its directories on this host; a Swarm session's
go from the front's copy to the kernel over its control channel (CurveZMQ),
4 MiB per request and reply (server/kernel_files.hpp), and its /data/input
and /data/output are tmpfs in the task: memory the session's limit counts.
"""
import os
import pathlib
import shutil
import sys
import tempfile
import time

from client import BenchError
from servers import CellblockServer
from stats import Row, summary
from swarm import load_host_image, swarm_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "swarm"))
import cellblock  # noqa: E402
import testbed  # noqa: E402
from gib_workload import AGGREGATE, MiB, WRITE_BIG, make_csv, sha_file  # noqa: E402


def round_trip(srv, csv, expected, size, log):
    """One session through the seeds' case; seconds per step."""
    limits = {"memory_mb": 3072, "disk_mb": size // MiB + 512, "output_mb": 1024 + 512,
              "exec_timeout_s": 1800}
    took = {}
    work = pathlib.Path(csv).parent
    with cellblock.connect(state_dir=srv.state_dir) as cb, cb.session(limits=limits) as s:
        t0 = time.monotonic()
        s.put("sales.csv", pathlib.Path(csv), local=False, sha256=sha_file(csv), timeout=600)
        took["up"] = time.monotonic() - t0
        log(f"  up {took['up']:.1f} s")
        t0 = time.monotonic()
        r = s.run(AGGREGATE, timeout=1800)
        took["aggregate"] = time.monotonic() - t0
        if not r.ok:
            raise BenchError(f"the aggregate failed: {r.error}")
        totals = work / "totals.csv"
        s.get("totals.csv", totals, local=False)
        if sha_file(totals) != r.stdout.strip():
            raise BenchError("the totals came back with another sha256 than the session's")
        got = {c: (int(n), int(v)) for c, n, v in
               (line.split(",") for line in totals.read_text().splitlines()[1:])}
        if got != expected:
            raise BenchError(f"the totals are not the CSV's: {got} != {expected}")
        log(f"  aggregate {took['aggregate']:.1f} s, totals right")
        r = s.run(WRITE_BIG, timeout=600)
        if not r.ok:
            raise BenchError(f"writing 1 GiB failed: {r.error}")
        want_sha, want_size = r.stdout.split()
        big = work / "big.bin"
        t0 = time.monotonic()
        s.get("big.bin", big, local=False, timeout=600)
        took["down"] = time.monotonic() - t0
        if big.stat().st_size != int(want_size) or sha_file(big) != want_sha:
            raise BenchError("the 1 GiB file came back with another size or sha256")
        big.unlink()
        totals.unlink()
        log(f"  down {took['down']:.1f} s")
    return took


def swarm_files_figure(bench):
    size = bench.file_mb * MiB
    reps = bench.n(2, 1)
    work = tempfile.mkdtemp(prefix="cellblock-bench-swarmfiles-", dir="/var/tmp")
    os.makedirs(os.path.join(work, "bed"))
    try:
        bed = testbed.up(os.path.join(work, "bed"))
    except testbed.DaemonStartFailed as e:
        raise BenchError(f"dockerd cannot start here: {e}")
    times = {"swarm": [], "runc": []}
    try:
        load_host_image(bed, work)
        csv = os.path.join(work, "sales.csv")
        expected = make_csv(csv, size)
        size = os.path.getsize(csv)
        with CellblockServer("swarmfiles", {"host": 1}, extra_args=swarm_args(bed)) as ssrv, \
                CellblockServer("swarmfiles-runc", {"host": 1}) as rsrv:
            for i in range(reps):
                for name, srv in (("swarm", ssrv), ("runc", rsrv)):
                    bench.log(f"swarm files: {name}, {size // MiB} MiB, rep {i + 1}/{reps}")
                    times[name].append(round_trip(srv, csv, expected, size, bench.log))
    finally:
        residue = testbed.down(os.path.join(work, "bed"))
        if residue:
            bench.log(f"swarm files: the testbed left {residue}")
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    mib = size / MiB
    for step, what in (("up", f"{mib:.0f} MiB CSV up, streamed"),
                       ("down", "1 GiB file down, streamed")):
        amount = mib if step == "up" else 1024
        s = summary([amount / t[step] for t in times["swarm"]])
        r = summary([amount / t[step] for t in times["runc"]])
        rows.append(Row("13b", f"Swarm files: {what}", "MiB/s", s, r,
                        "a runc session on this host, same run",
                        note=f"{s['median'] / r['median']:.2f}× runc's rate at the median"))
    s = summary([t["aggregate"] for t in times["swarm"]])
    r = summary([t["aggregate"] for t in times["runc"]])
    rows.append(Row("13b", f"Swarm files: pandas aggregate of the {mib:.0f} MiB CSV", "s", s, r,
                    "a runc session on this host, same run",
                    note="totals checked against the CSV's on both"))
    bench.raw["swarm_files"] = times
    return rows
