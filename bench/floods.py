"""Figure 14: output floods beside a quiet neighbour (the noisy-neighbour row
of the issue "One session cannot slow another").

For each kind of flood (a print loop, `sys.stdout.write` of 1 MB strings, a
subprocess writing to descriptor 1 as fast as it can, `display()` of a PNG in
a loop), in a session with a 6 s execution timeout and the default 1 MiB
output budget, beside a quiet session stepping `1+1`:
- the quiet session's 1+1 round trip during the flood against its own quiet
  round trips just before (p99; target ≤ 2×);
- the flooding cell's verdict: its execute_reply's time after the deadline
  (target ≤ 1 s), and that it was interrupted there (KeyboardInterrupt, or
  ExecutionTimeout when the interrupt did not stop it) with output truncated;
- the server's CPU time during the flood, as a share of one core (it was a
  whole core, discarding 1.4 MB/s of backlog);
- what reached the client, and what the kernel dropped at its source.
"""
import time

from client import BenchError
from servers import CellblockServer, process_cpu_ns, wait_ready
from stats import Row, ms, summary

TIMEOUT_S = 6
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5Erk"
       "Jggg==")
FLOODS = [
    ("print loop", "i = 0\nwhile True:\n    print(i)\n    i += 1\n"),
    ("1 MB writes", "import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)\n"),
    ("subprocess on fd 1", "import subprocess\nsubprocess.run(['/usr/bin/python3', '-c', "
                           "'import os\\nwhile True: os.write(1, b\"y\" * 65536)'])\n"),
    ("display() loop", "import base64\nfrom IPython.display import Image, display\n"
                       f"png = base64.b64decode({PNG!r})\nwhile True:\n    display(Image(data=png))\n"),
]


def size(n):
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def steps_until(quiet, flood_ch, flood):
    """1+1 round trips on `quiet` until the flood's reply and idle are in;
    pumps the flooding client's channels meanwhile. Returns the round trips."""
    out = []
    deadline = time.perf_counter() + TIMEOUT_S + 120
    while not flood.done:
        if time.perf_counter() > deadline:
            raise BenchError("the flooding cell got no reply 120 s after its deadline")
        ex = quiet.send_execute("1+1")
        while not ex.done:
            quiet.pump(0.005)
            flood_ch.pump(0)
        if ex.status() != "ok":
            raise BenchError(f"the quiet session's 1+1: {ex.reply['content']}")
        out.append(ex.round_trip)
        flood_ch.pump(0.02)
    return out


def floods_figure(bench):
    reps = bench.n(200, 50)
    rows, raw = [], {}
    with CellblockServer("floods", {"host": 2}) as srv:
        for name, code in FLOODS:
            srv.wait_pool()
            quiet_reply = srv.create({"limits": {"max_executions": 100000}})
            quiet = srv.open_channels(quiet_reply["connection"])
            wait_ready(quiet, time.monotonic() + 120)
            loud_reply = srv.create({"limits": {"exec_timeout_s": TIMEOUT_S}})
            loud = srv.open_channels(loud_reply["connection"])
            wait_ready(loud, time.monotonic() + 120)
            for _ in range(20):
                quiet.execute("1+1")
            quiet_rt = [quiet.execute("1+1").round_trip for _ in range(reps)]
            bench.log(f"floods: {name}: quiet p99 {summary(ms(quiet_rt))['p99']:.2f} ms; flooding")
            cpu0 = process_cpu_ns(srv.pid)
            flood = loud.send_execute(code, keep_outputs=True)
            loud_rt = steps_until(quiet, loud, flood)
            cpu_s = (process_cpu_ns(srv.pid) - cpu0) / 1e9
            wall = max(flood.reply_at, flood.idle_at) - flood.sent
            late = flood.reply_at - flood.sent - TIMEOUT_S
            content, meta = flood.reply["content"], flood.reply["metadata"].get("cellblock", {})
            received = sum(len(str(m["content"].get("text", m["content"].get("data", ""))))
                           for m in flood.outputs if m["msg_type"] in ("stream", "display_data"))
            alive = loud.execute("1+1", check=False).status() == "ok"
            for ch, r in ((quiet, quiet_reply), (loud, loud_reply)):
                ch.close()
                srv.close_session(r["session_id"])
            srv.wait_sessions_gone([quiet_reply["session_id"], loud_reply["session_id"]])
            qs, ls = summary(ms(quiet_rt)), summary(ms(loud_rt))
            raw[name] = {"quiet_ms": ms(quiet_rt), "loud_ms": ms(loud_rt), "late_s": late,
                         "server_cpu_s": cpu_s, "wall_s": wall, "reply": content,
                         "metadata": meta, "received_chars": received, "alive": alive}
            verdict_ok = content.get("ename") in ("KeyboardInterrupt", "ExecutionTimeout") and meta.get(
                "output_truncated") is True and alive
            rows.append(Row(
                "14", f"Output flood ({name}): quiet session's 1+1 round trip", "ms", ls, qs,
                "same session, before the flood", ratio_on="p99", target="p99 ≤ 2× quiet p99",
                met=ls["p99"] <= 2 * qs["p99"], note=f"{len(loud_rt)} round trips during it"))
            rows.append(Row(
                "14", f"Output flood ({name}): the flooding cell's reply after its {TIMEOUT_S} s "
                      "deadline", "s", summary([late]), target="≤ 1 s, interrupted, "
                      "truncated, session alive", met=late <= 1.0 and verdict_ok,
                note=f"{content.get('ename')}; truncated {meta.get('output_truncated')}; dropped "
                     f"{size(meta.get('output_dropped_bytes', 0))}, "
                     f"{size(meta.get('output_dropped_in_kernel_bytes', 0))} of it in the "
                     f"kernel; {size(received)} reached the client; session "
                     f"{'alive' if alive else 'lost'}"))
            rows.append(Row(
                "14", f"Output flood ({name}): the server's CPU during the flood", "% of a core",
                summary([100 * cpu_s / wall]), note=f"{cpu_s:.2f} s of CPU in {wall:.1f} s"))
    bench.raw["floods"] = raw
    return rows
