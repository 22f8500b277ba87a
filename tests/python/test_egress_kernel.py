"""The egress gateway in kernel mode (docs/network.md, "Kernel mode"): a
kernelspec installed with the --egress-* flags and network.mode gateway gives
a `cellblock kernel` started by jupyter_client the same way out as a `serve`
session — an allowlist, the explaining 403, only `lo` inside, the bytes in
metadata.cellblock — and one gateway process that ends with the kernel.

Upstreams are this test's own servers on 127.0.0.1, opted in with
--egress-private 127.0.0.1/32; names are pinned with --egress-resolve and
--egress-no-dns keeps any name from reaching a DNS server.
"""
import http.server
import json
import os
import signal
import subprocess
import tempfile
import threading

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from server_helpers import children_running, execute, proc_state, run_ok, wait_for

CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
API = "api.cellblock.test"
GATEWAY = 'network={"mode": "gateway"}'

FETCH = r'''
import json, urllib.request, urllib.error
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return {"status": r.status, "body": r.read().decode("latin-1")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode("latin-1")}
'''


class Upstream(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def upstream_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def install(prefix, *args, name="cb-egress"):
    """`cellblock kernelspec install --prefix PREFIX ARGS...`; the CompletedProcess."""
    return subprocess.run([CELLBLOCK_BIN, "kernelspec", "install", "--prefix", prefix,
                           "--name", name, *args], capture_output=True, text=True, timeout=30)


def egress_flags(port):
    return ["--egress-allow", f"{API}:{port}", "--egress-resolve", f"{API}=127.0.0.1",
            "--egress-private", "127.0.0.1/32", "--egress-no-dns"]


@pytest.fixture
def kernel(tmp_path):
    """start(*install_args) -> (km, kc, log path) for a kernelspec installed with them."""
    started = []

    def start(*args):
        prefix = tempfile.mkdtemp(prefix="cellblock-kspec-", dir=tmp_path)
        result = install(prefix, *args)
        assert result.returncode == 0, result.stderr
        ksm = KernelSpecManager(kernel_dirs=[os.path.join(prefix, "share", "jupyter", "kernels")])
        km = KernelManager(kernel_name="cb-egress", kernel_spec_manager=ksm)
        log = tmp_path / f"kernel-{len(started)}.log"
        log_file = open(log, "w")
        km.start_kernel(stderr=log_file)
        kc = km.client()
        kc.start_channels()
        started.append((km, kc, log_file))
        kc.wait_for_ready(timeout=60)
        return km, kc, log

    yield start
    for km, kc, log_file in started:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        log_file.close()


def fetch(kc, url):
    out = run_ok(kc, FETCH + f"print(json.dumps(fetch({url!r})))")
    return json.loads(out.strip().splitlines()[-1])


def egress_events(log):
    """The gateway's events the kernel logged (`session ID: egress {json}`)."""
    events = []
    for line in log.read_text().splitlines():
        if ": egress {" in line:
            events.append(json.loads(line.split(": egress ", 1)[1]))
    return events


def gateway_children(pid):
    """Pids of cellblock-gateway processes whose parent is `pid`."""
    return children_running(pid, "/cellblock-gateway")


def test_a_gateway_kernel_reaches_its_allowlist_and_nothing_else(kernel, upstream_port):
    km, kc, log = kernel("--limit", GATEWAY, *egress_flags(upstream_port))
    got = fetch(kc, f"http://{API}:{upstream_port}/echo?from=kernel")
    assert got["status"] == 200 and json.loads(got["body"])["path"] == "/echo?from=kernel", got
    refused = fetch(kc, f"http://other.cellblock.test:{upstream_port}/")
    assert refused["status"] == 403, refused
    assert f"other.cellblock.test:{upstream_port} is not in this session's allowlist" \
        in refused["body"], refused
    # Loopback stays refused unless opted in: 127.0.0.2 is not.
    assert fetch(kc, f"http://127.0.0.2:{upstream_port}/")["status"] == 403
    events = wait_for(lambda: len(egress_events(log)) >= 3 and egress_events(log), timeout=30)
    assert events, log.read_text()[-3000:]
    assert events[0]["verdict"] == "allowed" and events[0]["status"] == 200, events
    assert (events[0]["host"], events[0]["port"]) == (API, upstream_port), events
    assert [e["verdict"] for e in events[1:3]] == ["refused", "refused"], events
    # The reply's metadata counts what the gateway counted.
    used = sum(e.get("bytes_up", 0) + e.get("bytes_down", 0) for e in events)
    reply, _ = execute(kc, "1")
    meta = reply["metadata"]["cellblock"]
    assert meta["network_bytes_used"] == used and used > 0, (meta, events)
    # Still only lo inside, no route, and the upstream not reachable directly.
    inside = json.loads(run_ok(kc, f'''
import os, socket, json
try:
    socket.create_connection(("127.0.0.1", {upstream_port}), timeout=5)
    direct = "connected"
except OSError as e:
    direct = type(e).__name__
print(json.dumps({{"net": sorted(os.listdir("/sys/class/net")),
                  "routes": open("/proc/net/route").read().splitlines()[1:],
                  "direct": direct}}))
''').strip().splitlines()[-1])
    assert inside == {"net": ["lo"], "routes": [], "direct": "ConnectionRefusedError"}, inside


def test_the_gateway_is_the_kernels_restarts_and_ends_with_it(kernel, upstream_port):
    km, kc, _ = kernel("--limit", GATEWAY, *egress_flags(upstream_port))
    kernel_pid = km.provisioner.process.pid
    gateways = gateway_children(kernel_pid)
    assert len(gateways) == 1, gateways
    with open(f"/proc/{gateways[0]}/status") as f:
        uid = next(line for line in f if line.startswith("Uid:")).split()[1]
    assert uid != "0", "the gateway must not run as root"
    # A killed gateway is started again with the kernel's listener.
    os.kill(gateways[0], signal.SIGKILL)
    again = wait_for(lambda: [p for p in gateway_children(kernel_pid) if p != gateways[0]],
                     timeout=30)
    assert again, "the gateway was not started again"
    got = fetch(kc, f"http://{API}:{upstream_port}/after-restart")
    assert got["status"] == 200, got
    km.shutdown_kernel(now=False)
    assert wait_for(lambda: not os.path.exists(f"/proc/{again[0]}"), timeout=30), \
        f"gateway {again[0]} outlived its kernel"


def test_a_kernel_that_does_not_ask_for_the_network_has_none(kernel, upstream_port):
    # The flags allow a gateway; this kernel's limits do not ask for one.
    km, kc, log = kernel(*egress_flags(upstream_port))
    got = fetch(kc, f"http://{API}:{upstream_port}/")
    assert got["status"] == 403 and "no network access" in got["body"], got
    assert gateway_children(km.provisioner.process.pid) == []
    reply, _ = execute(kc, "1")
    assert "network_bytes_used" not in reply["metadata"]["cellblock"], reply["metadata"]


def test_kernelspec_install_refuses_what_the_kernel_would_refuse(tmp_path, upstream_port):
    prefix = str(tmp_path)
    result = install(prefix, "--limit", GATEWAY)
    assert result.returncode != 0
    assert "LimitAboveMaximum" in result.stderr or "gateway" in result.stderr, result.stderr
    result = install(prefix, "--egress-private", "127.0.0.1/32")
    assert result.returncode != 0 and "need a gateway" in result.stderr, result.stderr
    result = install(prefix, "--egress-allow", "not a pattern")
    assert result.returncode != 0 and "--egress-allow not a pattern" in result.stderr, \
        result.stderr
    result = install(prefix, "--provisioner", *egress_flags(upstream_port))
    assert result.returncode != 0 and "--provisioner" in result.stderr, result.stderr
    result = install(prefix, "--limit", GATEWAY, *egress_flags(upstream_port))
    assert result.returncode == 0, result.stderr
    with open(os.path.join(prefix, "share", "jupyter", "kernels", "cb-egress",
                           "kernel.json")) as f:
        argv = json.load(f)["argv"]
    assert argv[argv.index("--egress-allow") + 1] == f"{API}:{upstream_port}", argv
    assert "--egress-no-dns" in argv and f"{API}=127.0.0.1" in argv, argv


def test_a_killed_kernel_takes_its_gateway_with_it(kernel, upstream_port):
    km, kc, _ = kernel("--limit", GATEWAY, *egress_flags(upstream_port))
    kernel_pid = km.provisioner.process.pid
    (gateway,) = gateway_children(kernel_pid)
    os.kill(kernel_pid, signal.SIGKILL)
    km.provisioner.process.wait(timeout=30)
    # Its parent's death kills it (PR_SET_PDEATHSIG); it is then reaped by init.
    assert wait_for(lambda: proc_state(gateway) in (None, "Z"), timeout=30), \
        f"gateway {gateway} outlived its killed kernel"
