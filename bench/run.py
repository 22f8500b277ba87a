#!/usr/bin/python3
"""cellblock's benchmark suite: every figure side by side with its baseline, in one run.

    sudo /usr/bin/python3 bench/run.py [--quick] [--only ready,step,...] [--reps N]

Prints a Markdown table and writes bench/results/<UTC time>.md and .json, and
bench/results/latest.md. See bench/README.md for what each figure measures.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

sys.dont_write_bytecode = True   # no __pycache__ in the source tree
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

import servers  # noqa: E402
from figures import FIGURES, ORDER, Bench  # noqa: E402
from servers import CELLBLOCK, ROOT  # noqa: E402
from stats import markdown_details, markdown_table, unavailable  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def cpu_times():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def busy_share(before, after):
    total = after[0] - before[0]
    return 1 - (after[1] - before[1]) / total if total else None


def other_sandboxes():
    """Sandboxes of other cellblock servers on this machine (load we do not control)."""
    try:
        # One cb-<session> cgroup per sandbox (the rest are the controller's files).
        return sum(1 for name in os.listdir("/sys/fs/cgroup/memory/cellblock")
                   if name.startswith("cb-"))
    except OSError:
        return None


def command_output(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment():
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) * 1024
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": mem_total,
        "python": sys.version.split()[0],
        "git_commit": command_output("git", "-C", ROOT, "rev-parse", "HEAD"),
        "git_dirty": bool(command_output("git", "-C", ROOT, "status", "--porcelain",
                                         "--untracked-files=no")),
        "runc": command_output("runc", "--version").splitlines()[:1],
        "runsc": command_output("runsc", "--version").splitlines()[:1],
        "cellblock_binary": CELLBLOCK,
        "cellblock_binary_sha256": binary_digest(servers.CELLBLOCK),
        "cellblock_binary_mtime_utc": datetime.datetime.fromtimestamp(
            os.path.getmtime(servers.CELLBLOCK), datetime.timezone.utc).isoformat(
                timespec="seconds"),
    }


# Per run: two runs at once (other engineers on a shared host) must not remove each other's.
SNAPSHOT = f"/run/cellblock-bench-bin-{os.getpid()}"


def snapshot_binaries():
    """Copies build/bin/cellblock (and cellblock-gateway) and build/libexec/cellblock/ aside, so every server of
    the run is the same build even if the working tree is rebuilt meanwhile."""
    build = os.path.dirname(os.path.dirname(CELLBLOCK))
    shutil.rmtree(SNAPSHOT, ignore_errors=True)
    os.makedirs(os.path.join(SNAPSHOT, "bin"))
    os.chmod(SNAPSHOT, 0o755)
    shutil.copy2(CELLBLOCK, os.path.join(SNAPSHOT, "bin", "cellblock"))
    # The egress gateway lives beside cellblock (figure 12 starts it).
    gateway = os.path.join(os.path.dirname(CELLBLOCK), "cellblock-gateway")
    if os.path.exists(gateway):
        shutil.copy2(gateway, os.path.join(SNAPSHOT, "bin", "cellblock-gateway"))
    shutil.copytree(os.path.join(build, "libexec", "cellblock"),
                    os.path.join(SNAPSHOT, "libexec", "cellblock"))
    servers.CELLBLOCK = os.path.join(SNAPSHOT, "bin", "cellblock")


def binary_digest(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions, 10 sessions only: a smoke run")
    parser.add_argument("--only", default="",
                        help=f"comma-separated figures to run: {','.join(ORDER)}")
    parser.add_argument("--reps", type=int, default=0,
                        help="override the repetitions of the step-like figures")
    parser.add_argument("--sessions", default="",
                        help="throughput session counts, e.g. 10,50 (default 10,50,100; "
                             "--quick: 10); the restarts figure's too (default 20)")
    parser.add_argument("--file-mb", type=int, default=1024,
                        help="size of the file the file-transfer figure moves (MiB)")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the perf profile of the server after the step figure")
    parser.add_argument("--out", default=RESULTS, help="where results are written")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an argument for every `cellblock serve` of the run (repeatable), "
                             "e.g. --server-arg=--kernel-transport=libzmq")
    args = parser.parse_args()
    servers.SERVER_ARGS[:] = args.server_arg
    if os.geteuid() != 0:
        sys.exit("bench/run.py: run as root (cellblock serve needs it)")
    if not os.access(CELLBLOCK, os.X_OK):
        sys.exit(f"bench/run.py: {CELLBLOCK} not built (scripts/build.sh)")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or ORDER
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        sys.exit(f"bench/run.py: unknown figure(s) {unknown}; choose from {ORDER}")

    sessions = [int(x) for x in args.sessions.split(",") if x.strip()] or None
    snapshot_binaries()
    env = environment()
    bench = Bench(args.quick, args.reps or None, profile=not args.no_profile, sessions=sessions,
                  file_mb=args.file_mb)
    started = datetime.datetime.now(datetime.timezone.utc)
    run = {"started_utc": started.isoformat(timespec="seconds"), "quick": args.quick,
           "only": names, "environment": env, "server_args": args.server_arg, "figures": {}}
    print(f"cellblock benchmark, {started:%Y-%m-%d %H:%M:%S} UTC, load {loadavg()}, "
          f"{other_sandboxes()} sandboxes of other servers on the host", flush=True)
    rows = []
    try:
        for name in names:
            title, fn = FIGURES[name]
            print(f"{title}", flush=True)
            t0, l0, c0, o0 = time.monotonic(), loadavg(), cpu_times(), other_sandboxes()
            try:
                got = fn(bench)
                error = None
            except Exception as e:  # a figure that cannot be measured says so in the table
                traceback.print_exc()
                error = f"{type(e).__name__}: {e}"
                got = [unavailable(title.split(".")[0], title, error[:400])]
            rows += got
            run["figures"][name] = {
                "seconds": round(time.monotonic() - t0, 1), "load_before": l0,
                "load_after": loadavg(), "host_cpu_busy": busy_share(c0, cpu_times()),
                "other_sandboxes_before": o0, "other_sandboxes_after": other_sandboxes(),
                "error": error}
            f = run["figures"][name]
            print(f"  {f['seconds']} s; load {f['load_before']} → {f['load_after']}; host CPU "
                  f"{(f['host_cpu_busy'] or 0):.0%} busy", flush=True)
    finally:
        shutil.rmtree(SNAPSHOT, ignore_errors=True)
    finished = datetime.datetime.now(datetime.timezone.utc)
    run["finished_utc"] = finished.isoformat(timespec="seconds")
    run["rows"] = [r.to_json() for r in rows]
    run["raw"] = bench.raw
    table = markdown_table(rows)
    loads = [f["load_before"][0] for f in run["figures"].values()] + \
            [f["load_after"][0] for f in run["figures"].values()]
    header = (f"# cellblock benchmark, {started:%Y-%m-%d %H:%M} UTC"
              f"{' (quick)' if args.quick else ''}\n\n"
              f"{run['environment']['cpus']} CPUs, "
              f"{run['environment']['mem_total_bytes'] / 2**30:.1f} GiB, kernel "
              f"{run['environment']['kernel']}, commit {run['environment']['git_commit'][:10]}"
              f"{' (dirty)' if run['environment']['git_dirty'] else ''}; "
              f"1-minute load average {min(loads):.1f}–{max(loads):.1f} during the run "
              f"(shared machine); {(finished - started).seconds // 60} min; binary sha256 "
              f"{run['environment']['cellblock_binary_sha256'][:12]} built "
              f"{run['environment']['cellblock_binary_mtime_utc']}.\n"
              "Ratios are cellblock ÷ baseline on the statistic named in the cell.\n")
    per_figure = "\n".join(
        f"- {n}: {f['seconds']} s, load {f['load_before'][0]:.1f} → {f['load_after'][0]:.1f}, "
        f"host CPU {(f['host_cpu_busy'] or 0):.0%} busy, "
        f"{f['other_sandboxes_before']} → {f['other_sandboxes_after']} cellblock sandboxes "
        f"on the host (ours and other engineers')"
        for n, f in run["figures"].items())
    details = markdown_details(rows)
    markdown = f"{header}\n{table}\n"
    if details:
        markdown += f"\nWhere the time goes, and what else was seen:\n{details}\n"
    markdown += f"\nLoad per figure:\n{per_figure}\n"
    for title, text in bench.appendix:
        markdown += f"\n## {title}\n\n```\n{text}\n```\n"
    print()
    print(markdown)
    os.makedirs(args.out, exist_ok=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ") + ("-quick" if args.quick else "")
    for path, text in ((f"{stamp}.md", markdown), ("latest.md", markdown),
                       (f"{stamp}.json", json.dumps(run, indent=1, default=str))):
        with open(os.path.join(args.out, path), "w") as f:
            f.write(text)
    print(f"written: {os.path.join(args.out, stamp)}.md, .json and latest.md")


if __name__ == "__main__":
    main()
