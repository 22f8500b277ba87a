"""Secrets through the egress gateway (docs/network.md): credentials the server
holds (its environment, a root-only file) that the gateway adds to a
session's HTTPS requests for one host, terminating TLS with a per-session CA
the sandbox trusts, and that never reach the sandbox: not its environment,
files, memory, nor the audit trail.

Everything stays on this machine: the upstreams are TLS servers of this test
on 127.0.0.1, their names pinned with --egress-resolve, their certificates
self-signed by the test and trusted by the gateway through --egress-ca.
"""
import hashlib
import http.server
import json
import os
import secrets as pysecrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading

import pytest

import server_helpers as sh
from server_helpers import session_pids, wait_for

SECRET_HOST = "secret.cellblock.test"   # the gateway adds secrets here
PASS_HOST = "pass.cellblock.test"       # same upstream, no secrets: tunnelled untouched
BAD_HOST = "badcert.cellblock.test"     # a secret host whose certificate the gateway does not trust
SILENT_HOST = "silent.cellblock.test"   # a secret host that accepts and never says a word


class Upstream(http.server.BaseHTTPRequestHandler):
    """Answers with digests of the credentials it got, never the credentials."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        def digest(name):
            return hashlib.sha256((self.headers.get(name) or "").encode()).hexdigest()
        body = json.dumps({"path": self.path, "host": self.headers.get("Host"),
                           "authorization_sha256": digest("Authorization"),
                           "x_api_key_sha256": digest("X-Api-Key"),
                           "had_authorization": "Authorization" in self.headers,
                           "resumed": getattr(self.request, "session_reused", None)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def make_cert(directory, name, hosts):
    key, cert = os.path.join(directory, name + ".key"), os.path.join(directory, name + ".pem")
    san = ",".join(f"DNS:{h}" for h in hosts)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", f"/CN={hosts[0]}", "-addext",
                    f"subjectAltName={san}"], check=True, capture_output=True)
    return key, cert


def tls_server(key, cert):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class SilentUpstream:
    """Accepts TCP connections and never writes; notes when each one is closed."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn):
        with conn:
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                pass
        self.closed += 1


@pytest.fixture(scope="module")
def sgw():
    work = tempfile.mkdtemp(prefix="cb-egress-secrets-")
    good_key, good_cert = make_cert(work, "good", [SECRET_HOST, PASS_HOST])
    bad_key, bad_cert = make_cert(work, "bad", [BAD_HOST])
    good, bad = tls_server(good_key, good_cert), tls_server(bad_key, bad_cert)
    port, bad_port = good.server_address[1], bad.server_address[1]
    silent = SilentUpstream()
    token = "Bearer tok-" + pysecrets.token_hex(16)
    api_key = "key-" + pysecrets.token_hex(16)
    key_file = f"/run/cb-test-secret-{pysecrets.token_hex(6)}"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (api_key + "\n").encode())
    os.close(fd)
    os.environ["CB_TEST_EGRESS_TOKEN"] = token
    try:
        srv = sh.start_server([
            "--pool", "host=1",
            "--egress-allow", f"{SECRET_HOST}:{port}",
            "--egress-allow", f"{PASS_HOST}:{port}",
            "--egress-allow", f"{BAD_HOST}:{bad_port}",
            "--egress-resolve", f"{SECRET_HOST}=127.0.0.1",
            "--egress-resolve", f"{PASS_HOST}=127.0.0.1",
            "--egress-resolve", f"{BAD_HOST}=127.0.0.1",
            "--egress-allow", f"{SILENT_HOST}:{silent.port}",
            "--egress-resolve", f"{SILENT_HOST}=127.0.0.1",
            "--egress-secret", f"{SILENT_HOST}:Authorization=env:CB_TEST_EGRESS_TOKEN",
            "--egress-private", "127.0.0.1/32",
        # Nothing here may ask a DNS server: names not pinned do not resolve.
        "--egress-no-dns",
            "--egress-ca", good_cert,
            "--egress-secret", f"{SECRET_HOST}:Authorization=env:CB_TEST_EGRESS_TOKEN",
            "--egress-secret", f"{SECRET_HOST}:X-Api-Key=file:{key_file}",
            "--egress-secret", f"{BAD_HOST}:Authorization=env:CB_TEST_EGRESS_TOKEN",
        ])
    finally:
        del os.environ["CB_TEST_EGRESS_TOKEN"]
    srv.port, srv.bad_port = port, bad_port
    srv.silent = silent
    srv.token, srv.api_key = token, api_key
    with open(good_cert, "rb") as f:
        srv.upstream_der = ssl.PEM_cert_to_DER_cert(f.read().decode())
    srv.offered = [
        {"host": SECRET_HOST, "header": "Authorization", "value_from": "env:CB_TEST_EGRESS_TOKEN"},
        {"host": SECRET_HOST, "header": "X-Api-Key", "value_from": f"file:{key_file}"},
    ]
    yield srv
    problems = srv.shutdown()
    for s in (good, bad):
        s.shutdown()
        s.server_close()
    silent.sock.close()
    os.unlink(key_file)
    shutil.rmtree(work, ignore_errors=True)
    assert not problems, "\n".join(problems)


run = sh.run_ok  # executes code that must succeed; its stdout


# In the sandbox: an HTTPS GET through HTTPS_PROXY with the default trust
# store (SSL_CERT_FILE), or without verification; prints JSON.
FETCH = r'''
import json, ssl, urllib.request, urllib.error
def fetch(url, verify=True, headers=None):
    ctx = ssl.create_default_context() if verify else ssl._create_unverified_context()
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()}
    except Exception as e:
        return {"status": 0, "error": type(e).__name__ + ": " + str(e)}
'''


# In the sandbox: a TLS connection through a CONNECT tunnel of the forwarder,
# to see the certificate the code is shown.
TUNNEL = r'''
import hashlib, socket, ssl
def tunnel(host, port, verify):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    ctx = ssl.create_default_context() if verify else ssl._create_unverified_context()
    return ctx.wrap_socket(s, server_hostname=host)
'''


def fetch(kc, url, verify=True, headers=None):
    out = run(kc, FETCH + f"print(json.dumps(fetch({url!r}, {verify!r}, {headers!r})))")
    return json.loads(out.strip().splitlines()[-1])


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


def secret_session(srv, secrets=None):
    network = {"mode": "gateway", "secrets": srv.offered if secrets is None else secrets}
    return srv.open_session(limits={"network": network})


def egress_events(srv, sid):
    history = srv.ok("session_history_request", {"session_id": sid})["content"]
    return [json.loads(e["detail"]) for e in history["events"] if e["kind"] == "egress"]


def test_the_gateway_resumes_its_upstream_tls_sessions_within_a_session(sgw):
    sid, kc, _ = secret_session(sgw)
    url = f"https://{SECRET_HOST}:{sgw.port}/resume"
    seen = [json.loads(fetch(kc, url)["body"]) for _ in range(3)]
    # The first handshake is a full one; the next ones resume what it issued,
    # and the secrets are added to each request all the same.
    assert [s["resumed"] for s in seen] == [False, True, True], seen
    assert all(s["authorization_sha256"] == sha(sgw.token) for s in seen), seen
    events = wait_for(lambda: len(egress_events(sgw, sid)) >= 3 and egress_events(sgw, sid))
    assert [e["upstream_tls_resumed"] for e in events[:3]] == [False, True, True], events
    # Another session has its own: its first handshake is a full one.
    _, other, _ = secret_session(sgw)
    assert json.loads(fetch(other, url)["body"])["resumed"] is False


def test_the_gateway_adds_the_secrets_and_the_code_never_sees_them(sgw):
    sid, kc, reply = secret_session(sgw)
    # What the code sends under a secret's name is replaced, not passed on.
    got = fetch(kc, f"https://{SECRET_HOST}:{sgw.port}/v1/items?q=1",
                headers={"Authorization": "Bearer guessed-by-the-code"})
    assert got["status"] == 200, got
    seen = json.loads(got["body"])
    assert seen["path"] == "/v1/items?q=1", seen
    assert seen["authorization_sha256"] == sha(sgw.token), seen
    assert seen["x_api_key_sha256"] == sha(sgw.api_key), seen
    # The certificate the code saw is the session's CA's, for that host only.
    out = run(kc, TUNNEL + f"""
t = tunnel("{SECRET_HOST}", {sgw.port}, verify=True)
print(dict(x[0] for x in t.getpeercert()["issuer"])["commonName"])
t.close()
""")
    assert out.strip() == f"cellblock session {sid}", out
    events = wait_for(lambda: egress_events(sgw, sid))
    first = events[0]
    assert first["verdict"] == "allowed" and first["status"] == 200, first
    assert first["tls"] == "terminated", first
    assert sorted(first["secrets_added"]) == ["Authorization", "X-Api-Key"], first

    # Nowhere the sandbox can look: environment, files, memory of every process.
    needles = [sgw.token.encode(), sgw.api_key.encode()]
    pids = session_pids(sid)
    assert pids, "no processes found for the session"
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert not any(n in environ for n in needles), pid
        assert not any(n in memory_of(pid) for n in needles), f"secret in the memory of {pid}"
    session_dir = os.path.join(sgw.state_dir, "sessions", sid)
    for root, _, files in os.walk(session_dir):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            assert not any(n in data for n in needles), path
            assert b"PRIVATE KEY" not in data, path
    # Nor the audit trail, nor the server's log.
    history = json.dumps(sgw.ok("session_history_request", {"session_id": sid})["content"])
    assert sgw.token not in history and sgw.api_key not in history
    info = sgw.info_of(sid)
    assert sgw.token not in json.dumps(info) and sgw.api_key not in json.dumps(info)
    # The session's limits keep the references, not the values.
    assert info["limits"]["network"]["secrets"] == sgw.offered, info["limits"]
    log = sgw.log()
    assert sgw.token not in log and sgw.api_key not in log


def memory_of(pid):
    """Every readable byte of a process's private and shared mappings."""
    chunks = []
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError:
        return b""
    with mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                chunks.append(mem.read(end - start))
            except (OSError, ValueError, OverflowError):
                continue
    return b"".join(chunks)


def test_the_session_ca_is_name_constrained_and_its_key_stays_out(sgw):
    sid, kc, _ = secret_session(sgw)
    bundle = os.path.join(sgw.state_dir, "sessions", sid, "ipc", "ca-certificates.crt")
    with open(bundle) as f:
        text = f.read()
    assert "PRIVATE KEY" not in text
    ca = text[text.rindex("-----BEGIN CERTIFICATE-----"):]
    shown = subprocess.run(["openssl", "x509", "-noout", "-text"], input=ca, text=True,
                           capture_output=True, check=True).stdout
    assert f"CN = cellblock session {sid}" in shown, shown
    assert "X509v3 Name Constraints: critical" in shown, shown
    assert f"DNS:{SECRET_HOST}" in shown, shown
    assert "CA:TRUE, pathlen:0" in shown, shown
    # The rest is the host's own trust store.
    with open("/etc/ssl/certs/ca-certificates.crt") as f:
        assert text.startswith(f.read().rstrip("\n"))


def test_a_host_without_secrets_is_tunnelled_untouched(sgw):
    sid, kc, _ = secret_session(sgw)
    # The gateway does not terminate TLS: the code sees the upstream's own
    # certificate (self-signed, so not trusted inside the sandbox).
    got = fetch(kc, f"https://{PASS_HOST}:{sgw.port}/")
    assert got["status"] == 0 and "CERTIFICATE_VERIFY_FAILED" in got["error"], got
    out = run(kc, TUNNEL + f"""
t = tunnel("{PASS_HOST}", {sgw.port}, verify=False)
print(hashlib.sha256(t.getpeercert(binary_form=True)).hexdigest())
t.close()
""")
    assert out.strip() == hashlib.sha256(sgw.upstream_der).hexdigest(), out
    got = fetch(kc, f"https://{PASS_HOST}:{sgw.port}/", verify=False)
    assert got["status"] == 200 and not json.loads(got["body"])["had_authorization"], got


def test_a_session_that_did_not_ask_gets_no_secrets(sgw):
    sid, kc, _ = secret_session(sgw, secrets=[])
    got = fetch(kc, f"https://{SECRET_HOST}:{sgw.port}/", verify=False)
    assert got["status"] == 200, got
    assert not json.loads(got["body"])["had_authorization"], got


def test_an_untrusted_upstream_certificate_is_refused_by_the_gateway(sgw):
    secret = {"host": BAD_HOST, "header": "Authorization",
              "value_from": "env:CB_TEST_EGRESS_TOKEN"}
    sid, kc, _ = secret_session(sgw, secrets=[secret])
    got = fetch(kc, f"https://{BAD_HOST}:{sgw.bad_port}/")
    assert got["status"] == 502, got
    assert f"TLS to {BAD_HOST}:{sgw.bad_port} failed" in got["body"], got
    assert "self-signed" in got["body"] or "verify" in got["body"], got


def test_a_client_that_leaves_mid_handshake_ends_the_upstreams_handshake_too(sgw):
    # The gateway's TLS to the upstream starts beside the code's, as soon as
    # CONNECT is answered. Here the upstream never answers its handshake and
    # the code leaves without one: the gateway must end its upstream side at
    # once, not after the session's request timeout (set far away).
    secret = {"host": SILENT_HOST, "header": "Authorization",
              "value_from": "env:CB_TEST_EGRESS_TOKEN"}
    network = {"mode": "gateway", "secrets": [secret], "request_timeout_s": 600}
    sid, kc, _ = sgw.open_session(limits={"network": network})
    before = sgw.silent.closed
    out = run(kc, f'''
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT {SILENT_HOST}:{sgw.silent.port} HTTP/1.1\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
print(head.split(b"\\r\\n")[0].decode())
s.close()
''')
    assert "200" in out, out
    # Far less than the 600 s the upstream socket's own timeout would take.
    assert wait_for(lambda: sgw.silent.closed > before, timeout=60), \
        "the gateway kept its upstream connection after the code left"
    events = wait_for(lambda: [e for e in egress_events(sgw, sid) if e["host"] == SILENT_HOST])
    assert "TLS with the session's code failed" in events[0]["reason"], events


def test_secrets_the_server_does_not_offer_are_refused(sgw):
    for secret, ename in (
        ({"host": SECRET_HOST, "header": "Authorization", "value_from": "env:HOME"},
         "LimitAboveMaximum"),
        ({"host": SECRET_HOST, "header": "Cookie", "value_from": "env:CB_TEST_EGRESS_TOKEN"},
         "LimitAboveMaximum"),
        ({"host": SECRET_HOST, "header": "Host", "value_from": "env:CB_TEST_EGRESS_TOKEN"},
         "InvalidLimits"),
        ({"host": SECRET_HOST, "header": "Authorization"}, "InvalidLimits"),
    ):
        reply = sgw.call("session_create_request", {"limits": {"network": {
            "mode": "gateway", "secrets": [secret]}}})["content"]
        assert reply["status"] == "error" and reply["ename"] == ename, (secret, reply)
    # An offered secret for a host the session's own allowlist leaves out.
    reply = sgw.call("session_create_request", {"limits": {"network": {
        "mode": "gateway", "allow": [f"{PASS_HOST}:{sgw.port}"],
        "secrets": sgw.offered[:1]}}})["content"]
    assert reply["ename"] == "InvalidLimits" and "not in network.allow" in reply["evalue"], reply


def test_a_secret_file_others_can_read_stops_the_server_at_start():
    path = f"/run/cb-test-secret-{pysecrets.token_hex(6)}"
    with open(path, "w") as f:
        f.write("value\n")
    os.chmod(path, 0o644)
    state_dir = sh.new_state_dir()
    try:
        result = subprocess.run(
            [sh.CELLBLOCK_BIN, "serve", "--state-dir", state_dir, "--pool", "host=0",
             "--egress-allow", "api.cellblock.test:443",
             "--egress-secret", f"api.cellblock.test:Authorization=file:{path}"],
            capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert "chmod 600" in result.stderr, result.stderr
        assert "value" not in result.stderr
    finally:
        os.unlink(path)
        shutil.rmtree(state_dir, ignore_errors=True)
