"""Figure 12: the egress gateway (docs/network.md), against the same client
talking to the same local upstream directly, in the same run.

The client is one piece of Python (urllib, 1 MiB reads) run twice per
sample: inside a session (through the shim's forwarder and the gateway, as
every sandboxed request goes) and on the host with no proxy (the baseline).
Upstreams are this benchmark's own HTTP and HTTPS servers on 127.0.0.1; the
gateway reaches them through --egress-resolve pins and --egress-private.

- latency: one small GET (a new connection each, as the gateway serves one
  request per connection), median and p99 of many, for plain HTTP, HTTPS
  tunnelled untouched (CONNECT), and HTTPS the gateway terminates to add a
  secret. Target: ≤ 1 ms added at the median.
- throughput: a 100 MB download, the same three ways. Target: ≥ 0.8× direct.
"""
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from client import BenchError
from servers import CellblockServer
from stats import Row, summary

MB = 1 << 20
HOST = "up.cellblock.bench"  # tunnelled untouched
SECRET_HOST = "secret.cellblock.bench"  # the gateway terminates TLS and adds a header
CHUNK = b"x" * MB


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        size = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/bytes/") else 2
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Connection", "close")
        self.end_headers()
        left = size
        while left:
            n = min(left, len(CHUNK))
            self.wfile.write(CHUNK[:n])
            left -= n
        self.close_connection = True


def serve(cert=None, key=None):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.daemon_threads = True
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# Runs in the session and on the host alike; prints one JSON line.
CLIENT = r'''
import json, ssl, time, urllib.request
def run(url, n, proxied, verify, headers):
    handlers = [] if proxied else [urllib.request.ProxyHandler({})]
    ctx = ssl.create_default_context() if verify else ssl._create_unverified_context()
    handlers.append(urllib.request.HTTPSHandler(context=ctx))
    opener = urllib.request.build_opener(*handlers)
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with opener.open(urllib.request.Request(url, headers=headers), timeout=120) as r:
            size = 0
            while chunk := r.read(1 << 20):
                size += len(chunk)
        times.append(time.perf_counter() - t0)
    return {"times": times, "size": size}
'''


def client_call(url, n, proxied, verify, headers):
    return CLIENT + f"print(json.dumps(run({url!r}, {n}, {proxied!r}, {verify!r}, {headers!r})))"


def in_session(ch, url, n, verify, headers=None):
    ex = ch.execute(client_call(url, n, True, verify, headers or {}), timeout=900, keep_outputs=True)
    return json.loads(ex.stream_text().strip().splitlines()[-1])


def on_host(url, n, headers=None):
    # The names are pinned in the gateway only: the host's client uses the address.
    for name in (HOST, SECRET_HOST):
        url = url.replace(f"//{name}:", "//127.0.0.1:")
    code = client_call(url, n, False, False, headers or {})
    out = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True,
                         timeout=900, env={"PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise BenchError(f"host client: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def egress_figure(bench):
    work = tempfile.mkdtemp(prefix="cellblock-bench-egress-")
    cert, key = os.path.join(work, "up.pem"), os.path.join(work, "up.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "2", "-subj", f"/CN={HOST}", "-addext",
                    f"subjectAltName=DNS:{HOST},DNS:{SECRET_HOST}"],
                   check=True, capture_output=True)
    plain, tls = serve(), serve(cert, key)
    hp, sp = plain.server_address[1], tls.server_address[1]
    os.environ["CELLBLOCK_BENCH_TOKEN"] = "Bearer bench-token"
    args = ["--egress-allow", f"{HOST}:{hp}", "--egress-allow", f"{HOST}:{sp}",
            "--egress-allow", f"{SECRET_HOST}:{sp}",
            "--egress-resolve", f"{HOST}=127.0.0.1", "--egress-resolve", f"{SECRET_HOST}=127.0.0.1",
            "--egress-private", "127.0.0.1/32", "--egress-ca", cert, "--egress-no-dns",
            "--egress-secret", f"{SECRET_HOST}:Authorization=env:CELLBLOCK_BENCH_TOKEN"]
    rows = []
    try:
        with CellblockServer("egress", {"host": 1}, extra_args=args) as srv:
            secret = {"host": SECRET_HOST, "header": "Authorization",
                      "value_from": "env:CELLBLOCK_BENCH_TOKEN"}
            reply = srv.create({"limits": {"cpus": 2, "memory_mb": 2048, "network": {
                "mode": "gateway", "max_bytes": 64 << 30, "secrets": [secret]}}})
            ch = srv.open_channels(reply["connection"])
            try:
                ways = [
                    ("HTTP", f"http://{HOST}:{hp}", False),
                    ("HTTPS tunnelled (CONNECT)", f"https://{HOST}:{sp}", False),
                    ("HTTPS terminated, secret added", f"https://{SECRET_HOST}:{sp}", True),
                ]
                # Nine downloads each way: three swung 0.57-0.84x run to run.
                small_n, big_n = bench.n(200, 20), bench.n(9, 1)
                big = bench.n(100, 20) * MB
                for name, base, verify in ways:
                    # Direct, the client sends the header the gateway would add.
                    extra = {"Authorization": "Bearer bench-token"} if verify else {}
                    bench.log(f"egress: {name}: {small_n} small requests, {big_n}× {big // MB} MB")
                    # Interleaved: a batch through the gateway, a batch direct, ...
                    via, direct = [], []
                    batch = max(1, small_n // 10)
                    for _ in range(small_n // batch):
                        via += in_session(ch, f"{base}/small", batch, verify)["times"]
                        direct += on_host(f"{base}/small", batch, extra)["times"]
                    added = summary([t * 1000 for t in via])["median"] - \
                        summary([t * 1000 for t in direct])["median"]
                    rows.append(Row(
                        "12", f"Gateway: one small GET, {name} (new connection each)", "ms",
                        summary([t * 1000 for t in via]), summary([t * 1000 for t in direct]),
                        "the same client on the host, direct", target="≤ 1 ms added (median)",
                        met=added <= 1.0, note=f"added {added:.2f} ms at the median"))
                    via_mbs, direct_mbs = [], []
                    for _ in range(big_n):
                        r = in_session(ch, f"{base}/bytes/{big}", 1, verify)
                        if r["size"] != big:
                            raise BenchError(f"{name}: got {r['size']} of {big} bytes")
                        via_mbs.append(big / MB / r["times"][0])
                        d = on_host(f"{base}/bytes/{big}", 1, extra)
                        direct_mbs.append(big / MB / d["times"][0])
                    s_via, s_direct = summary(via_mbs), summary(direct_mbs)
                    ratio = s_via["median"] / s_direct["median"]
                    rows.append(Row(
                        "12", f"Gateway: {big // MB} MB download, {name}", "MB/s", s_via,
                        s_direct, "the same client on the host, direct", target="≥ 0.8× direct",
                        met=ratio >= 0.8, higher_is_better=True,
                        note=f"{ratio:.2f}× direct"))
            finally:
                ch.close()
                srv.close_session(reply["session_id"])
    finally:
        del os.environ["CELLBLOCK_BENCH_TOKEN"]
        for s in (plain, tls):
            s.shutdown()
            s.server_close()
        shutil.rmtree(work, ignore_errors=True)
    return rows
