"""The egress gateway (docs/network.md), end to end: a real `cellblock serve`
with --egress-allow, real sandboxes whose code uses urllib and raw sockets
through the shim's forwarder on 127.0.0.1:3128, and upstream servers of this
test on 127.0.0.1 only.

Nothing here leaves the machine. The names the sessions ask for
(*.cellblock.test) are pinned by --egress-resolve, so the gateway never asks
a DNS server; the one loopback address the tests' upstreams use is opted in
with --egress-private 127.0.0.1/32, and the refusal of reserved addresses is
shown with a name pinned to 127.0.0.2, which nothing listens on and which
the gateway must refuse before connecting.
"""
import http.server
import json
import os
import shutil
import signal
import socket
import socketserver
import threading

import pytest

import server_helpers as sh
from server_helpers import execute, server_factory, wait_for  # noqa: F401

API = "api.cellblock.test"
TUNNEL = "tunnel.cellblock.test"
RESERVED = "reserved.cellblock.test"  # pinned to 127.0.0.2: loopback, not opted in


class Upstream(http.server.BaseHTTPRequestHandler):
    """Answers GET /echo with what it received and GET /big with 200 KB."""
    seen = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        Upstream.seen.append({"path": self.path, "headers": dict(self.headers.items())})
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("to=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = (b"x" * 200_000 if self.path.startswith("/big")
                else json.dumps(Upstream.seen[-1]).encode())
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        Upstream.seen.append({"path": self.path, "headers": dict(self.headers.items())})
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data.upper())


@pytest.fixture(scope="module")
def upstreams():
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    echo_server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    echo_server.daemon_threads = True
    for s in (http_server, echo_server):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield http_server.server_address[1], echo_server.server_address[1]
    for s in (http_server, echo_server):
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def gw(upstreams):
    http_port, echo_port = upstreams
    srv = sh.start_server([
        "--pool", "host=1",
        "--egress-allow", f"{API}:{http_port}",
        "--egress-allow", f"{TUNNEL}:{echo_port}",
        "--egress-allow", f"*.cellblock.test:{http_port}",
        "--egress-resolve", f"{API}=127.0.0.1",
        "--egress-resolve", f"{TUNNEL}=127.0.0.1",
        "--egress-resolve", f"{RESERVED}=127.0.0.2",
        "--egress-private", "127.0.0.1/32",
        # Nothing here may ask a DNS server: names not pinned do not resolve.
        "--egress-no-dns",
    ])
    srv.http_port, srv.echo_port = http_port, echo_port
    yield srv
    problems = srv.shutdown()
    assert not problems, "\n".join(problems)


run = sh.run_ok  # executes code that must succeed; its stdout


# Fetches a URL through the environment's proxy settings and prints
# {"status", "body"} whether the answer is a success or an HTTP error.
FETCH = r'''
import json, urllib.request, urllib.error
def fetch(url, data=None):
    try:
        with urllib.request.urlopen(url, data=data, timeout=30) as r:
            return {"status": r.status, "body": r.read().decode("latin-1")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode("latin-1")}
'''


def fetch(kc, url, data=None):
    out = run(kc, FETCH + f"print(json.dumps(fetch({url!r}, {data!r})))")
    return json.loads(out.strip().splitlines()[-1])


def gateway_session(srv, allow=None, **network):
    network = {"mode": "gateway", **network}
    if allow is not None:
        network["allow"] = allow
    return srv.open_session(limits={"network": network})


def egress_events(srv, sid):
    history = srv.ok("session_history_request", {"session_id": sid})["content"]
    return [json.loads(e["detail"]) for e in history["events"] if e["kind"] == "egress"]


def gateway_pid(srv):
    found = sh.children_running(srv.proc.pid, "/cellblock-gateway")
    return found[0] if found else None


def test_http_request_reaches_an_allowed_host_through_the_gateway(gw):
    sid, kc, reply = gateway_session(gw)
    assert reply["limits"]["network"]["mode"] == "gateway"
    got = fetch(kc, f"http://{API}:{gw.http_port}/echo?x=1")
    assert got["status"] == 200, got
    seen = json.loads(got["body"])
    assert seen["path"] == "/echo?x=1", seen
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["host"] == f"{API}:{gw.http_port}", headers
    assert headers["connection"] == "close", headers
    assert "proxy-connection" not in headers, headers
    posted = fetch(kc, f"http://{API}:{gw.http_port}/post", data=b"abc")
    assert posted == {"status": 201, "body": "cba"}, posted
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 2 and egress_events(gw, sid))
    first = events[0]
    assert first["verdict"] == "allowed" and first["status"] == 200, first
    assert (first["host"], first["port"], first["method"]) == (API, gw.http_port, "GET"), first
    assert first["bytes_down"] > len(got["body"]) and first["bytes_up"] > 0, first


def test_a_host_outside_the_allowlist_gets_403_saying_why(gw):
    sid, kc, _ = gateway_session(gw, allow=[f"{API}:{gw.http_port}"])
    got = fetch(kc, f"http://other.cellblock.test:{gw.http_port}/")
    assert got["status"] == 403, got
    assert f"other.cellblock.test:{gw.http_port} is not in this session's allowlist" in got["body"]
    # Another port of an allowed host is another entry.
    got = fetch(kc, f"http://{API}:{gw.echo_port}/")
    assert got["status"] == 403 and "allowlist" in got["body"], got
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 2 and egress_events(gw, sid))
    assert all(e["verdict"] == "refused" and e["status"] == 403 for e in events), events


def test_a_name_that_resolves_to_a_reserved_address_is_refused(gw):
    sid, kc, _ = gateway_session(gw)
    got = fetch(kc, f"http://{RESERVED}:{gw.http_port}/")
    assert got["status"] == 403, got
    tail = ("; the gateway does not connect to private, loopback, link-local or metadata "
            "addresses")
    assert (f"cellblock: {RESERVED} resolves to 127.0.0.2, a loopback address (127.0.0.0/8)"
            + tail) in got["body"], got
    # An IP literal is refused too (here by the allowlist, which names no
    # address; the reserved-range sentence for a literal is unit-tested).
    got = fetch(kc, f"http://127.0.0.2:{gw.http_port}/")
    assert got["status"] == 403, got


def test_connect_tunnels_bytes_both_ways(gw):
    sid, kc, _ = gateway_session(gw)
    out = run(kc, f'''
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(b"CONNECT {TUNNEL}:{gw.echo_port} HTTP/1.1\\r\\nHost: {TUNNEL}:{gw.echo_port}\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
print(head.split(b"\\r\\n")[0].decode())
s.sendall(b"hello tunnel")
got = b""
while len(got) < 12:
    got += s.recv(100)
print(got.decode())
s.close()
''')
    assert out.split() == ["HTTP/1.1", "200", "Connection", "established", "HELLO", "TUNNEL"], out
    events = wait_for(lambda: egress_events(gw, sid))
    assert events[0]["method"] == "CONNECT" and events[0]["verdict"] == "allowed", events
    assert events[0]["bytes_up"] == 12 and events[0]["bytes_down"] == 12, events


def test_the_sandbox_still_has_only_lo_and_no_route_to_the_host(gw):
    sid, kc, _ = gateway_session(gw)
    out = run(kc, f'''
import os, socket, json
try:
    socket.create_connection(("127.0.0.1", {gw.http_port}), timeout=5)
    direct = "connected"
except OSError as e:
    direct = type(e).__name__
print(json.dumps({{"net": sorted(os.listdir("/sys/class/net")),
                  "routes": open("/proc/net/route").read().splitlines()[1:],
                  "direct": direct}}))
''')
    inside = json.loads(out.strip().splitlines()[-1])
    assert inside["net"] == ["lo"], inside
    assert inside["routes"] == [], inside
    # The host's listener is not reachable except through the gateway.
    assert inside["direct"] == "ConnectionRefusedError", inside


def test_a_session_without_the_gateway_is_told_it_has_no_network(gw):
    sid, kc, reply = gw.open_session()
    assert reply["limits"]["network"]["mode"] == "none"
    got = fetch(kc, f"http://{API}:{gw.http_port}/echo")
    assert got["status"] == 403, got
    assert "no network access" in got["body"], got
    assert not os.path.exists(os.path.join(gw.state_dir, "sessions", sid, "ipc", "egress.sock"))
    assert egress_events(gw, sid) == []


def test_a_session_cannot_widen_the_servers_allowlist(gw):
    reply = gw.call("session_create_request", {"limits": {"network": {
        "mode": "gateway", "allow": ["pypi.org:443"]}}})["content"]
    assert reply["status"] == "error" and reply["ename"] == "LimitAboveMaximum", reply
    assert "not within the server's allowlist" in reply["evalue"], reply
    reply = gw.call("session_create_request", {"limits": {"network": {
        "mode": "gateway", "allow": ["*.test:*"]}}})["content"]
    assert reply["ename"] == "LimitAboveMaximum", reply
    reply = gw.call("session_create_request", {"limits": {"network": {
        "mode": "anything"}}})["content"]
    assert reply["ename"] == "InvalidLimits", reply


def test_a_server_without_egress_allow_refuses_the_gateway(server_factory):
    srv = server_factory(["--pool", "host=0"])
    reply = srv.call("session_create_request",
                     {"limits": {"network": {"mode": "gateway"}}})["content"]
    assert reply["ename"] == "LimitAboveMaximum", reply
    assert "--egress-allow" in reply["evalue"], reply
    assert gateway_pid(srv) is None


def test_the_byte_cap_cuts_a_connection_and_refuses_the_next(gw):
    sid, kc, _ = gateway_session(gw, max_bytes=50_000)
    got = run(kc, FETCH + f'''
try:
    r = fetch("http://{API}:{gw.http_port}/big")
    print("status", r["status"], len(r["body"]))
except Exception as e:
    print("cut", type(e).__name__)
''')
    assert "cut" in got or ("status 200" in got and "200000" not in got), got
    again = fetch(kc, f"http://{API}:{gw.http_port}/echo")
    assert again["status"] == 403 and "network.max_bytes" in again["body"], again
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 2 and egress_events(gw, sid))
    assert events[0]["verdict"] == "cut", events
    assert events[0]["bytes_down"] + events[0]["bytes_up"] <= 50_000, events


def test_malformed_requests_get_an_error_and_the_gateway_keeps_serving(gw):
    sid, kc, _ = gateway_session(gw)
    out = run(kc, r'''
import socket
def ask(data):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(data)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return got.split(b"\r\n")[0].decode(), got.split(b"\r\n\r\n", 1)[-1].decode()
for data in (b"GARBAGE\r\n\r\n",
             b"GET http://x.cellblock.test/ HTTP/1.1\r\n" + b"X-Long: " + b"a" * 20000 + b"\r\n\r\n",
             b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
             b"GET https://x.cellblock.test/ HTTP/1.1\r\n\r\n",
             b"GET http://x.cellblock.test/ HTTP/2.0\r\n\r\n"):
    line, body = ask(data)
    print(line, "|", body.strip())
''')
    lines = out.strip().splitlines()
    assert len(lines) == 5, out
    assert lines[0].startswith("HTTP/1.1 400"), lines
    assert lines[1].startswith("HTTP/1.1 431"), lines
    assert lines[2].startswith("HTTP/1.1 400") and "absolute" in lines[2], lines
    assert lines[3].startswith("HTTP/1.1 400") and "CONNECT" in lines[3], lines
    assert lines[4].startswith("HTTP/1.1 505"), lines
    assert all("| cellblock: " in line for line in lines), lines
    assert fetch(kc, f"http://{API}:{gw.http_port}/echo")["status"] == 200


def test_the_gateway_runs_unprivileged_under_seccomp(gw):
    pid = gateway_pid(gw)
    assert pid, "no cellblock-gateway child of the server"
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    assert status["Uid"].split() == ["65534"] * 4, status["Uid"]
    assert status["Gid"].split() == ["65534"] * 4, status["Gid"]
    assert status["CapEff"].strip() == "0000000000000000", status["CapEff"]
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"
    # Not at the relay's priority (the server's loop runs at nice -10): it
    # works on bytes the sessions choose and must not outrank them.
    assert sh.process_nice(pid) >= 0, sh.process_nice(pid)
    # It holds none of the server's files: the database, the state dir, the manager socket.
    fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert not [f for f in fds if "cellblock.db" in f or f.startswith(gw.state_dir + "/")], fds
    # Its stderr is the server's log; the rest are sockets (control, listeners).
    assert all(f.startswith("socket:") or f in ("/dev/null", gw.log_path) for f in fds), fds


def test_a_killed_gateway_is_started_again_with_its_sessions(gw):
    sid, kc, _ = gateway_session(gw)
    assert fetch(kc, f"http://{API}:{gw.http_port}/echo")["status"] == 200
    old = gateway_pid(gw)
    os.kill(old, signal.SIGKILL)
    new = wait_for(lambda: (gateway_pid(gw) or 0) not in (0, old) and gateway_pid(gw), timeout=20)
    assert new and new != old
    assert sh.process_nice(new) >= 0, sh.process_nice(new)  # started again from the relay's thread
    assert fetch(kc, f"http://{API}:{gw.http_port}/echo")["status"] == 200
    assert "egress gateway" in gw.log() and "starting it again" in gw.log()
    # The server follows the new gateway's events: the request after the
    # restart is in the session's audit like the one before.
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 2 and egress_events(gw, sid))
    assert events, egress_events(gw, sid)
    assert [e["status"] for e in events] == [200, 200], events


def test_closing_a_session_closes_its_way_out(gw):
    sid, kc, _ = gateway_session(gw)
    sock = os.path.join(gw.state_dir, "sessions", sid, "ipc", "egress.sock")
    assert os.path.exists(sock)
    assert wait_for(lambda: gateway_holds(gateway_pid(gw), sock))
    gw.ok("session_close_request", {"session_id": sid})
    sh.assert_session_gone(gw.state_dir, sid)
    assert not os.path.exists(sock)
    # The gateway holds no listener of a closed session.
    assert wait_for(lambda: not gateway_holds(gateway_pid(gw), sock))


def gateway_holds(pid, path):
    """Whether process `pid` has the unix socket bound at `path` open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and fields[6] in inodes:
                return True
    return False


def test_requests_and_the_reply_metadata_count_the_bytes(gw):
    sid, kc, _ = gateway_session(gw)
    out = run(kc, f"""
import requests
r = requests.get("http://{API}:{gw.http_port}/echo?via=requests", timeout=30)
print(r.status_code, r.json()["path"])
""")
    assert out.split() == ["200", "/echo?via=requests"], out
    events = wait_for(lambda: egress_events(gw, sid))
    used = sum(e["bytes_up"] + e["bytes_down"] for e in events)
    reply, _ = execute(kc, "1")
    meta = reply["metadata"]["cellblock"]
    assert meta["network_bytes_used"] == used and used > 0, (meta, events)
    assert meta["network_max_bytes"] == 1 << 30, meta
    # A session without the gateway has no network figures.
    _, plain, _ = gw.open_session()
    reply, _ = execute(plain, "1")
    assert "network_bytes_used" not in reply["metadata"]["cellblock"], reply["metadata"]


def test_a_redirect_to_a_refused_host_is_refused(gw):
    sid, kc, _ = gateway_session(gw, allow=[f"{API}:{gw.http_port}"])
    target = f"http://evil.cellblock.test:{gw.http_port}/"
    got = fetch(kc, f"http://{API}:{gw.http_port}/redirect?to={target}")
    assert got["status"] == 403, got
    assert f"evil.cellblock.test:{gw.http_port} is not in this session's allowlist" in got["body"]


def test_one_request_per_connection_nothing_smuggled_behind_it(gw):
    sid, kc, _ = gateway_session(gw)
    before = len(Upstream.seen)
    out = run(kc, rf"""
import socket
def ask(data):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(data)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return got.split(b"\r\n")[0].decode()
smuggled = b"GET http://{API}:{gw.http_port}/smuggled HTTP/1.1\r\nHost: {API}:{gw.http_port}\r\n\r\n"
print(ask(b"POST http://{API}:{gw.http_port}/post HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" + smuggled))
print(ask(b"POST http://{API}:{gw.http_port}/post HTTP/1.1\r\nContent-Length: 5\r\n"
          b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled))
""")
    lines = out.strip().splitlines()
    assert lines[0].startswith("HTTP/1.") and " 201 " in lines[0], lines
    assert lines[1].startswith("HTTP/1.1 400"), lines
    paths = [seen["path"] for seen in Upstream.seen[before:]]
    assert paths == ["/post"], paths
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 2 and egress_events(gw, sid))
    assert any("dropped" in e["reason"] for e in events), events
    assert any("ambiguous" in e["reason"] for e in events), events


def test_a_slow_head_is_cut_at_the_request_timeout(gw):
    sid, kc, _ = gateway_session(gw, request_timeout_s=1.5)
    out = run(kc, r"""
import socket, time
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
start = time.monotonic()
answer = b""
try:
    for byte in b"GET http://slow.cellblock.test/ HTTP/1.1\r\nX-Slow: " + b"a" * 100:
        s.send(bytes([byte]))
        time.sleep(0.2)
        s.setblocking(False)
        try:
            answer += s.recv(4096)
        except BlockingIOError:
            pass
        s.setblocking(True)
        if answer:
            break
except OSError:
    pass
print(answer.split(b"\r\n")[0].decode(), round(time.monotonic() - start))
""")
    line, seconds = out.strip().rsplit(" ", 1)
    assert line.startswith("HTTP/1.1 408"), out
    assert int(seconds) < 10, out


def test_a_connection_flood_holds_only_the_sessions_cap(gw):
    """10,000 connections to one session's socket, none sending a byte."""
    sid, kc, _ = gateway_session(gw, max_connections=4)
    _, other, _ = gateway_session(gw)
    sock_path = os.path.join(gw.state_dir, "sessions", sid, "ipc", "egress.sock")
    pid = gateway_pid(gw)
    threads_before = int(status_of(pid)["Threads"])
    held = []
    try:
        for _ in range(10_000):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock_path)  # blocking: a full backlog waits for the gateway's accept
            c.settimeout(10)
            held.append(c)
        # Beyond the cap, connections are answered 429 at once, unread.
        refused = held[-1].recv(4096)
        assert refused.startswith(b"HTTP/1.1 429"), refused
        assert b"network.max_connections" in refused, refused
        threads = int(status_of(pid)["Threads"])
        assert threads <= threads_before + 4, (threads_before, threads)
        # Another session is served meanwhile.
        assert fetch(other, f"http://{API}:{gw.http_port}/echo")["status"] == 200
    finally:
        for c in held:
            c.close()
    # The audit did not get a row per refused connection.
    events = wait_for(lambda: egress_events(gw, sid))
    assert len(events) <= 10_000 // 100 + 10, len(events)


def status_of(pid):
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)


def test_malformed_connect_lines_are_refused(gw):
    sid, kc, _ = gateway_session(gw)
    out = run(kc, r"""
import socket
for line in (b"CONNECT tunnel.cellblock.test HTTP/1.1", b"CONNECT :80 HTTP/1.1",
             b"CONNECT [::1 HTTP/1.1", b"CONNECT tunnel.cellblock.test:99999 HTTP/1.1",
             b"CONNECT user@tunnel.cellblock.test:80 HTTP/1.1", b"CONNECT  HTTP/1.1"):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(line + b"\r\n\r\n")
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    print(got.split(b"\r\n")[0].decode())
""")
    lines = out.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("HTTP/1.1 400") for line in lines), lines


def test_what_the_sandbox_passes_the_gateway_must_be_a_tcp_connection(gw):
    """The forwarder hands connections over with SCM_RIGHTS; code in the sandbox
    can do the same with a descriptor of its choosing, or speak HTTP on the
    socket itself."""
    sid, kc, _ = gateway_session(gw)
    out = run(kc, rf"""
import os, socket
def over_unix(data, fds=()):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect("/run/cellblock/egress.sock")
    if fds:
        socket.send_fds(s, [b"F"], list(fds))
    else:
        s.sendall(data)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except OSError:
        pass
    s.close()
    return got.split(b"\r\n")[0].decode() or "closed"
r, w = os.pipe()
print(over_unix(b"", [r]))                                  # a pipe: refused
print(over_unix(b"", [os.open("/tmp", os.O_RDONLY)]))       # a directory: refused
u1, u2 = socket.socketpair()
print(over_unix(b"", [u1.fileno()]))                        # a unix socket: refused
print(over_unix(b"GET http://{API}:{gw.http_port}/echo HTTP/1.1\r\n\r\n"))  # HTTP itself: served
""")
    lines = out.strip().splitlines()
    assert lines[:3] == ["closed"] * 3, lines
    assert lines[3].startswith("HTTP/1.") and " 200 " in lines[3], lines
    events = wait_for(lambda: len(egress_events(gw, sid)) >= 4 and egress_events(gw, sid))
    refused = [e for e in events if "not a TCP connection" in e["reason"]]
    assert len(refused) == 3, events
    assert fetch(kc, f"http://{API}:{gw.http_port}/echo")["status"] == 200


@pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc (gVisor) is not installed")
def test_a_gvisor_session_reaches_the_gateway_too(gw):
    """Under runsc the code's sockets live in gVisor's netstack and cannot be
    handed to a host process: the forwarder copies instead."""
    sid, kc, reply = gw.open_session(image="host-gvisor", limits={"network": {
        "mode": "gateway", "allow": [f"{API}:{gw.http_port}"]}})
    assert reply["runtime"] == "runsc", reply
    got = fetch(kc, f"http://{API}:{gw.http_port}/echo?gvisor=1")
    assert got["status"] == 200 and json.loads(got["body"])["path"] == "/echo?gvisor=1", got
    got = fetch(kc, f"http://other.cellblock.test:{gw.http_port}/")
    assert got["status"] == 403 and "allowlist" in got["body"], got


def test_names_not_pinned_do_not_resolve_under_no_dns(gw):
    """With --egress-no-dns (every fixture here) an allowed name that was not
    pinned is refused without a lookup: the suite never asks a DNS server."""
    sid, kc, _ = gateway_session(gw)  # everything the server allows: *.cellblock.test:PORT
    got = fetch(kc, f"http://unpinned.cellblock.test:{gw.http_port}/")
    assert got["status"] == 502, got
    assert "resolves only the names it was given" in got["body"], got
