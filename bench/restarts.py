"""Figure 18: restarts (docs/restarts.md) as agents stepping see them: a
planned one (SIGHUP: the sandboxes are left running and the exec'd server
adopts them), the same with `--adopt-grace 0` (every session hibernates and
the next start wakes it: how SIGHUP worked until stop 46, measured in the
same run as the baseline of the first), and a crash (SIGKILL, then a new
`cellblock serve`: the sandboxes ran on and are adopted); then SIGHUP and a
crash again with the sessions on gVisor (`host-gvisor`, runsc: adopted by
the key their shims show, since stop 50; skipped where runsc is missing).

N sessions (20; 4 with --quick) each step `1+1` in a loop, each on a thread
of its own with its own sockets; the server gets SIGHUP (or SIGKILL and a
new start) while they step, and every step's send and reply times are kept.

- The longest reply gap a session saw across the restart (ms). Baseline: the
  server's own restart in the same run, SIGHUP until the next start's
  manager is bound (the handover of idle sessions, the exec, the start-up):
  what the gap cannot be shorter than. Target: ≤ 2 s plus that (issue #32).
- Until every session answered again, from SIGHUP (s): each session's first
  reply from the next start (adopted, or woken: a sandbox, the snapshot
  restored).
- Requests refused or lost across the restart: a step answered anything but
  ok, or not answered in 120 s. Target 0.
"""
import os
import shutil
import signal
import threading
import time

from client import BenchError
from servers import CellblockServer, wait_ready
from stats import Row, summary

KEY_FILE = "/run/cellblock-bench-restarts.key"


def stepper(ch, steps, failures, stop, resent, again):
    """Steps `1+1` until stop is set; appends (sent, replied) per step. The
    channels send what is open again when their connection comes back
    (Channels.watch_reconnects). A step whose reply a crash lost is answered
    ServerRestarting: counted in `resent`, and sent again, as an agent would."""
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            ex = ch.execute("1+1", timeout=120, check=False)
        except BenchError as e:
            failures.append(f"lost: {e}")
            return
        if ex.sent_again:
            again.append(ex.msg_id)
        if ex.status() != "ok":
            c = ex.reply["content"]
            if c.get("ename") == "ServerRestarting":
                resent.append(c.get("evalue"))
                continue
            failures.append(f"refused: {c.get('ename')}: {c.get('evalue')}")
            return
        steps.append((sent, time.perf_counter()))


def server_starts(srv):
    try:
        with open(srv.log_path, errors="replace") as f:
            return f.read().count("cellblock serve: manager on")
    except OSError:
        return 0


# How each restart is made: the label, whether it is a crash, the server's
# extra arguments and what each session_create_request asks for besides.
RUNSC = {"image": "host-gvisor"}
MODES = (("SIGHUP", False, [], {}),
         ("SIGHUP with every session hibernated (--adopt-grace 0)", False,
          ["--adopt-grace", "0"], {}),
         ("kill -9 and a new start", True, [], {}),
         # gVisor sandboxes are adopted too since stop 50 (docs/restarts.md).
         ("SIGHUP, runsc sessions", False, [], RUNSC),
         ("kill -9 and a new start, runsc sessions", True, [], RUNSC))


def restarts_figure(bench):
    # --sessions N[,M]: those counts instead of 20 (issue 32 asks for 100).
    rows = []
    for n in bench.sessions or [bench.n(20, 4)]:
        for how, crash, args, create in MODES:
            if create.get("image") == RUNSC["image"] and shutil.which("runsc") is None:
                bench.log(f"restarts: {how} skipped: runsc is not installed")
                continue
            with CellblockServer("restarts", {"host": 2},
                                 extra_args=["--key-file", KEY_FILE] + args) as srv:
                try:
                    rows += measure(bench, srv, n, how, crash, create)
                finally:
                    if os.path.exists(KEY_FILE):
                        os.unlink(KEY_FILE)
    return rows


def measure(bench, srv, n, how, crash, create):
    """crash: SIGKILL and a new `cellblock serve` (the sandboxes adopted);
    otherwise SIGHUP (the sessions left running, or hibernated with
    --adopt-grace 0)."""
    srv.wait_pool()
    replies, _ = srv.create_many(n, {"limits": {"max_executions": 100000}, **create})
    chans = [srv.open_channels(r["connection"]) for r in replies]
    for ch in chans:
        wait_ready(ch, time.monotonic() + 120)
        ch.watch_reconnects()
    steps = [[] for _ in chans]
    failures, resent, again = [], [], []
    stop = threading.Event()
    threads = [threading.Thread(target=stepper, args=(ch, s, failures, stop, resent, again))
               for ch, s in zip(chans, steps)]
    bench.log(f"restarts: {n} sessions stepping 1+1, then {how}")
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while min(len(s) for s in steps) < 5 and not failures:
            if time.monotonic() > deadline:
                raise BenchError("the sessions did not step 5 times each in 120 s")
            time.sleep(0.05)
        hup = time.perf_counter()
        if crash:
            srv.kill9_and_start()
        else:
            os.kill(srv.proc.pid, signal.SIGHUP)
            while server_starts(srv) < 2:
                if time.perf_counter() - hup > 300:
                    raise BenchError("no second start 300 s after SIGHUP: " + srv.log_tail())
                time.sleep(0.01)
        up = time.perf_counter()
        # Each session steps a few times more on the next start.
        deadline = time.monotonic() + 300
        while not failures and min(sum(1 for _, r in s if r > up) for s in steps) < 5:
            if time.monotonic() > deadline:
                raise BenchError("sessions did not step again within 300 s of the restart")
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
        for ch in chans:
            ch.close()
    gaps, back = [], []
    for s in steps:
        replies_at = [r for _, r in s]
        spanning = [b - a for a, b in zip(replies_at, replies_at[1:]) if b > hup and a < up + 60]
        gaps.append(max(spanning) * 1000 if spanning else 0.0)
        after = [r for _, r in s if r > up]
        if after:
            back.append(after[0] - hup)
    restart_ms = (up - hup) * 1000
    a = summary(gaps)
    first = ("its first reply from the next start: a wake" if "hibernated" in how
             else "its first reply from the adopting start")
    rows = [Row("18", f"Longest reply gap across {how}, {n} sessions stepping", "ms",
                a, summary([restart_ms]),
                "the server's own restart (" + ("kill → the new start's server.json"
                                                if crash else "SIGHUP → bound again") + ")",
                target="≤ 2 s + the server's start", met=a["max"] <= 2000 + restart_ms,
                detail=f"every session answered again {max(back) if back else float('nan'):.1f}"
                       f" s after the {'kill' if crash else 'SIGHUP'} ({first})"),
            Row("18", f"Requests refused or lost across {how}", "count",
                summary([float(len(failures))]), None, "", target="0", met=not failures,
                note="; ".join(failures[:3]),
                detail=f"{len(again)} step(s) sent again as the connection came back; "
                       f"{len(resent)} answered ServerRestarting (their reply lost with the "
                       "killed server) and sent again" if crash else "")]
    return rows
