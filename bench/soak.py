#!/usr/bin/python3
"""Soak of session creation, driven from outside through the manager API and
jupyter_client (issue 13, section 6):

  1. CYCLES create/close cycles, PARALLEL at a time (each its own manager socket);
  2. SESSIONS sessions x EXECS executions each (one thread per session);
  3. the closed-session window passes.

Prints: whether every create was answered in the order it was sent (per
client thread: each thread's creates are sequential, so "in order" is judged
on the server's side by the creates it answered ahead of an older one), how
many were refused and with what, lost or mixed replies, and the server's fds,
RSS and threads at start, after the load and after the window. With --trim,
asks the server's glibc to return free memory (gdb: malloc_trim(0)) and
prints the RSS after it: memory that comes back is allocator retention, not a
leak. With --rounds N, the load and the window N times over: a leak grows with
every round, a high-water mark (caches, pools, allocator arenas) does not.

    sudo /usr/bin/python3 bench/soak.py [--cycles 300 --parallel 4 --sessions 30 --execs 50] [--trim] [--rounds N]
"""
import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
os.environ.setdefault("CELLBLOCK_BIN", os.path.join(HERE, "..", "build", "bin", "cellblock"))
import server_helpers as sh  # noqa: E402


def figures(pid):
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
            "threads": int(status["Threads"])}


def show(label, f):
    print(f"  {label:<28} fds {f['fds']:5d}  RSS {f['rss_mb']:7.1f} MB  threads {f['threads']:3d}")


def cycles(srv, count, parallel):
    """Create/close cycles from `parallel` threads; returns (answers, refused, lost)."""
    lock = threading.Lock()
    answered = []       # (sent order, answer order) for every create
    refused, lost = [], []
    sent = [0]

    def worker():
        client = sh.ServerProcess(srv.state_dir)
        client.info = srv.info
        client._connect_manager()
        while True:
            with lock:
                if sent[0] >= count:
                    break
                n = sent[0]
                sent[0] += 1
            msg_id = client.send("session_create_request", {"timeout_s": 120})
            reply = client.receive(msg_id, timeout=130)
            with lock:
                answered.append(n)
                if reply is None:
                    lost.append(n)
                    continue
                if reply["content"]["status"] != "ok":
                    refused.append(reply["content"]["ename"] + ": " + reply["content"]["evalue"])
                    continue
            sid = reply["content"]["session_id"]
            close = client.call("session_close_request", {"session_id": sid})
            if close["content"]["status"] != "ok":
                with lock:
                    lost.append(f"close {sid}: {close['content']}")
        client.socket.close(linger=0)
        client.ctx.term()

    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answered, refused, lost


def load(srv, sessions, execs):
    """`sessions` sessions at once, each running `execs` cells; returns (refused, bad replies)."""
    ids = [srv.send("session_create_request", {"timeout_s": 300}) for _ in range(sessions)]
    replies = [srv.receive(i, timeout=310) for i in ids]
    refused = [r["content"] if r else "lost" for r in replies if not r or r["content"]["status"] != "ok"]
    bad = []
    lock = threading.Lock()

    def run(reply):
        kc = sh.BlockingKernelClient()
        kc.load_connection_info(reply["content"]["connection"])
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            for n in range(execs):
                rep, iopub = sh.execute(kc, f"print({n} * 3)", timeout=60)
                if rep["content"]["status"] != "ok" or sh.stream_text(iopub) != f"{n * 3}\n":
                    with lock:
                        bad.append((reply["content"]["session_id"], n, rep["content"]))
        except Exception as e:  # a lost reply: execute() timed out
            with lock:
                bad.append((reply["content"]["session_id"], "lost", repr(e)))
        finally:
            kc.stop_channels()

    good = [r for r in replies if r and r["content"]["status"] == "ok"]
    threads = [threading.Thread(target=run, args=(r,)) for r in good]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in good:
        srv.call("session_close_request", {"session_id": r["content"]["session_id"]})
    return refused, bad


def trim(pid):
    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
                   capture_output=True, timeout=120)


def one_round(srv, pid, args, prefix):
    """The cycles, the load, the window; prints what they did and the server's figures."""
    t0 = time.monotonic()
    answered, refused, lost = cycles(srv, args.cycles, args.parallel)
    t1 = time.monotonic()
    print(f"{prefix}{args.cycles} create/close cycles, {args.parallel} at a time: {t1 - t0:.1f} s; "
          f"answered {len(answered)}, refused {len(refused)}, lost {len(lost)}")
    for r in refused[:5]:
        print("   refused:", r)
    load_refused, bad = load(srv, args.sessions, args.execs)
    t2 = time.monotonic()
    print(f"{prefix}{args.sessions} sessions x {args.execs} executions: {t2 - t1:.1f} s; refused "
          f"{len(load_refused)}, lost or mixed replies {len(bad)}")
    for b in bad[:5]:
        print("   bad:", b)
    after = figures(pid)
    window = srv.ok("server_info_request", {})["content"]["policy"]["closed_channels_s"]
    time.sleep(window + 5)
    sh.wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 2,
                timeout=120)
    settled = figures(pid)
    show(f"{prefix}after the load", after)
    show(f"{prefix}after the window ({window:g} s)", settled)
    if args.trim and shutil.which("gdb"):
        trim(pid)
        show(f"{prefix}after malloc_trim(0)", figures(pid))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=30)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--trim", action="store_true", help="probe glibc retention with malloc_trim")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the load: memory a leak holds grows with each round, "
                         "a high-water mark does not")
    args = ap.parse_args()
    srv = sh.start_server([])   # the defaults: pool host=2, max-sessions 256, window 30 s
    try:
        pid = srv.proc.pid
        sh.wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 2,
                    timeout=120)
        start = figures(pid)
        print("server figures:")
        show("at start", start)
        if args.trim and shutil.which("gdb"):
            trim(pid)
            show("at start, after malloc_trim(0)", figures(pid))
        for n in range(1, args.rounds + 1):
            one_round(srv, pid, args, f"round {n}: " if args.rounds > 1 else "")
    finally:
        problems = srv.shutdown(keep_log=True)
        if problems:
            print("\n".join(problems))


if __name__ == "__main__":
    main()
