"""A real cellblock session, driven as an agent would drive it, with the Python client.

Connects to a running `cellblock serve` (clients/python, package cellblock),
creates a session, uploads notebooks/data/orders_raw.csv, runs the code cells
of notebooks/walkthrough.ipynb one by one (clean, aggregate, plot, write the
results to /data/output), fetches the plot and the summary the code wrote and
checks them byte for byte against the digests the sandbox printed, shows what
the sandbox refuses and what the budget on each reply says, prints the audit
history and closes the session.
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import nbformat  # noqa: E402

import cellblock  # noqa: E402

REFUSALS = [
    ("who am I", "import os, socket\nprint(os.getuid(), socket.gethostname(), sorted(os.listdir('/')))"),
    ("host secrets", "open('/etc/shadow').read()"),
    ("network", "import socket\nprint(socket.if_nameindex())\nsocket.create_connection(('192.0.2.1', 80), timeout=3)"),
    ("become root", "os.setuid(0)"),
]


def show(title, code, r):
    print(f"\n--- {title}\n>>> " + code.replace("\n", "\n... "))
    for o in r.outputs:
        kind = o["output_type"]
        if kind == "stream":
            print(o["text"], end="")
        elif kind in ("execute_result", "display_data"):
            data = o["data"]
            if "image/png" in data:
                print(f"[image/png, {len(data['image/png']) * 3 // 4} bytes]")
            else:
                print(data.get("text/plain", ""))
        elif kind == "error":
            print(f"{o['ename']}: {o['evalue']}")
    b = r.budget
    print(f"[{r.status}; {b.get('wall_ms')} ms wall, {b.get('cpu_ms')} ms cpu, "
          f"{b.get('executions_left')} executions left, "
          f"peak {b.get('memory_peak_bytes', 0) / 2**20:.0f} MB]")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--cellblock", default=os.path.join(ROOT, "build", "bin", "cellblock"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    failures = 0

    with cellblock.connect(state_dir=args.state_dir) as server:
        info = server.info()
        pool = {name: f"{p.get('ready', 0)}/{p.get('target', 0)} warm"
                for name, p in info["pool"].items() if p and p.get("target")}
        print(f"cellblock {info['version']}: images {', '.join(sorted(info['images']))}; pool {pool}")
        t = time.monotonic()
        s = server.session(limits={"max_executions": 20, "exec_timeout_s": 60},
                           metadata={"who": "demo"})
        print(f"session {s.id} ({'warm' if s.warm else 'cold'}) ready in "
              f"{1000 * (time.monotonic() - t):.0f} ms")

        with open(os.path.join(ROOT, "notebooks", "data", "orders_raw.csv"), "rb") as f:
            print(f"uploaded to {s.put('orders_raw.csv', f.read())}")

        nb = nbformat.read(os.path.join(ROOT, "notebooks", "walkthrough.ipynb"), as_version=4)
        printed, title = {}, "cell"
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                title = cell.source.splitlines()[0].lstrip("# ")
                continue
            r = s.run(cell.source)
            show(title, cell.source, r)
            expect = cell.metadata.get("cellblock", {}).get("expect", {})
            failures += (r.error is None) != ("error" not in expect)
            printed.update(re.findall(r"^(\S+) \d+ ([0-9a-f]{64})$", r.stdout, re.MULTILINE))

        print("\n=== what the sandbox refuses")
        for title, code in REFUSALS:
            r = s.run(code)
            show(title, code, r)
            failures += (r.error is None) != (title == "who am I")

        print()
        for name in ("revenue_by_month.png", "region_summary.csv"):
            data = s.get(name)
            path = os.path.join(args.out, name)
            with open(path, "wb") as f:
                f.write(data)
            same = hashlib.sha256(data).hexdigest() == printed.get(name)
            print(f"fetched /data/output/{name}: {len(data)} bytes -> {path} "
                  f"({'identical to' if same else 'DIFFERENT from'} what the sandbox wrote)")
            failures += 0 if same else 1

        s.close()
        print()
        print(subprocess.run([args.cellblock, "history", s.id, "--state-dir", args.state_dir],
                             capture_output=True, text=True).stdout)
    if failures:
        raise SystemExit(f"{failures} step(s) did not behave as expected")


if __name__ == "__main__":
    main()
