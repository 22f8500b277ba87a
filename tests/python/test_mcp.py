"""`cellblock mcp` against a real `cellblock serve`, with clients no one here wrote.

- The official MCP TypeScript SDK (@modelcontextprotocol/sdk from npm,
  installed pinned by tests/mcp/install.sh) runs tests/mcp/mcp_client_test.mjs
  over stdio (it launches `cellblock mcp` itself) and over Streamable HTTP
  with a bearer token: initialize, tools/list, state across calls, a
  matplotlib PNG, an error's traceback, a file round trip, resources,
  progress, a cancellation that interrupts `while True`, the execution cap.
- Raw JSON-RPC on stdio and raw HTTP: malformed messages and unknown
  methods get JSON-RPC errors and the server lives on; HTTP without or with a
  wrong token is 401, a foreign Origin 403, a missing or unknown
  Mcp-Session-Id 400/404, GET 405.
- The MCP Inspector's CLI (@modelcontextprotocol/inspector --cli) lists the
  tools and calls run_code.
- A conversation's sessions are closed when it ends.
"""
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import http.client

import pytest

from server_helpers import server, wait_for  # noqa: F401 (server: a fixture)

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MCP_DIR = os.path.join(SOURCE_DIR, "tests", "mcp")
CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
NODE = shutil.which("node") or "/usr/bin/node"
CLIENT_SCRIPT = os.path.join(MCP_DIR, "mcp_client_test.mjs")
INSPECTOR = os.path.join(MCP_DIR, "node_modules", "@modelcontextprotocol", "inspector",
                         "clients", "launcher", "build", "index.js")


@pytest.fixture(scope="module", autouse=True)
def sdk_installed():
    """Checked before the module's server (server_helpers.server) starts."""
    if not os.path.isdir(os.path.join(MCP_DIR, "node_modules", "@modelcontextprotocol", "sdk")):
        pytest.fail("the MCP SDK is not installed: run tests/mcp/install.sh (scripts/setup.sh does)")


def open_sessions(srv):
    reply = srv.call("session_list_request", {"open_only": True})
    return {s["session_id"] for s in reply["content"]["sessions"]}


def run_node_client(args, timeout=300):
    proc = subprocess.run([NODE, CLIENT_SCRIPT, *args], cwd=MCP_DIR, capture_output=True,
                          text=True, timeout=timeout)
    print(proc.stdout)
    assert proc.returncode == 0, f"the SDK client failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    passed = [line[3:] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    sessions = json.loads(next(line[9:] for line in proc.stdout.splitlines()
                               if line.startswith("sessions ")))
    return passed, sessions


class McpHttp:
    """`cellblock mcp --http 127.0.0.1:0` with a token file; its port read from its log."""

    def __init__(self, srv, extra=()):
        self.token = secrets.token_hex(24)
        self.dir = tempfile.mkdtemp(prefix="cb-mcp-")
        self.token_file = os.path.join(self.dir, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token + "\n")
        self.log_path = os.path.join(self.dir, "mcp.log")
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [CELLBLOCK_BIN, "mcp", "--state-dir", srv.state_dir, "--http", "127.0.0.1:0",
             "--token-file", self.token_file, *extra],
            stdin=subprocess.DEVNULL, stdout=self.log_file, stderr=subprocess.STDOUT)
        found = wait_for(lambda: re.search(r"listening on http://127\.0\.0\.1:(\d+)/mcp", self.log()),
                         timeout=20)
        assert found, f"cellblock mcp --http did not listen:\n{self.log()}"
        self.port = int(found.group(1))
        self.url = f"http://127.0.0.1:{self.port}/mcp"

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def post(self, body, headers=None, token=True, method="POST"):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if token is True:
            h["Authorization"] = f"Bearer {self.token}"
        elif token:
            h["Authorization"] = f"Bearer {token}"
        h.update(headers or {})
        conn.request(method, "/mcp", body=body if isinstance(body, (bytes, str)) else json.dumps(body),
                     headers=h)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, dict(response.getheaders()), data

    def stop(self):
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)
        finally:
            self.log_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


def test_sdk_over_stdio(server):
    before = open_sessions(server)
    passed, sessions = run_node_client(["stdio", CELLBLOCK_BIN, server.state_dir])
    assert len(passed) >= 20, passed
    # The conversation ended with the client: its sessions are closed.
    assert wait_for(lambda: not (set(sessions) & open_sessions(server)), timeout=20), \
        f"sessions {sessions} outlived their stdio conversation"
    assert open_sessions(server) <= before | set()


def test_sdk_over_streamable_http(server):
    mcp = McpHttp(server)
    try:
        passed, sessions = run_node_client(["http", mcp.url, mcp.token])
        assert len(passed) >= 20, passed
        # DELETE (terminateSession) closed the MCP session and its cellblock sessions.
        assert wait_for(lambda: not (set(sessions) & open_sessions(server)), timeout=20), \
            f"sessions {sessions} outlived their HTTP MCP session"
    finally:
        assert mcp.stop() == 0, mcp.log()


def rpc(proc, message, timeout=30):
    """Writes one line to `cellblock mcp`'s stdin; returns the next line it writes, parsed."""
    proc.stdin.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, "cellblock mcp closed stdout"
    return json.loads(line)


def test_stdio_answers_bad_json_rpc_with_errors(server):
    proc = subprocess.Popen([CELLBLOCK_BIN, "mcp", "--state-dir", server.state_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        init = rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                          "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                     "clientInfo": {"name": "raw", "version": "0"}}})
        assert init["result"]["protocolVersion"] == "2025-06-18"
        # An unknown version is answered with ours, the latest.
        again = rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "initialize",
                           "params": {"protocolVersion": "1999-01-01", "capabilities": {}}})
        assert again["result"]["protocolVersion"] == "2025-11-25"
        assert rpc(proc, "{not json")["error"]["code"] == -32700
        assert rpc(proc, '{"jsonrpc": "2.0", "id": 3')["error"]["code"] == -32700
        reply = rpc(proc, {"jsonrpc": "2.0", "id": 4, "method": "no/such/method"})
        assert reply["id"] == 4 and reply["error"]["code"] == -32601
        assert rpc(proc, {"jsonrpc": "2.0", "id": 5})["error"]["code"] == -32600
        assert rpc(proc, {"jsonrpc": "1.0", "id": 6, "method": "ping"})["error"]["code"] == -32600
        assert rpc(proc, {"jsonrpc": "2.0", "id": 7, "method": "ping", "params": [1]})["error"]["code"] == -32600
        assert rpc(proc, [{"jsonrpc": "2.0", "id": 8, "method": "ping"}])["error"]["code"] == -32600
        assert rpc(proc, "42")["error"]["code"] == -32600
        assert rpc(proc, "[" * 100000 + "]" * 100000)["error"]["code"] == -32600
        reply = rpc(proc, {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                           "params": {"name": "run_code", "arguments": {"code": 17}}})
        assert reply["result"]["isError"] is True
        assert reply["result"]["content"][0]["text"].startswith("InvalidRequest: ")
        reply = rpc(proc, {"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": {}})
        assert reply["error"]["code"] == -32602
        reply = rpc(proc, {"jsonrpc": "2.0", "id": 11, "method": "resources/read",
                           "params": {"uri": "file:///etc/passwd"}})
        assert reply["error"]["code"] == -32002
        # Notifications get no answer; the next request still does.
        proc.stdin.write('{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        proc.stdin.write('{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 99}}\n')
        assert rpc(proc, {"jsonrpc": "2.0", "id": "last", "method": "ping"}) == \
            {"jsonrpc": "2.0", "id": "last", "result": {}}
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()


def test_http_refusals(server):
    mcp = McpHttp(server)
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "raw", "version": "0"}}}
    try:
        status, headers, _ = mcp.post(init, token=None)
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert mcp.post(init, token="x" * 48)[0] == 401
        # Refused from the head alone: a body announced but never sent is not waited for.
        conn = http.client.HTTPConnection("127.0.0.1", mcp.port, timeout=10)
        conn.putrequest("POST", "/mcp")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(50 << 20))
        conn.endheaders()
        assert conn.getresponse().status == 401
        conn.close()
        assert mcp.post(init, headers={"Authorization": "Basic " + mcp.token})[0] == 401
        assert mcp.post(init, headers={"Origin": "http://evil.example"})[0] == 403
        status, headers, body = mcp.post(init, headers={"Origin": "http://localhost:3000"})
        assert status == 200, body
        sid = headers["Mcp-Session-Id"]
        assert re.fullmatch(r"[0-9a-f]{64}", sid)
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        assert mcp.post(ping)[0] == 400                                   # no session id
        assert mcp.post(ping, headers={"Mcp-Session-Id": "0" * 64})[0] == 404
        status, _, body = mcp.post(ping, headers={"Mcp-Session-Id": sid})
        assert status == 200 and json.loads(body) == {"jsonrpc": "2.0", "id": 2, "result": {}}
        status, _, body = mcp.post("{oops", headers={"Mcp-Session-Id": sid})
        assert status == 400 and json.loads(body)["error"]["code"] == -32700
        status, _, body = mcp.post({"jsonrpc": "2.0", "id": 3, "method": "nope"},
                                   headers={"Mcp-Session-Id": sid})
        assert status == 200 and json.loads(body)["error"]["code"] == -32601
        assert mcp.post({"jsonrpc": "2.0", "method": "notifications/initialized"},
                        headers={"Mcp-Session-Id": sid})[0] == 202
        assert mcp.post(ping, headers={"Mcp-Session-Id": sid,
                                       "MCP-Protocol-Version": "1999-01-01"})[0] == 400
        assert mcp.post(ping, headers={"Content-Type": "text/plain", "Mcp-Session-Id": sid})[0] == 415
        assert mcp.post("", method="GET", headers={"Mcp-Session-Id": sid})[0] == 405
        assert mcp.post("", method="DELETE", headers={"Mcp-Session-Id": sid})[0] == 200
        assert mcp.post(ping, headers={"Mcp-Session-Id": sid})[0] == 404
    finally:
        assert mcp.stop() == 0, mcp.log()


def test_http_off_loopback_needs_a_token(server):
    proc = subprocess.run([CELLBLOCK_BIN, "mcp", "--state-dir", server.state_dir,
                           "--http", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "not a loopback address" in proc.stderr


def test_inspector_cli(server):
    if not os.path.exists(INSPECTOR):
        pytest.fail("@modelcontextprotocol/inspector is not installed (tests/mcp/install.sh)")
    target = [CELLBLOCK_BIN, "mcp", "--state-dir", server.state_dir]
    catalog = tempfile.mkdtemp(prefix="cb-inspector-")
    env = {**os.environ, "MCP_CATALOG_PATH": os.path.join(catalog, "mcp.json")}

    def inspector(*args):
        return subprocess.run([NODE, INSPECTOR, "--cli", *args, "--", *target], capture_output=True,
                              text=True, timeout=120, cwd=MCP_DIR, env=env)

    try:
        # --strict: the tools' schemas checked for portability across model providers.
        listed = inspector("--method", "tools/list", "--strict")
        called = inspector("--method", "tools/call", "--tool-name", "run_code",
                           "--tool-arg", "code=print(6 * 7)")
    finally:
        shutil.rmtree(catalog, ignore_errors=True)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    names = {t["name"] for t in json.loads(listed.stdout)["tools"]}
    assert {"run_code", "upload_file", "download_file"} <= names
    # It prints each portability problem ("Warning: tool ...", "Error: ...") and a count.
    assert "Warning:" not in listed.stderr and "Error:" not in listed.stderr, listed.stderr
    assert called.returncode == 0, called.stdout + called.stderr
    result = json.loads(called.stdout)
    assert result["structuredContent"]["stdout"] == "42\n", result
