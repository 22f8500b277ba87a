"""Figure 17: hibernation (docs/hibernation.md), side by side in one run with
what the same data costs in a bare kernel.

- Hibernate, seconds per GiB: a session holding a DataFrame of random
  floats (100 MB; 500 MB too outside --quick) is hibernated by
  session_hibernate_request, timed to its reply (the snapshot saved by the
  kernel, sealed and kept, the sandbox gone). Per GiB of the DataFrame's
  bytes. Baseline: a bare kernel (no sandbox) dill-dumps the same kind of
  DataFrame to a file in /dev/shm, the least any portable snapshot pays.
  Target: ≤ 1 s/GiB (E2B's pause: ~4 s per GiB of the VM's RAM).
- Resume to the first reply: the hibernated session's client sends
  `print(df.shape)` and the figure ends at its reply and idle (a sandbox
  from the pool, the snapshot opened into it and restored, the cell run).
  Baseline: the bare kernel loads its dump and runs the same cell. Target:
  ≤ 150 ms for 100 MB (E2B's resume: ~1 s). Two rows at 100 MB: woken the
  moment its hibernation is answered (the host still tearing the old
  sandbox down and refilling the pool), and woken once that is over, as a
  session that slept a while is (each cycle does both).
- Host RAM per session, awake and hibernated: N small sessions (a few
  variables) are created, their sandboxes' cgroup memory and the server's
  PSS measured, then all hibernated and measured again. Target ≤ 1 MB per
  hibernated session. The disk each one's snapshot takes is a row too, and
  the note gives sessions per 24 GiB when 90% sleep.
- The disk's floor: the same number of bytes (random, as the DataFrame's
  floats are) written by this script into a new file in the server's state
  dir and fsynced, interleaved with the cycles. A hibernation must have its
  snapshot on that disk before it answers (docs/hibernation.md), so no
  hibernation there is faster than this; its row compares the two.
- A neighbour's step: another session's `1+1` while the largest session
  hibernates and wakes, against its quiet steps just before (p99).
- The 100 MB rows again on an image whose zygote preloads what the shipped
  python-datasci preloads (on the host's root): the restoring kernel finds
  pandas imported, as a data-science image's does.
- The 100 MB rows again on gVisor (the shipped `host-gvisor` image, runsc,
  when runsc is installed): the portable level on the second runtime; no
  zygote there, so the wake imports pandas under gVisor.
- And on gVisor at the exact level (`host-gvisor` with "hibernate_level":
  "exact"): the whole sandbox checkpointed by runsc and restored into a new
  one; nothing is imported at the wake, and nothing is lost.
"""
import json
import os
import shutil
import threading
import time

from client import BenchError
from servers import (HOST_IMAGE, BareKernels, CellblockServer, cgroup_memory, pss_bytes,
                     wait_ready)
from stats import Row, summary

MAKE_FRAME = ("import numpy as np, pandas as pd\n"
              "df = pd.DataFrame(np.random.default_rng(7).random(({rows}, 8)))\n"
              "print(int(df.memory_usage().sum()))")
SMALL_STATE = ("rows = list(range(1000))\nname = 'session'\n"
               "def f(x):\n    return x * 2\n")
GIB = float(1 << 30)
# The wake on an image whose zygote preloads what the shipped python-datasci
# preloads (on the host's root, as figure 11's): the kernel that restores the
# snapshot finds pandas imported instead of importing it (170-260 ms here).
PRELOAD_IMAGES_DIR = "/run/cellblock-bench-hibernation-images"
PRELOADED = "bench-hibernate-preloaded"
# The gVisor tier's shipped image (images/host-gvisor): the portable level on runsc.
GVISOR = "host-gvisor"
# The same at the exact level (runsc checkpoint and restore).
EXACT_IMAGES_DIR = "/run/cellblock-bench-hibernation-exact"
EXACT = "bench-gvisor-exact"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def write_preloaded_image():
    with open(os.path.join(_SOURCE, "images", "python-datasci", "image.json")) as f:
        shipped = json.load(f)
    with open(HOST_IMAGE) as f:
        spec = json.load(f)
    shutil.rmtree(PRELOAD_IMAGES_DIR, ignore_errors=True)
    os.makedirs(os.path.join(PRELOAD_IMAGES_DIR, PRELOADED))
    with open(os.path.join(PRELOAD_IMAGES_DIR, PRELOADED, "image.json"), "w") as f:
        json.dump(dict(spec, name=PRELOADED, zygote=True, preload=shipped["preload"],
                       env=dict(spec.get("env", {}), **shipped.get("env", {}))), f, indent=1)


def write_exact_image():
    with open(os.path.join(_SOURCE, "images", GVISOR, "image.json")) as f:
        spec = json.load(f)
    shutil.rmtree(EXACT_IMAGES_DIR, ignore_errors=True)
    os.makedirs(os.path.join(EXACT_IMAGES_DIR, EXACT))
    with open(os.path.join(EXACT_IMAGES_DIR, EXACT, "image.json"), "w") as f:
        json.dump(dict(spec, name=EXACT, hibernate_level="exact"), f, indent=1)


def frame_rows(mb):
    return mb * (1 << 20) // 64  # 8 float64 columns


def data_bytes(ex):
    return int(ex.stream_text().strip())


def container_of(srv, sid):
    for entry in srv.manager.call("session_list_request", {"open_only": True})["sessions"]:
        if entry.get("session_id") == sid:
            return entry.get("container_id")
    return None


def wait_cgroups_gone(containers, controllers, what, poll=0.05):
    """Waits until no controller holds a cgroup of `containers` (hibernated
    sandboxes' ends); BenchError naming `what` after 120 s."""
    deadline = time.monotonic() + 120
    while any(os.path.isdir(f"/sys/fs/cgroup/{c}/cellblock/{container}")
              for container in containers for c in controllers):
        if time.monotonic() > deadline:
            raise BenchError(f"{what} still there after 120 s")
        time.sleep(poll)


def settle(srv, container, image):
    """Waits (outside the timed regions) until the hibernated session's old
    sandbox is gone and the pool of `image` is full: what a session that
    slept a while finds when it wakes."""
    if container:
        wait_cgroups_gone([container], ("memory", "cpu", "pids"),
                          f"the hibernated sandbox {container}")
    srv.wait_pool(image)
    time.sleep(0.5)


def cycle(srv, ch, sid, settled=False, image="host"):
    """One hibernate (timed to its reply) and the resume to the next reply:
    at once, or once the host has settled (settle())."""
    container = container_of(srv, sid) if settled else None
    t0 = time.perf_counter()
    reply = srv.manager.call("session_hibernate_request", {"session_id": sid}, timeout=600)
    hibernate_s = time.perf_counter() - t0
    if reply.get("state") != "hibernated":
        raise BenchError(f"session_hibernate_request answered {reply}")
    if settled:
        settle(srv, container, image)
    ex = ch.execute("print(df.shape)", timeout=600, keep_outputs=True)
    if not ex.stream_text().startswith("("):
        raise BenchError(f"the woken session answered {ex.stream_text()!r}")
    resumed_ms = ex.reply["metadata"].get("cellblock", {}).get("resumed_ms")
    return hibernate_s, ex.round_trip, resumed_ms, reply.get("snapshot_bytes", 0)


def bare_cycle(ch, path):
    dump = ch.execute(f"import dill\nwith open({path!r}, 'wb') as f:\n    dill.dump(df, f)\n"
                      "del df", timeout=600)
    load = ch.execute(f"import dill\nwith open({path!r}, 'rb') as f:\n    df = dill.load(f)\n"
                      "print(df.shape)", timeout=600, keep_outputs=True)
    return dump.round_trip, load.round_trip


def durable_write(directory, data):
    """Seconds to write `data` into a new file under `directory` and fsync it."""
    path = os.path.join(directory, f"bench-disk-floor-{os.getpid()}")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        for at in range(0, len(view), 1 << 20):
            os.write(fd, view[at:at + (1 << 20)])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def size_rows(bench, srv, bare_ch, mb, reps, image=None, label=""):
    limits = {"memory_mb": max(2048, mb * 6), "exec_timeout_s": 600, "max_executions": 100000}
    # The kernel writes its snapshot in /data/output: past the default
    # output_mb (256) it must be raised, and a sandbox whose output_mb is not
    # the pool's is started cold at each wake (~80 ms more here).
    if mb * 2 > 256:
        limits["output_mb"] = mb * 3
    reply = srv.create(dict({"limits": limits}, **({"image": image} if image else {})))
    sid = reply["session_id"]
    ch = srv.open_channels(reply["connection"])
    try:
        wait_ready(ch, time.monotonic() + 120)
        made = ch.execute(MAKE_FRAME.format(rows=frame_rows(mb)), timeout=600, keep_outputs=True)
        nbytes = data_bytes(made)
        cgroup_bytes = cgroup_memory(sid)[0]
        bare_made = bare_ch.execute(MAKE_FRAME.format(rows=frame_rows(mb)), timeout=600,
                                    keep_outputs=True)
        bare_nbytes = data_bytes(bare_made)
        path = os.path.join("/dev/shm", f"cellblock-bench-hibernate-{os.getpid()}.dill")
        hib, res, res_ms, snap, dumps, loads, disk = [], [], [], [], [], [], []
        settled = []  # resume to the first reply once the host settled (100 MB only)
        floor_bytes = os.urandom(nbytes)
        bench.log(f"hibernation: {mb} MB DataFrame, {reps} hibernate/resume cycles, "
                  "interleaved with a bare kernel's dump/load")
        try:
            for i in range(reps):
                order = [0, 1] if i % 2 == 0 else [1, 0]
                for side in order:
                    if side == 0:
                        h, r, ms_, s = cycle(srv, ch, sid)
                        hib.append(h / (nbytes / GIB))
                        res.append(r * 1000)
                        if ms_ is not None:
                            res_ms.append(ms_)
                        snap.append(s)
                        if mb == 100:
                            settled.append(cycle(srv, ch, sid, True, image or "host")[1] * 1000)
                    else:
                        d, l_ = bare_cycle(bare_ch, path)
                        dumps.append(d / (bare_nbytes / GIB))
                        loads.append(l_ * 1000)
                        disk.append(durable_write(srv.state_dir, floor_bytes) / (nbytes / GIB))
        finally:
            if os.path.exists(path):
                os.unlink(path)
        a, b = summary(hib), summary(dumps)
        detail = (f"{mb} MB: the DataFrame is {nbytes / (1 << 20):.0f} MB, the session's cgroup "
                  f"held {cgroup_bytes / (1 << 20):.0f} MB before it slept; snapshot "
                  f"{summary(snap)['median'] / (1 << 20):.0f} MB sealed on disk; the relay's own "
                  f"resumed_ms (wake request → restored) median "
                  f"{summary(res_ms)['median'] if res_ms else float('nan'):.0f} ms")
        on = label
        rows = [Row("17", f"Hibernate a session holding {mb} MB (s per GiB of data){on}",
                    "s/GiB", a, b, "bare kernel: dill.dump to /dev/shm",
                    target="≤ 1 s/GiB (E2B ~4)", met=a["median"] <= 1.0, detail=detail)]
        rows.append(Row("17", f"Hibernate a session holding {mb} MB, against the disk's own "
                            f"durable write of as many bytes{on}", "s/GiB", a, summary(disk),
                            "write + fsync into the state dir, no cipher, no kernel",
                            detail=f"{mb} MB: what is left above the ratio 1 is the kernel's "
                                   "write, the seal's read and cipher and the sandbox's end, "
                                   "where they do not overlap the disk's write"))
        a, b = summary(res), summary(loads)
        rows.append(Row("17", f"Resume to the first reply, {mb} MB session{on}", "ms", a, b,
                        "bare kernel: dill.load + the cell",
                        target="≤ 150 ms for 100 MB (E2B ~1 s)" if mb == 100 else "",
                        met=(a["median"] <= 150) if mb == 100 else None))
        if settled:
            rows.append(Row("17", f"Resume to the first reply, {mb} MB session that slept a while"
                                  f"{on}", "ms", summary(settled), b,
                            "bare kernel: dill.load + the cell",
                            target="≤ 150 ms for 100 MB (E2B ~1 s)",
                            met=summary(settled)["median"] <= 150,
                            detail=f"{mb} MB: woken once its old sandbox was gone and the pool "
                                   "full again (the row above wakes it the moment its "
                                   "hibernation is answered, while the host still tears the "
                                   "old sandbox down and refills the pool)"))
        return rows
    finally:
        ch.close()
        srv.close_session(sid)


def neighbour_rows(bench, srv, mb, reps):
    """A neighbour stepping `1+1` while a session of `mb` MB hibernates and
    wakes, against the same neighbour's quiet steps just before: what one
    session's snapshot costs the others (sealed and opened off the server's
    loop since 2026-12-03; before, a 500 MB one held every session up to
    0.7 s)."""
    limits = {"memory_mb": max(2048, mb * 6), "output_mb": max(1024, mb * 3),
              "exec_timeout_s": 600, "max_executions": 100000}
    big = srv.create({"limits": limits})
    near = srv.create({"limits": {"max_executions": 100000}})
    big_ch = srv.open_channels(big["connection"])
    near_ch = srv.open_channels(near["connection"])
    try:
        wait_ready(big_ch, time.monotonic() + 120)
        wait_ready(near_ch, time.monotonic() + 120)
        big_ch.execute(MAKE_FRAME.format(rows=frame_rows(mb)), timeout=600, keep_outputs=True)
        bench.log(f"hibernation: a neighbour's 1+1 while a {mb} MB session hibernates and wakes "
                  f"{reps} times")
        for _ in range(10):
            near_ch.execute("1+1", timeout=60)
        quiet = [near_ch.execute("1+1", timeout=60).round_trip * 1000 for _ in range(100)]
        during, stop, failed = [], threading.Event(), []

        def step():
            try:
                while not stop.is_set():
                    during.append(near_ch.execute("1+1", timeout=60).round_trip * 1000)
            except Exception as error:  # noqa: BLE001 - raised below
                failed.append(error)

        stepper = threading.Thread(target=step)
        stepper.start()
        try:
            for _ in range(reps):
                cycle(srv, big_ch, big["session_id"])
        finally:
            stop.set()
            stepper.join()
        if failed:
            raise BenchError(f"the neighbour's step failed: {failed[0]}")
        a, b = summary(during), summary(quiet)
        return [Row("17", f"A neighbour's `1+1` while a {mb} MB session hibernates and wakes",
                    "ms", a, b, "the same neighbour just before, quiet", ratio_on="p99",
                    detail=f"{mb} MB: {a['n']} steps during {reps} hibernate/wake cycles, the "
                           f"slowest {a['max']:.0f} ms (quiet: {b['max']:.1f} ms)")]
    finally:
        big_ch.close()
        near_ch.close()
        srv.close_session(big["session_id"])
        srv.close_session(near["session_id"])


def ram_rows(bench, srv, n):
    bench.log(f"hibernation: {n} small sessions awake, then all hibernated")
    pss_before = pss_bytes(srv.pid)
    replies, _ = srv.create_many(n, {"limits": {"max_executions": 100000}})
    sids = [r["session_id"] for r in replies]
    chans = [srv.open_channels(r["connection"]) for r in replies]
    try:
        for ch in chans:
            wait_ready(ch, time.monotonic() + 120)
            ch.execute(SMALL_STATE)
        awake = [cgroup_memory(sid)[0] for sid in sids]
        pss_awake = pss_bytes(srv.pid)
        snaps = []
        for sid in sids:
            reply = srv.manager.call("session_hibernate_request", {"session_id": sid},
                                     timeout=600)
            snaps.append(reply["snapshot_bytes"])
        wait_cgroups_gone([f"cb-{s}" for s in sids], ("memory",),
                          "hibernated sessions' cgroups", poll=0.2)
        pss_asleep = pss_bytes(srv.pid)
        # What the host holds for each: the server's growth over its idle self, shared.
        asleep_each = max(0, pss_asleep - pss_before) / n
        awake_each = [m + max(0, pss_awake - pss_before) / n for m in awake]
        mb = 1 << 20
        a = summary([asleep_each / mb])
        b = summary([x / mb for x in awake_each])
        per_24g_awake = 24 * 1024 / b["median"]
        mixed = 0.1 * b["median"] + 0.9 * a["median"]
        note = (f"{n} sessions; sessions per 24 GiB: {per_24g_awake:.0f} all awake, "
                f"{24 * 1024 / mixed:.0f} with 90% asleep (RAM only)")
        rows = [Row("17", "Host RAM per session, hibernated vs awake", "MB", a, b,
                    "the same sessions awake", target="≤ 1 MB hibernated",
                    met=a["median"] <= 1.0, note=note),
                Row("17", "Disk per hibernated small session (sealed snapshot)", "kB",
                    summary([s / 1024 for s in snaps]), None, "")]
        # Waking them all: each answers with its own state.
        for ch in chans:
            ex = ch.execute("print(len(rows), f(21))", timeout=600, keep_outputs=True)
            if ex.stream_text().strip() != "1000 42":
                raise BenchError(f"a woken session answered {ex.stream_text()!r}")
        return rows
    finally:
        for ch in chans:
            ch.close()
        for sid in sids:
            srv.close_session(sid)


def image_rows(bench, srv, image, reps, label):
    """The 100 MB rows on `image` (its pool filled first), beside a bare kernel."""
    srv.wait_pool(image)
    bare = BareKernels(bench.zmq)
    try:
        [bare_ch], _ = bare.start(1)
        bare_ch.execute("x = 1")
        return size_rows(bench, srv, bare_ch, 100, reps, image=image, label=label)
    finally:
        bare.stop()


def hibernation_figure(bench):
    reps = bench.n(5, 2)
    sizes = [100] if bench.quick else [100, 500]
    n = bench.n(20, 4)
    rows = []
    with CellblockServer("hibernation", {"host": 2}) as srv:
        srv.wait_pool()
        bare = BareKernels(bench.zmq)
        try:
            [bare_ch], _ = bare.start(1)
            bare_ch.execute("x = 1")
            for mb in sizes:
                rows += size_rows(bench, srv, bare_ch, mb, reps)
        finally:
            bare.stop()
        rows += neighbour_rows(bench, srv, sizes[-1], reps)
        rows += ram_rows(bench, srv, n)
    write_preloaded_image()
    try:
        with CellblockServer("hibernation-preloaded", {PRELOADED: 2},
                             images_dir=PRELOAD_IMAGES_DIR) as srv:
            rows += image_rows(bench, srv, PRELOADED, reps,
                               f", image preloading pandas ({PRELOADED})")
    finally:
        shutil.rmtree(PRELOAD_IMAGES_DIR, ignore_errors=True)
    if shutil.which("runsc"):
        # The portable level on gVisor: host-gvisor has no zygote (runsc
        # cannot take a fork made outside it), so the wake imports pandas.
        with CellblockServer("hibernation-gvisor", {"host": 0, GVISOR: 2}) as srv:
            rows += image_rows(bench, srv, GVISOR, reps,
                               f", gVisor ({GVISOR}: runsc, the wake imports pandas)")
        # The exact level: runsc checkpoints the whole sandbox, restores it.
        write_exact_image()
        try:
            with CellblockServer("hibernation-gvisor-exact", {"host": 0, EXACT: 1},
                                 images_dir=EXACT_IMAGES_DIR) as srv:
                rows += image_rows(bench, srv, EXACT, reps,
                                   ", gVisor at the exact level (runsc checkpoint and restore)")
        finally:
            shutil.rmtree(EXACT_IMAGES_DIR, ignore_errors=True)
    return rows
