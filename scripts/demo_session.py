"""A real cellblock session, as an agent would drive it with jupyter_client.

Starts the cellblock-python kernel (a runc-sandboxed ipykernel), runs a small
multi-step analysis, saves the plot it returns, shows what the sandbox
refuses, and shuts down. Prints a transcript.
"""
import argparse
import base64
import os
import time

from jupyter_client.manager import KernelManager

CELLS = [
    ("state", "import numpy as np, pandas as pd\n"
              "rng = np.random.default_rng(7)\n"
              "df = pd.DataFrame({'region': rng.choice(['north', 'south', 'east'], 300),\n"
              "                   'sales': rng.gamma(2.0, 50.0, 300).round(2)})\n"
              "print(len(df), 'rows')"),
    ("analysis", "summary = df.groupby('region')['sales'].agg(['count', 'mean']).round(1)\nsummary"),
    ("plot", "import matplotlib.pyplot as plt\n"
             "summary['mean'].plot.bar(title='mean sales by region'); plt.show()"),
    ("who am I", "import os, socket; print(os.getuid(), socket.gethostname(), os.listdir('/'))"),
    ("host secrets", "open('/etc/shadow').read()"),
    ("network", "import socket; print(socket.if_nameindex()); print(open('/proc/net/route').read())"),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="demo-output")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    started = time.monotonic()
    km = KernelManager(kernel_name="cellblock-python")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    print(f"session ready in {time.monotonic() - started:.2f} s (cold start, runc + ipykernel)")

    failures = 0
    for title, code in CELLS:
        print(f"\n--- {title}\n>>> " + code.replace("\n", "\n... "))
        def show(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                print(content["text"], end="")
            elif kind in ("execute_result", "display_data"):
                data = content["data"]
                if "image/png" in data:
                    path = os.path.join(args.out, "plot.png")
                    with open(path, "wb") as f:
                        f.write(base64.b64decode(data["image/png"]))
                    print(f"[image/png, {os.path.getsize(path)} bytes, saved to {path}]")
                else:
                    print(data.get("text/plain", ""))
            elif kind == "error":
                print(f"{content['ename']}: {content['evalue']}")
        t = time.monotonic()
        reply = kc.execute_interactive(code, timeout=60, output_hook=show)
        status = reply["content"]["status"]
        print(f"[{status} in {1000 * (time.monotonic() - t):.0f} ms]")
        expected_error = title == "host secrets"
        if (status == "ok") == expected_error:
            failures += 1

    kc.stop_channels()
    km.shutdown_kernel()
    print("\nsession closed; sandbox destroyed")
    if failures:
        raise SystemExit(f"{failures} cell(s) did not behave as expected")


if __name__ == "__main__":
    main()
