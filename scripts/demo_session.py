"""A real cellblock session, driven as an agent would drive it.

Talks to a running `cellblock serve` through its manager socket with a plain
jupyter_client Session, creates a session, uploads a CSV, runs a short
analysis in the sandbox with BlockingKernelClient, fetches the plot the code
wrote, shows what the sandbox refuses and what the budget metadata says,
prints the audit history and closes the session.
"""
import argparse
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import time

import zmq
from jupyter_client import BlockingKernelClient
from jupyter_client.session import Session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Manager:
    def __init__(self, state_dir):
        info = json.load(open(os.path.join(state_dir, "server.json")))
        self.session = Session(key=info["key"].encode(), signature_scheme="hmac-sha256")
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.connect(info["manager"])

    def call(self, msg_type, content, buffers=None):
        self.session.send(self.socket, msg_type, content, buffers=buffers)
        if not self.socket.poll(120_000):
            raise SystemExit(f"no reply to {msg_type}")
        _, reply = self.session.recv(self.socket, mode=0)
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"{msg_type}: {reply['content']['ename']}: {reply['content']['evalue']}")
        return reply


def sample_csv():
    rng = random.Random(7)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["region", "month", "sales"])
    for month in range(1, 13):
        for region in ["north", "south", "east", "west"]:
            w.writerow([region, month, round(rng.gammavariate(2.0, 50.0), 2)])
    return out.getvalue().encode()


CELLS = [
    ("load", "import pandas as pd\ndf = pd.read_csv('/data/input/sales.csv')\nprint(df.shape)"),
    ("analyse", "summary = df.groupby('region')['sales'].agg(['count', 'sum', 'mean']).round(1)\nsummary"),
    ("plot", "import matplotlib.pyplot as plt, hashlib\n"
             "ax = summary['sum'].plot.bar(title='sales by region')\n"
             "plt.savefig('/data/output/sales.png'); plt.show()\n"
             "print('sha256', hashlib.sha256(open('/data/output/sales.png','rb').read()).hexdigest())"),
    ("who am I", "import os, socket; print(os.getuid(), socket.gethostname(), sorted(os.listdir('/')))"),
    ("host secrets", "open('/etc/shadow').read()"),
    ("network", "import socket; print(socket.if_nameindex()); print(repr(open('/proc/net/route').read()))"),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--out", default="demo-output")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    manager = Manager(args.state_dir)
    info = manager.call("server_info_request", {})["content"]
    print(f"cellblock {info['version']}: images {info['images']}, pool {info['pool']}")

    t = time.monotonic()
    created = manager.call("session_create_request",
                           {"limits": {"max_executions": 20, "exec_timeout_s": 60},
                            "metadata": {"who": "demo"}})["content"]
    sid = created["session_id"]
    kc = BlockingKernelClient()
    kc.load_connection_info(created["connection"])
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    print(f"session {sid} ({'warm' if created['warm'] else 'cold'}) ready in "
          f"{1000 * (time.monotonic() - t):.0f} ms")

    data = sample_csv()
    put = manager.call("file_put_request", {"session_id": sid, "path": "sales.csv"}, buffers=[data])
    print(f"uploaded {put['content']['size']} bytes to {put['content']['path']}")

    failures = 0
    reported_sha = None
    for title, code in CELLS:
        print(f"\n--- {title}\n>>> " + code.replace("\n", "\n... "))
        def show(msg):
            nonlocal reported_sha
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                print(content["text"], end="")
                for line in content["text"].splitlines():
                    if line.startswith("sha256 "):
                        reported_sha = line.split()[1]
            elif kind in ("execute_result", "display_data"):
                data = content["data"]
                print("[image/png]" if "image/png" in data else data.get("text/plain", ""))
            elif kind == "error":
                print(f"{content['ename']}: {content['evalue']}")
        reply = kc.execute_interactive(code, timeout=120, output_hook=show)
        budget = reply["metadata"].get("cellblock", {})
        status = reply["content"]["status"]
        print(f"[{status}; {budget.get('wall_ms')} ms, {budget.get('executions_left')} executions left, "
              f"peak {budget.get('memory_peak_bytes', 0) / 2**20:.0f} MB]")
        if (status == "ok") == (title == "host secrets"):
            failures += 1

    got = manager.call("file_get_request", {"session_id": sid, "path": "sales.png"})
    png = got["buffers"][0]
    path = os.path.join(args.out, "sales.png")
    with open(path, "wb") as f:
        f.write(png)
    same = hashlib.sha256(png).hexdigest() == reported_sha
    print(f"\nfetched /data/output/sales.png: {len(png)} bytes -> {path} "
          f"({'identical to' if same else 'DIFFERENT from'} what the sandbox wrote)")
    failures += 0 if same else 1

    kc.stop_channels()
    manager.call("session_close_request", {"session_id": sid})
    print()
    print(subprocess.run([os.path.join(ROOT, "build", "bin", "cellblock"), "history", sid,
                          "--state-dir", args.state_dir], capture_output=True, text=True).stdout)
    if failures:
        raise SystemExit(f"{failures} step(s) did not behave as expected")


if __name__ == "__main__":
    main()
