"""Makes this host busy the way CI's shared machine is, until stopped (Ctrl-C).

Not a test: run it beside a test file to check that the file gives the same
verdict on a busy host (tests/README.md says how). It churns, each in a thread:

- another `cellblock serve` in a state dir of its own, creating and closing
  sessions (with an execution in each) back to back;
- kernel-mode sessions (the cellblock-python kernelspec, which every test on
  the host shares under /run/cellblock/kernels), started and shut down;
- cgroups created and removed on every v1 hierarchy (/sys/fs/cgroup/*/busy-host-*),
  as a container runtime does;
- tmpfs and bind mounts mounted and unmounted under /run/busy-host-*;
- with --users: a user added and deleted (useradd/userdel rewrite /etc/passwd,
  /etc/group and /etc/shadow by rename, as a package install does).

Everything it makes is removed when it stops.
Run: sudo env JUPYTER_PATH=build/share/jupyter CELLBLOCK_BIN=build/bin/cellblock \\
         /usr/bin/python3 tests/python/busy_host.py [--users]
"""
import argparse
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_helpers as sh  # noqa: E402
from conftest import run_cell, start_kernel, stop_kernel  # noqa: E402

TAG = f"busy-host-{secrets.token_hex(4)}"
stop = threading.Event()
counts = {}


def count(what):
    counts[what] = counts.get(what, 0) + 1


def serve_churn():
    srv = sh.start_server(["--pool", "host=0"])
    try:
        while not stop.is_set():
            reply = srv.call("session_create_request", {}, timeout=120)["content"]
            if reply["status"] != "ok":   # a loaded host: count it and go on
                count(f"serve creates refused ({reply.get('ename')})")
                continue
            sid = reply["session_id"]
            kc = srv.connect(reply["connection"])
            sh.execute(kc, "sum(range(1000))")
            kc.stop_channels()
            srv.clients.remove(kc)
            srv.ok("session_close_request", {"session_id": sid})
            count("serve sessions")
    finally:
        problems = srv.shutdown()
        if problems:
            print("\n".join(problems), file=sys.stderr)


def kernel_churn():
    while not stop.is_set():
        km, kc = start_kernel()
        try:
            run_cell(kc, "1 + 1")
        finally:
            stop_kernel(km, kc)
        count("kernel-mode sessions")


def cgroup_churn():
    made = []
    while not stop.is_set():
        for hierarchy in ("cpu", "memory", "pids", "freezer", "unified"):
            path = f"/sys/fs/cgroup/{hierarchy}/{TAG}/c{counts.get('cgroups', 0) % 3}"
            os.makedirs(path, exist_ok=True)
            made.append(path)
        time.sleep(0.2)
        for path in made:
            os.rmdir(path)
        made.clear()
        count("cgroups")
    for path in glob.glob(f"/sys/fs/cgroup/*/{TAG}"):
        os.rmdir(path)


def mount_churn():
    top = f"/run/{TAG}"
    os.makedirs(f"{top}/src", exist_ok=True)
    while not stop.is_set():
        points = [f"{top}/tmpfs", f"{top}/bind"]
        for p in points:
            os.makedirs(p, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", TAG, points[0]], check=True)
        subprocess.run(["mount", "--bind", f"{top}/src", points[1]], check=True)
        time.sleep(0.3)
        for p in points:
            subprocess.run(["umount", p], check=True)
        count("mounts")
    shutil.rmtree(top, ignore_errors=True)


def user_churn():
    name = TAG.replace("-", "")[:24]
    while not stop.is_set():
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
        time.sleep(0.5)
        subprocess.run(["userdel", name], check=True)
        count("users")
        time.sleep(0.5)


def guarded(job):
    """Runs job until stopped, again after a failure (a loaded host refuses work now
    and then: that is counted, not fatal)."""
    def run():
        while not stop.is_set():
            try:
                job()
            except Exception as e:   # noqa: BLE001 - any failure is reported and retried
                count(f"{job.__name__} failures")
                print(f"{job.__name__}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                time.sleep(1)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", action="store_true", help="also add and delete a user")
    args = parser.parse_args()
    jobs = [serve_churn, kernel_churn, cgroup_churn, mount_churn] + ([user_churn] if args.users else [])
    # A background job of a non-interactive shell starts with SIGINT ignored: stop on
    # SIGTERM as well, and clean up either way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    threads = [threading.Thread(target=guarded(job), name=job.__name__) for job in jobs]
    for t in threads:
        t.start()
    try:
        while not stop.wait(10):
            print(f"{time.strftime('%H:%M:%S')} {counts}", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join()
        print(f"stopped: {counts}")


if __name__ == "__main__":
    main()
