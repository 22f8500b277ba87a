"""Runs inside a runsc sandbox as its init, for bench/runsc_exact/probe.py.

A prototype of the sandbox side of the exact level (docs/hibernation.md,
"The exact level on runsc"): the kernel (launch.py) binds its channels on
unix sockets inside the sandbox (/tmp/ipc, gVisor's own), and this process
holds every host socket: one listener per channel at the path the host
expects (/run/cellblock/k-N, a host socket through --host-uds=all), each
accepted connection paired with one to the kernel's socket inside.
SIGUSR2 closes every host socket (the listeners, the connections and the
inner halves paired with them) and leaves /run/cellblock/quiet; only then can
`runsc checkpoint` save the sandbox. SIGUSR1 listens again, in the sandbox
`runsc restore` made from the image.
"""
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

HOST = "/run/cellblock"
INNER = "/tmp/ipc"
CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def log(*args):
    print("bridge:", *args, file=sys.stderr, flush=True)


def main():
    os.makedirs(INNER, exist_ok=True)
    conf = json.load(open(f"{HOST}/kernel.json"))
    with open(f"{INNER}/kernel.json", "w") as f:
        json.dump(dict(conf, ip=f"{INNER}/k"), f)
    ports = [conf[k] for k in CHANNELS]
    subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "launch.py"),
                      "-f", f"{INNER}/kernel.json"])
    sel = selectors.DefaultSelector()
    listeners = {}  # listening socket -> port
    pairs = {}      # connection -> the connection it is paired with
    pending = {"close": False, "open": True}
    signal.signal(signal.SIGUSR1, lambda *_: pending.update(open=True))
    signal.signal(signal.SIGUSR2, lambda *_: pending.update(close=True))

    def drop(s):
        peer = pairs.pop(s, None)
        for x in (s, peer):
            if x is None:
                continue
            pairs.pop(x, None)
            try:
                sel.unregister(x)
            except (KeyError, ValueError):
                pass
            x.close()

    def listen():
        while not all(os.path.exists(f"{INNER}/k-{p}") for p in ports):
            time.sleep(0.05)  # the kernel has not bound yet
        for p in ports:
            path = f"{HOST}/k-{p}"
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(16)
            s.setblocking(False)
            listeners[s] = p
            sel.register(s, selectors.EVENT_READ)
        log("listening on", len(listeners), "host sockets")

    def close_host():
        for s in list(listeners):
            sel.unregister(s)
            s.close()
        listeners.clear()
        for s in list(pairs):
            if s in pairs:
                drop(s)
        open(f"{HOST}/quiet", "w").close()
        log("every host socket closed")

    while True:
        if pending["close"]:
            pending["close"] = False
            close_host()
        if pending["open"]:
            pending["open"] = False
            try:
                os.unlink(f"{HOST}/quiet")
            except FileNotFoundError:
                pass
            listen()
        try:
            events = sel.select(0.2)
        except InterruptedError:
            continue
        for key, _ in events:
            s = key.fileobj
            if s in listeners:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    continue
                inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                inner.connect(f"{INNER}/k-{listeners[s]}")
                pairs[conn], pairs[inner] = inner, conn
                for x in (conn, inner):
                    x.setblocking(True)
                    sel.register(x, selectors.EVENT_READ)
            elif s in pairs:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    drop(s)
                    continue
                pairs[s].sendall(data)


main()
