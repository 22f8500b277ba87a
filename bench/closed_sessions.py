"""What a closed session costs the server during its SessionClosed window.

A closed session keeps its shell, control and iopub bound for --closed-window
seconds so that requests in flight are answered SessionClosed. This measures
what that costs: N create → connect → 1+1 → close cycles against a server
whose window outlasts them, then the server's RSS and descriptors while every
closed session is in its window, against the same once they all expired (so
what the registry and SQLite grew by is not counted). Target: ≤ 10 kB per
closed session.

    sudo /usr/bin/python3 bench/closed_sessions.py [N]
"""
import os
import sys
import time

from servers import CellblockServer, proc_status, wait_ready

WINDOW_S = 100


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    with CellblockServer("closed", {"host": 2},
                         extra_args=["--closed-window", str(WINDOW_S)]) as srv:
        for _ in range(3):  # the pool, SQLite and the allocator warmed up
            srv.close_session(srv.create()["session_id"])
        time.sleep(1)
        started = time.monotonic()
        for _ in range(n):
            reply = srv.create()
            ch = srv.open_channels(reply["connection"])
            wait_ready(ch, time.monotonic() + 120)
            ch.execute("1+1")
            srv.close_session(reply["session_id"])  # its client still connected
            ch.close()
        took = time.monotonic() - started
        if took >= WINDOW_S:
            sys.exit(f"{n} cycles took {took:.0f} s, past the {WINDOW_S} s window: ask for fewer")
        time.sleep(2)
        rss_in, fds_in = proc_status(srv.pid, "VmRSS"), fds(srv.pid)
        time.sleep(WINDOW_S + 10)  # every window over, the memory trimmed
        rss_after, fds_after = proc_status(srv.pid, "VmRSS"), fds(srv.pid)
    per_kb = (rss_in - rss_after) / n / 1024
    print(f"{n} closed sessions in their window (cycles took {took:.1f} s): "
          f"{per_kb:.1f} kB and {(fds_in - fds_after) / n:.2f} descriptors each "
          f"(target ≤ 10 kB: {'met' if per_kb <= 10 else 'not met'})")


if __name__ == "__main__":
    main()
