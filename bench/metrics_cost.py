"""Figure 15: what `serve --metrics` costs (docs/operations.md).

Two servers side by side in one run, one with `--metrics 127.0.0.1:0`
scraped every SCRAPE_S by a separate process (as Prometheus would, only 75×
more often than its usual 15 s), one without:
- step: the 1+1 round trip on a session of each, interleaved (target: the
  median within noise, ≤ 1.05× off);
- throughput: N sessions on each stepping 1+1 back to back, windows
  alternated on/off/off/on (target: ≥ 0.95× off);
- the server's CPU per scrape: 200 scrapes back to back on the idle server,
  its CPU time (every thread, schedstat) divided by 200.
"""
import re
import signal
import subprocess
import sys
import time
import urllib.request

from client import BenchError
from servers import CellblockServer, process_cpu_ns, wait_ready
from stats import Row, ms, summary

SCRAPE_S = 0.2

# The scraper: its own process, so its GETs never share the benchmark
# client's interpreter (and its GIL) with the side that has metrics on.
SCRAPER = r"""
import signal, sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
counts = [0, 0, 0]  # scrapes, bytes, failures
def stop(*_):
    print(*counts, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(interval)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            counts[1] += len(r.read())
        counts[0] += 1
    except OSError:
        counts[2] += 1
"""


class Scraper:
    """GETs a server's /metrics every `interval` seconds from another process."""

    def __init__(self, address, interval):
        self.args = [sys.executable, "-c", SCRAPER, f"http://{address}/metrics", str(interval)]
        self.scrapes = self.bytes = self.failures = 0

    def __enter__(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        fields = out.split()
        if len(fields) == 3:
            self.scrapes, self.bytes, self.failures = (int(x) for x in fields)
        return False


def metrics_endpoint(srv):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.search(r"metrics: http://([0-9.]+:[0-9]+)/metrics", srv.log_tail(1 << 20))
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise BenchError("the --metrics server logged no endpoint address")


def cpu_per_scrape(srv, address, n=200):
    """Microseconds of the server's CPU per scrape, and the scrape's size."""
    url = f"http://{address}/metrics"
    size = 0
    before = process_cpu_ns(srv.pid)
    for _ in range(n):
        with urllib.request.urlopen(url, timeout=5) as r:
            size = len(r.read())
    return (process_cpu_ns(srv.pid) - before) / n / 1000, size


def metrics_cost(bench):
    # Helpers shared with the other figures (imported here: figures.py imports this file).
    from figures import MANY_STEPS, ONE_PLUS_ONE, ab_blocks, window

    reps = bench.n(200, 40)
    warmup = bench.n(30, 10)
    n = bench.n(10, 4)
    seconds = bench.n(10, 4)
    rows = []
    with CellblockServer("metrics-on", {"host": 1}, ["--metrics", "127.0.0.1:0"]) as on, \
            CellblockServer("metrics-off", {"host": 1}) as off:
        on.wait_pool()
        off.wait_pool()
        address = metrics_endpoint(on)
        scrape_us, scrape_bytes = cpu_per_scrape(on, address)
        with Scraper(address, SCRAPE_S) as scraper:
            chans = {}
            for name, srv in (("on", on), ("off", off)):
                reply = srv.create({"limits": MANY_STEPS})
                ch = srv.open_channels(reply["connection"])
                wait_ready(ch, time.monotonic() + 120)
                chans[name] = ch
            for _ in range(warmup):
                chans["on"].execute(ONE_PLUS_ONE)
                chans["off"].execute(ONE_PLUS_ONE)
            bench.log(f"metrics: 1+1, {reps} reps on each server, interleaved")
            onx, offx, _, _ = ab_blocks(lambda: chans["on"].execute(ONE_PLUS_ONE),
                                        lambda: chans["off"].execute(ONE_PLUS_ONE), reps)
            on_ms, off_ms = ms([x.round_trip for x in onx]), ms([x.round_trip for x in offx])
            a, b = summary(on_ms), summary(off_ms)
            rows.append(Row("15", "Metrics: execute round trip of 1+1, --metrics on (scraped "
                                  f"every {SCRAPE_S:g} s) vs off", "ms", a, b, "metrics off",
                            target="median ≤ 1.05× off (noise)",
                            met=a["median"] <= 1.05 * b["median"],
                            note=f"{a['median'] - b['median']:+.3f} ms at the median",
                            detail=f"a scrape ({scrape_bytes / 1024:.1f} KiB) costs the server "
                                   f"{scrape_us:.0f} µs of CPU (200 back to back, idle server)"))
            for ch in chans.values():
                ch.close()
            bench.log(f"metrics: throughput, {n} sessions on each server")
            groups = {}
            for name, srv in (("on", on), ("off", off)):
                replies, _ = srv.create_many(n, {"limits": MANY_STEPS})
                groups[name] = [srv.open_channels(r["connection"]) for r in replies]
                for ch in groups[name]:
                    wait_ready(ch, time.monotonic() + 300)
            runs = {"on": [], "off": []}
            for order in range(2):
                pair = [("on", on), ("off", off)]
                if order:
                    pair.reverse()
                for name, srv in pair:
                    runs[name].append(window(groups[name], seconds / 2, 1, srv.pid))
            for group in groups.values():
                for ch in group:
                    ch.close()
        rates = {k: summary(sum((r["per_second"] for r in v), [])) for k, v in runs.items()}
        total = {k: sum(r["executions"] for r in v) / seconds for k, v in runs.items()}
        server = {k: max((r["server_cpu_share"] or 0) for r in v) for k, v in runs.items()}
        rows.append(Row("15", f"Metrics: throughput, {n} sessions × 1+1 back to back, "
                              "--metrics on vs off", "exec/s", rates["on"], rates["off"],
                        "metrics off", higher_is_better=True,
                        target="median ≥ 0.95× off (noise)",
                        met=rates["on"]["median"] >= 0.95 * rates["off"]["median"],
                        note=f"total {total['on']:.0f} vs {total['off']:.0f} exec/s",
                        detail=f"the servers used {server['on']:.0%} and {server['off']:.0%} of "
                               f"a core; {scraper.scrapes} scrapes during the figure, "
                               f"{scraper.failures} failed"))
        bench.raw["metrics"] = {"step_on_ms": on_ms, "step_off_ms": off_ms,
                                "throughput": runs, "scrapes": scraper.scrapes,
                                "scrape_failures": scraper.failures,
                                "scrape_interval_s": SCRAPE_S,
                                "server_cpu_us_per_scrape": scrape_us,
                                "scrape_bytes": scrape_bytes}
    return rows
