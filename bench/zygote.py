"""Figure 11: sessions forked from a zygote (docs/zygote.md), side by side with
booted sessions and bare ipykernels in the same run.

- ready: create → execute_reply of the first 1+1 with no pre-booted kernel
  (pool 0): forked from the image's running zygote, against a cold runc boot
  of the same image without a zygote.
- density: idle sessions that ran what every plotting cell runs (numpy,
  pandas, matplotlib with the agg backend, pyplot), PSS of each session's
  processes measured from the host (the pages shared with the zygote count
  once, divided among those who map them), against bare ipykernels with the
  same imports; sessions per 24 GiB. The forked image preloads what the
  shipped `python-datasci` definition preloads (read from
  images/python-datasci/image.json, on the host's root: the image users get,
  not a definition of the bench's own); when a built `python-datasci` is in
  the store named by CELLBLOCK_BENCH_IMAGE_STORE (default
  /var/lib/cellblock/images), its sessions are measured too.
- growth: a session's private memory (Private_Clean + Private_Dirty) before
  and after a typical analysis (a 200,000-row DataFrame grouped, described and
  plotted), i.e. what a session stops sharing as it works.
- at once: many sessions open together, each answering 1+1; the server's and
  the zygote's memory, the host's available memory, and whether anything was
  swapped out or OOM-killed meanwhile (/proc/vmstat).
"""
import json
import os
import shutil
import time

from client import BenchError
from servers import (HOST_IMAGE, BareKernels, CellblockServer, mem_available, process_cpu_ns,
                     proc_status, pss_bytes, sessions_and_bare_kernels, wait_ready)
from stats import Row, summary

GIB = 1 << 30
MB = 1 << 20
IMAGES_DIR = "/run/cellblock-bench-zygote-images"
FORKED, BOOTED = "bench-zygote", "bench-booted"
DATASCI = "python-datasci"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
with open(os.path.join(SOURCE, "images", DATASCI, "image.json")) as _f:
    SHIPPED = json.load(_f)
PRELOAD = SHIPPED["preload"]
IMPORTS = ("import numpy, pandas, matplotlib\nmatplotlib.use('agg')\n"
           "import matplotlib.pyplot as plt\nimport gc; gc.collect()")
IMAGE_STORE = os.environ.get("CELLBLOCK_BENCH_IMAGE_STORE", "/var/lib/cellblock/images")
ANALYSIS = """
import numpy as np, pandas as pd, matplotlib.pyplot as plt
rng = np.random.default_rng(1)
df = pd.DataFrame({'region': rng.choice(list('NESW'), 200_000),
                   'units': rng.integers(1, 50, 200_000),
                   'price': rng.normal(20, 5, 200_000)})
df['revenue'] = df.units * df.price
summary = df.groupby('region').agg(units=('units', 'sum'), revenue=('revenue', 'sum'))
print(summary.round(1).to_string())
print(df.describe().round(2).to_string())
fig, ax = plt.subplots()
summary.revenue.plot.bar(ax=ax)
plt.show()
"""


def write_images():
    shutil.rmtree(IMAGES_DIR, ignore_errors=True)
    with open(HOST_IMAGE) as f:
        spec = json.load(f)
    for name, zygote in ((FORKED, True), (BOOTED, False)):
        os.makedirs(os.path.join(IMAGES_DIR, name))
        with open(os.path.join(IMAGES_DIR, name, "image.json"), "w") as f:
            json.dump(dict(spec, name=name, zygote=zygote, preload=PRELOAD,
                           env=dict(spec.get("env", {}), **SHIPPED.get("env", {}))), f, indent=1)


def smaps(pid):
    """{Pss, Private_Clean, Private_Dirty, Rss} in bytes from /proc/<pid>/smaps_rollup."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[0].rstrip(":") in (
                        "Pss", "Private_Clean", "Private_Dirty", "Rss"):
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def session_memory(srv, sid):
    """(PSS, private bytes, processes) summed over a session's processes."""
    pss = private = 0
    pids = srv.session_pids(sid)
    for pid in pids:
        m = smaps(pid)
        pss += m.get("Pss", 0)
        private += m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
    return pss, private, len(pids)


def vmstat():
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            if name in ("pswpout", "oom_kill"):
                out[name] = int(value)
    return out


def zygote_of(srv):
    reply = srv.manager.call("session_list_request", {"open_only": True})
    zygotes = reply.get("zygotes", [])
    if not zygotes:
        raise BenchError("the server lists no zygote")
    return zygotes[0]


def kernel_counters(srv, sid):
    """(minor page faults, CPU ms of all its threads) of a session's kernel
    process so far: its largest sandbox process by CPU that is not the shim;
    None if not found."""
    best = None
    for pid in srv.session_pids(sid):
        try:
            if os.readlink(f"/proc/{pid}/exe").endswith("cellblock-shim"):
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu_ns = process_cpu_ns(pid)
        if cpu_ns is not None and (best is None or cpu_ns / 1e6 > best[1]):
            best = (int(fields[7]), cpu_ns / 1e6)
    return best


def first_result(srv, content, counters=None):
    """session_create_request → execute_reply of the first 1+1 (ms), session
    closed after. With a list as `counters`, the kernel's page faults and CPU
    time at that reply (kernel_counters) are appended to it."""
    t0 = time.perf_counter()
    reply = srv.create(content)
    ch = srv.open_channels(reply["connection"])
    try:
        ex = ch.execute_until_reply("1+1", user_expressions={"r": "1+1"})
    finally:
        ch.close()
    value = ex.reply["content"].get("user_expressions", {}).get("r", {}).get("data", {})
    if value.get("text/plain") != "2":
        raise BenchError(f"first 1+1: {ex.reply['content']}")
    if counters is not None:
        seen = kernel_counters(srv, reply["session_id"])
        if seen:
            counters.append(seen)
    srv.close_session(reply["session_id"])
    return reply["session_id"], (ex.reply_at - t0) * 1000


def ready(bench, srv):
    forked_reps, booted_reps = bench.n(30, 5), bench.n(6, 2)
    forked, booted, closed = [], [], []
    forked_counters, booted_counters = [], []
    first_result(srv, {"image": FORKED})  # the zygote starts here (and first-use costs)
    first_result(srv, {"image": BOOTED})
    every = max(1, forked_reps // booted_reps)
    for i in range(forked_reps):
        srv.wait_sessions_gone(closed)
        closed.clear()
        sid, t = first_result(srv, {"image": FORKED}, forked_counters)
        forked.append(t)
        closed.append(sid)
        if i % every == 0 and len(booted) < booted_reps:
            srv.wait_sessions_gone(closed)
            closed.clear()
            sid, t = first_result(srv, {"image": BOOTED}, booted_counters)
            booted.append(t)
            closed.append(sid)
    srv.wait_sessions_gone(closed)
    bench.raw["zygote_ready"] = {"forked_ms": forked, "booted_ms": booted,
                                 "forked_kernel_faults_cpu_ms": forked_counters,
                                 "booted_kernel_faults_cpu_ms": booted_counters}
    f, b = summary(forked), summary(booted)
    rows = [Row("11", "Zygote: create → first 1+1 reply with no pre-booted kernel (pool 0)", "ms",
                f, b, "cold runc boot of the same image, pool 0",
                target="median ≤ 25 ms", met=f["median"] <= 25,
                note=f"booted ÷ forked = {b['median'] / f['median']:.0f}×")]
    if forked_counters and booted_counters:
        cpu_f = summary([c for _, c in forked_counters])["median"]
        cpu_b = summary([c for _, c in booted_counters])["median"]
        rows.append(Row(
            "11", "Zygote: the kernel process's minor page faults from its start (fork or exec) "
            "to its first 1+1 reply — breakdown, no target", "faults",
            summary([n for n, _ in forked_counters]), summary([n for n, _ in booted_counters]),
            "the booted kernel's, same run",
            note=f"its CPU time meanwhile: {cpu_f:.1f} ms forked, {cpu_b:.0f} ms booted "
                 f"(docs/performance.md: a fork pays in copy-on-write faults)"))
    return rows


def density(bench, srv, image=FORKED, what=None):
    what = what or f"host root, {DATASCI}'s preload"
    k = bench.n(50, 8)
    bare = BareKernels(bench.zmq)
    try:
        rss0 = proc_status(srv.pid, "VmRSS")
        bench.log(f"zygote density ({what}): {k} forked sessions and {k} bare kernels, a "
              "plotting cell's imports in each")
        replies, chans, _ = sessions_and_bare_kernels(srv, bare, k, IMPORTS, {"image": image})
        time.sleep(2)
        rss = proc_status(srv.pid, "VmRSS")
        forked = [session_memory(srv, r["session_id"]) for r in replies]
        bare_pss = [pss_bytes(pid) or 0 for pid in bare.pids()]
        zygote = zygote_of(srv)
        zygote_pss = pss_bytes(zygote["interpreter_pid"]) or 0
        # Growth: three sessions run a typical analysis; private memory before and after.
        growth = []
        for r, ch in list(zip(replies, chans))[:3]:
            before = session_memory(srv, r["session_id"])
            ex = ch.execute(ANALYSIS, timeout=300)
            if ex.status() != "ok":
                raise BenchError(f"analysis failed: {ex.reply['content']}")
            time.sleep(0.5)
            growth.append((before, session_memory(srv, r["session_id"])))
        for ch in chans:
            ch.close()
        for r in replies:
            srv.close_session(r["session_id"])
        srv.wait_sessions_gone([r["session_id"] for r in replies])
    finally:
        bare.stop()
    server_share = max(rss - rss0, 0) / k
    pss = [p for p, _, _ in forked]
    private = [v for _, v, _ in forked]
    per_24 = [24 * GIB / (p + server_share) for p in pss]
    bare_24 = [24 * GIB / p for p in bare_pss if p]
    bench.raw[f"zygote_density_{image}"] = {
        "sessions": k, "forked": forked, "bare_pss_bytes": bare_pss, "server_rss0": rss0,
        "server_rss": rss, "zygote_pss_bytes": zygote_pss, "growth": growth}
    to_mb = lambda xs: [x / MB for x in xs]  # noqa: E731
    s24, b24 = summary(per_24), summary(bare_24)
    g_before = [b[1] for b, _ in growth]
    g_after = [a[1] for _, a in growth]
    return [
        Row("11", f"Zygote ({what}): PSS of an idle forked session ({k} sessions, numpy, "
                  "pandas, matplotlib (agg) and pyplot imported)", "MB", summary(to_mb(pss)),
            summary(to_mb(bare_pss)),
            "bare ipykernel, same imports",
            note=f"private (USS) median {summary(to_mb(private))['median']:.1f} MB; the "
                 f"zygote's own PSS {zygote_pss / MB:.1f} MB; processes per session "
                 f"{max(n for _, _, n in forked)}"),
        Row("11", f"Zygote ({what}): sessions that 24 GiB holds (24 GiB / (session PSS + "
                  "server share))",
            "sessions", s24, b24, "bare ipykernels by PSS", higher_is_better=True,
            target="≥ 1000 and ≥ 4× bare",
            met=s24["median"] >= 1000 and s24["median"] >= 4 * b24["median"],
            note=f"forked ÷ bare = {s24['median'] / b24['median']:.1f}×; server "
                 f"{server_share / MB:.2f} MB per session"),
        Row("11", f"Zygote ({what}): a session's private memory before → after a typical analysis "
                  "(200k-row DataFrame, groupby, describe, a plot)", "MB",
            summary(to_mb(g_after)), summary(to_mb(g_before)), "the same sessions before it",
            note="baseline column: before; cellblock column: after"),
    ]


def at_once(bench, srv):
    n = bench.n(500, 40)
    avail0, vm0 = mem_available(), vmstat()
    rss0 = proc_status(srv.pid, "VmRSS")
    bench.log(f"zygote at once: opening {n} sessions")
    replies = []
    t0 = time.perf_counter()
    for start in range(0, n, 50):
        got, _ = srv.create_many(min(50, n - start), {"image": FORKED})
        replies += got
    opened = time.perf_counter() - t0
    answered = 0
    for r in replies:
        ch = srv.open_channels(r["connection"])
        try:
            wait_ready(ch, time.monotonic() + 120)
            ex = ch.execute_until_reply("1+1", user_expressions={"r": "1+1"})
            value = ex.reply["content"].get("user_expressions", {}).get("r", {})
            answered += value.get("data", {}).get("text/plain") == "2"
        finally:
            ch.close()
    avail1, vm1 = mem_available(), vmstat()
    rss1 = proc_status(srv.pid, "VmRSS")
    zygote = zygote_of(srv)
    zygote_rss = proc_status(zygote["interpreter_pid"], "VmRSS") or 0
    for r in replies:
        srv.close_session(r["session_id"])
    srv.wait_sessions_gone([r["session_id"] for r in replies], timeout=600)
    swapped = vm1.get("pswpout", 0) - vm0.get("pswpout", 0)
    killed = vm1.get("oom_kill", 0) - vm0.get("oom_kill", 0)
    used = max(avail0 - avail1, 0)
    bench.raw["zygote_at_once"] = {
        "sessions": n, "answered": answered, "open_seconds": opened,
        "mem_available_before": avail0, "mem_available_after": avail1, "server_rss_before": rss0,
        "server_rss_after": rss1, "zygote_rss": zygote_rss, "pswpout": swapped,
        "oom_kills": killed}
    return [Row("11", f"Zygote: {n} sessions open at once, each answering 1+1", "MB per session",
                summary([used / n / MB]), target=f"all {n} answer, nothing swapped or killed",
                met=answered == n and swapped == 0 and killed == 0,
                note=f"{answered}/{n} answered; opened in {opened:.1f} s; host MemAvailable "
                     f"{avail0 / GIB:.2f} → {avail1 / GIB:.2f} GiB; server VmRSS "
                     f"{rss0 / MB:.0f} → {rss1 / MB:.0f} MB; zygote VmRSS {zygote_rss / MB:.0f} "
                     f"MB; pages swapped out {swapped}, OOM kills {killed}")]


def zygote_figure(bench):
    write_images()
    try:
        with CellblockServer("zygote", {"host": 0, FORKED: 0, BOOTED: 0},
                             extra_args=["--max-sessions", "600"], images_dir=IMAGES_DIR) as srv:
            rows = ready(bench, srv)
            rows += density(bench, srv)
            rows += at_once(bench, srv)
    finally:
        shutil.rmtree(IMAGES_DIR, ignore_errors=True)
    return rows + built_datasci_density(bench)


def built_datasci_density(bench):
    """Figure 11's density on the shipped python-datasci itself, when it is built."""
    if not os.path.lexists(os.path.join(IMAGE_STORE, "names", DATASCI)):
        bench.log(f"zygote density: {DATASCI} is not built in {IMAGE_STORE} "
                  f"(cellblock image build {DATASCI}); its rows are left out")
        return [Row("11", f"Zygote ({DATASCI}, built): density", "", summary([]),
                    note=f"not measured: {DATASCI} is not built in {IMAGE_STORE} (cellblock "
                         f"image build {DATASCI} --state-dir {os.path.dirname(IMAGE_STORE)})")]
    with CellblockServer("zygote-datasci", {"host": 0, DATASCI: 0},
                         extra_args=["--max-sessions", "600", "--image-store", IMAGE_STORE]) as srv:
        return density(bench, srv, DATASCI, f"{DATASCI}, built")
