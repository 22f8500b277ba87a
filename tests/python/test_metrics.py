"""`cellblock serve --metrics`: the endpoint scraped by the real thing.

A real server with its own state dir runs a known workload (two sessions,
cells that succeed, one that raises, one refused at the execution cap, a
file put, a message with a forged signature, a create for an image that
does not exist, both sessions closed, then a third killed past its memory
limit); then
`promtool check metrics` lints the scrape, Debian's `prometheus` scrapes the
endpoint every second and PromQL through its HTTP API returns the expected
counts. /healthz and /readyz answer with the right codes (readiness follows
--max-sessions), and clients that connect and send nothing do not slow a
session's 1+1. Everything stays on 127.0.0.1 on free ports.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import zmq

from server_helpers import run_ok, start_server, wait_for, execute

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(not PROMETHEUS or not PROMTOOL,
                                reason="Debian's prometheus (and promtool) is not installed "
                                       "(scripts/setup.sh)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, accept=None, timeout=5):
    """(status, headers, body text) of a GET."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics_address(srv):
    """The endpoint's address, from the server's log line."""
    def find():
        m = re.search(r"metrics: http://([0-9.]+:[0-9]+)/metrics", srv.log())
        return m.group(1) if m else None
    address = wait_for(find, timeout=10)
    assert address, f"no metrics line in the log:\n{srv.log()[-3000:]}"
    return address


def sample(text, name, **labels):
    """The value of one series in a 0.0.4 scrape (None when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if want
                     else rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(line.group(1)) if line else None


@pytest.fixture(scope="module")
def workload():
    """The server, its endpoint, and the counts the workload must show."""
    srv = start_server(["--metrics", "127.0.0.1:0", "--max-sessions", "2"])
    try:
        address = metrics_address(srv)
        yield srv, address
    finally:
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)


def test_health_and_readiness(workload):
    srv, address = workload
    # server.json (what start_server waits for) is written before the loop
    # starts: "not alive yet" until then, alive once it turns.
    assert wait_for(lambda: http_get(f"http://{address}/healthz")[0] == 200, timeout=30), \
        http_get(f"http://{address}/healthz")
    status, _, body = http_get(f"http://{address}/healthz")
    assert status == 200 and body.startswith("ok"), (status, body)
    status, _, body = http_get(f"http://{address}/readyz")
    assert status == 200, (status, body)
    # At --max-sessions the server takes no more: not ready, still alive.
    a, kc_a, _ = srv.open_session()
    b, kc_b, _ = srv.open_session()
    assert wait_for(lambda: http_get(f"http://{address}/readyz")[0] == 503, timeout=5), \
        http_get(f"http://{address}/readyz")
    assert "maximum of 2" in http_get(f"http://{address}/readyz")[2]
    assert http_get(f"http://{address}/healthz")[0] == 200
    for sid in (a, b):
        srv.ok("session_close_request", {"session_id": sid})
    srv.close_clients()
    assert wait_for(lambda: http_get(f"http://{address}/readyz")[0] == 200, timeout=5)
    # Anything else is refused with a proper code.
    assert http_get(f"http://{address}/nothing")[0] == 404
    request = urllib.request.Request(f"http://{address}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET, HEAD"


def test_silent_clients_do_not_stall_sessions(workload):
    srv, address = workload
    host, port = address.rsplit(":", 1)
    sid, kc, _ = srv.open_session()
    try:
        run_ok(kc, "1+1")  # warm
        silent = [socket.create_connection((host, int(port))) for _ in range(20)]
        try:
            start = time.monotonic()
            reply, _ = execute(kc, "1+1", timeout=10)
            took = time.monotonic() - start
            assert reply["content"]["status"] == "ok"
            assert took < 1.0, f"1+1 took {took:.3f} s while 20 clients hung on the endpoint"
            # The loop still ticks: healthz is fine once the silent ones are dropped or refused.
            for s in silent:
                s.close()
            assert wait_for(lambda: http_get(f"http://{address}/healthz")[0] == 200, timeout=10)
        finally:
            for s in silent:
                s.close()
    finally:
        srv.ok("session_close_request", {"session_id": sid})
        srv.close_clients()


def scrape_counts(srv, address):
    """Runs the known workload; returns what it adds to the counters."""
    before_status, _, before = http_get(f"http://{address}/metrics")
    assert before_status == 200

    def total(text, name, **labels):
        return sample(text, name, **labels) or 0.0

    # Session A: three executions allowed; two ok, one raises, the fourth is refused.
    a, kc_a, _ = srv.open_session(limits={"max_executions": 3})
    run_ok(kc_a, "1+1")
    reply, _ = execute(kc_a, "1/0")
    assert reply["content"]["status"] == "error"
    run_ok(kc_a, "2+2")
    reply, _ = execute(kc_a, "3+3")
    assert reply["content"]["ename"] == "ExecutionLimitExceeded", reply["content"]
    # Session B: two cells, and a message with a forged signature on its shell.
    b, kc_b, reply_b = srv.open_session()
    forged = zmq.Context.instance().socket(zmq.DEALER)
    forged.linger = 0
    conn = reply_b["connection"]
    forged.connect(f"tcp://{conn['ip']}:{conn['shell_port']}")
    header = json.dumps({"msg_id": "forged-1", "msg_type": "execute_request", "session": "x",
                         "username": "x", "date": "2026-11-27T00:00:00Z", "version": "5.3"})
    forged.send_multipart([b"<IDS|MSG>", b"0" * 64, header.encode(), b"{}", b"{}",
                           json.dumps({"code": "1"}).encode()])
    run_ok(kc_b, "x = 1")
    run_ok(kc_b, "print(x)")
    # 1000 bytes in through the manager socket.
    srv.ok("file_put_request", {"session_id": b, "path": "in.bin"}, buffers=[b"x" * 1000])
    # A create the server refuses.
    refused = srv.call("session_create_request", {"image": "no-such-image"})
    assert refused["content"]["ename"] == "UnknownImage"
    for sid in (a, b):
        srv.ok("session_close_request", {"session_id": sid})
    srv.close_clients()
    forged.close()
    # Session C: past its memory limit, killed by the cgroup.
    c, kc_c, _ = srv.open_session(limits={"memory_mb": 128})
    reply, _ = execute(kc_c, "hog = b'x' * (512 << 20)", timeout=120)
    assert reply["content"]["ename"] == "MemoryLimitExceeded", reply["content"]
    srv.close_clients()
    # Closes are counted as they happen, sessions by state within a second.
    time.sleep(1.5)
    status, headers, after = http_get(f"http://{address}/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    labels_ok = dict(image="host", outcome="ok", error="")
    labels_code = dict(image="host", outcome="error", error="code")
    labels_cap = dict(image="host", outcome="refused", error="ExecutionLimitExceeded")
    delta = {
        "ok": total(after, "cellblock_executions_total", **labels_ok)
        - total(before, "cellblock_executions_total", **labels_ok),
        "code": total(after, "cellblock_executions_total", **labels_code)
        - total(before, "cellblock_executions_total", **labels_code),
        "cap": total(after, "cellblock_executions_total", **labels_cap)
        - total(before, "cellblock_executions_total", **labels_cap),
        "file_in": total(after, "cellblock_file_transfer_bytes_total", direction="in",
                         via="manager")
        - total(before, "cellblock_file_transfer_bytes_total", direction="in", via="manager"),
        "memory": total(after, "cellblock_memory_kills_total", image="host")
        - total(before, "cellblock_memory_kills_total", image="host"),
        "forged": total(after, "cellblock_relay_dropped_messages_total", side="client",
                        reason="bad_signature")
        - total(before, "cellblock_relay_dropped_messages_total", side="client",
                reason="bad_signature"),
        "closed": total(after, "cellblock_session_closes_total", image="host",
                        reason="closed_by_request")
        - total(before, "cellblock_session_closes_total", image="host",
                reason="closed_by_request"),
    }
    assert delta == {"ok": 4, "code": 1, "cap": 1, "file_in": 1000, "memory": 1, "forged": 1,
                     "closed": 2}, delta
    assert sample(after, "cellblock_session_closes_total", image="host",
                  reason="memory_limit") >= 1
    assert sample(after, "cellblock_executions_total", image="host", outcome="error",
                  error="MemoryLimitExceeded") >= 1
    assert sample(after, "cellblock_session_creates_total", image="", outcome="UnknownImage") == 1
    assert (sample(after, "cellblock_sessions", image="host", state="idle") or 0) == 0
    assert sample(after, "process_resident_memory_bytes") > 1e6
    assert sample(after, "process_open_fds") > 5
    assert sample(after, "cellblock_pool_target", image="host") == 2
    return after


def test_workload_linted_and_queried_by_prometheus(workload, tmp_path):
    srv, address = workload
    text = scrape_counts(srv, address)

    # promtool lints the 0.0.4 text.
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert lint.returncode == 0, f"promtool check metrics:\n{lint.stdout}{lint.stderr}"

    # OpenMetrics when asked, ending with # EOF.
    status, headers, om = http_get(f"http://{address}/metrics",
                                   accept="application/openmetrics-text;version=1.0.0")
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.endswith("# EOF\n")
    assert "# TYPE cellblock_executions counter" in om

    # The real Prometheus scrapes every second and answers PromQL.
    web = f"127.0.0.1:{free_port()}"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "cellblock",
                            "static_configs": [{"targets": [address]}]}],
    }))
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address={web}", "--log.level=warn"],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        def query(promql):
            url = f"http://{web}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
            try:
                status, _, body = http_get(url, timeout=2)
            except (OSError, urllib.error.URLError):
                return None
            if status != 200:
                return None
            result = json.loads(body)["data"]["result"]
            return float(result[0]["value"][1]) if result else None

        def waits_for(promql, expected, timeout=30):
            got = wait_for(lambda: query(promql) == expected, timeout=timeout, interval=0.5)
            assert got, (f"{promql}: {query(promql)}, expected {expected}; prometheus log:\n"
                         + open(tmp_path / "prometheus.log", errors="replace").read()[-2000:])

        waits_for('up{job="cellblock"}', 1.0)
        waits_for('sum(cellblock_executions_total{outcome="error",error="code"})', 1.0)
        waits_for('sum(cellblock_executions_total{outcome="refused",'
                  'error="ExecutionLimitExceeded"})', 1.0)
        closes = query('sum(cellblock_session_closes_total{reason="closed_by_request"})')
        ok = query('sum(cellblock_executions_total{outcome="ok"})')
        # The earlier tests of this module closed sessions and ran cells too:
        # the scrape's own figures are the truth Prometheus must agree with.
        assert closes == sample(text, "cellblock_session_closes_total", image="host",
                                reason="closed_by_request"), closes
        assert ok == sample(text, "cellblock_executions_total", image="host", outcome="ok",
                            error=""), ok
        waits_for('sum(cellblock_session_creates_total{outcome="UnknownImage"})', 1.0)
        waits_for("sum(cellblock_memory_kills_total)",
                  sample(text, "cellblock_memory_kills_total", image="host"))
        waits_for('sum(cellblock_relay_dropped_messages_total{reason="bad_signature"})', 1.0)
        p99 = query('histogram_quantile(0.99, sum by (le) (cellblock_session_create_seconds_bucket))')
        assert p99 is not None and 0 < p99 <= 60, p99
        assert query("process_resident_memory_bytes") > 1e6
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(timeout=10)
        log.close()


def test_operations_doc_rules_and_configs_pass_promtool(tmp_path):
    """The alert rules and scrape configs docs/operations.md gives are valid."""
    source = os.environ.get("CELLBLOCK_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    with open(os.path.join(source, "docs", "operations.md")) as f:
        blocks = re.findall(r"```yaml\n(.*?)```", f.read(), re.S)
    rules = [b for b in blocks if b.startswith("groups:")]
    configs = [b for b in blocks if b.startswith("scrape_configs:")]
    assert len(rules) == 1 and len(configs) == 2, blocks
    path = tmp_path / "rules.yml"
    path.write_text(rules[0])
    checked = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for i, config in enumerate(configs):
        path = tmp_path / f"prometheus-{i}.yml"
        path.write_text(config)
        checked = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True,
                                 text=True, timeout=30)
        assert checked.returncode == 0, checked.stdout + checked.stderr
