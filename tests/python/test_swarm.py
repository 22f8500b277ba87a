"""cellblock serve --backend swarm on a real three-node Docker Swarm (issue 16).

The swarm is tests/swarm/testbed.py's: a private manager daemon on this host
(drained: its network namespace is the host's) and two docker-in-docker
workers, each set up by deploy/swarm/node-setup.sh, every published session
port reachable at 127.0.0.1. The host image is exported with `cellblock image
export` and loaded into every node. The module skips, saying why, only when
dockerd cannot start here.

What is checked from outside cellblock: where the engine placed each session
(the engine's own task list), what a session's process sees of itself (uid,
capabilities, routes, interfaces, its root), the engine's services after a
close, a killed worker and a kill -9 of the server.
"""
import errno
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

import test_attacks_syscalls as attacks
import test_egress as egress
import test_egress_secrets as egress_secrets
import test_kernel_conformance as conformance
from conftest import CELLBLOCK_BIN
from server_helpers import (ServerProcess, ShellWatch, execute, new_state_dir, run_ok,
                            wait_for, zmtp_mechanism)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "swarm"))
import testbed  # noqa: E402

# Swarm sessions' kernel uids (include/cellblock/swarm_backend.hpp): from
# kSwarmFirstUid, kSwarmUidBlocks blocks of kSwarmUidBlock.
SWARM_FIRST_UID = 1 << 20
SWARM_UID_SPAN = (1 << 16) * (1 << 13)


def export_host_image(tar):
    """`cellblock image export host`; returns the tag it printed (the shim's
    digest ends it: cellblock/host:host-SHIM12)."""
    out = subprocess.run([CELLBLOCK_BIN, "image", "export", "host", "-o", tar],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.strip().startswith("docker import ")]
    assert line, out.stdout
    tag = line[0].split()[-1]
    assert tag.startswith("cellblock/host:host-") and len(tag.rsplit("-", 1)[1]) == 12, tag
    return tag


def error_of(reply):
    content = reply["content"]
    return content.get("ename"), content.get("evalue", "")


def up_with_cellblocks_engine_profile(directory):
    """testbed.up with `cellblock seccomp-profile` as the nodes' engine
    profile, as deploy/swarm/README.md has an operator set it."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as profile:
        subprocess.run([CELLBLOCK_BIN, "seccomp-profile"], stdout=profile, check=True, timeout=60)
        profile.flush()
        return testbed.up(directory, engine_profile=profile.name)


@pytest.fixture(scope="module")
def bed():
    directory = tempfile.mkdtemp(prefix="cellblock-swarm-", dir="/var/tmp")
    try:
        instance = up_with_cellblocks_engine_profile(directory)
    except testbed.DaemonStartFailed as e:
        pytest.skip(f"dockerd cannot start on this host: {e}")
    try:
        tar = os.path.join(directory, "host-image.tar")
        instance.load_image(tar, export_host_image(tar))
        os.unlink(tar)
        yield instance
    finally:
        residue = testbed.down(directory)
        assert not residue, f"the swarm testbed left: {residue}"


def swarm_args(bed, pool=2):
    # A drain grace longer than any wait here for a task to end: one that
    # ends sooner was ended by its kernel's exit, not by the engine's SIGKILL.
    return ["--backend", "swarm", "--swarm-docker-host", bed.describe()["docker_host"],
            "--swarm-connect-host", "127.0.0.1", "--pool", f"host={pool}",
            "--swarm-drain-grace", "120"]


def services_of(bed, server_id):
    """The engine's services labelled with this server's id: {name: service id}."""
    out = bed.docker("service", "ls", "--filter", f"label=cellblock.server={server_id}",
                     "--format", "{{.Name}} {{.ID}}")
    return dict(line.split() for line in out.splitlines() if line.strip())


def server_id_of(server):
    with open(os.path.join(server.state_dir, "swarm", "server-id")) as f:
        return f.read().strip()


def node_of(bed, sid):
    """The hostname of the node the engine runs session `sid`'s task on."""
    tasks = json.loads(bed.docker("service", "ps", "--no-trunc", "--format", "{{json .}}",
                                  f"cb-{sid}").splitlines()[0])
    return tasks["Node"]


@pytest.fixture(scope="module")
def upstream():
    """An HTTP server on this host's 127.0.0.1 (test_egress's): the one
    destination the module's server lets its sessions reach, by a pinned
    name, through its egress gateway."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), egress.Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def egress_args(port):
    # As test_egress's server: the name pinned to 127.0.0.1, which is opted
    # in; nothing here asks a DNS server.
    return ["--egress-allow", f"{egress.API}:{port}",
            "--egress-resolve", f"{egress.API}=127.0.0.1",
            "--egress-private", "127.0.0.1/32", "--egress-no-dns"]


@pytest.fixture(scope="module")
def swarm_server(bed, upstream, request):
    failed_before = request.session.testsfailed
    srv = ServerProcess(new_state_dir(), swarm_args(bed) + egress_args(upstream)).start()
    yield srv
    server_id = server_id_of(srv)
    problems = srv.shutdown(keep_log=request.session.testsfailed > failed_before)
    assert not problems, "\n".join(problems)
    # A stopped server leaves no service or secret of its own in the engine.
    assert services_of(bed, server_id) == {}
    secrets = bed.docker("secret", "ls", "--filter", f"label=cellblock.server={server_id}",
                         "-q")
    assert secrets.strip() == ""


@pytest.fixture
def swarm(swarm_server):
    yield swarm_server
    swarm_server.close_clients()


def test_sessions_spread_over_the_workers_never_the_manager(bed, swarm):
    workers = {w["container"] for w in bed.describe()["workers"]}
    nodes = set()
    for _ in range(4):
        sid, kc, _ = swarm.open_session()
        assert run_ok(kc, "print(6 * 7)") == "42\n"
        nodes.add(node_of(bed, sid))
        swarm.ok("session_close_request", {"session_id": sid})
    assert nodes <= workers, nodes
    assert len(nodes) == 2, f"4 sessions all went to {nodes}"
    # `cellblock ls` shows the nodes as the engine sees them.
    listed = swarm.ok("session_list_request", {})["content"]
    assert listed["backend"] == "swarm"
    states = {n["hostname"]: (n["state"], n["availability"]) for n in listed["nodes"]}
    for worker in workers:
        assert states[worker] == ("ready", "active"), states
    assert [s for s in states.values() if s[1] == "drain"], states  # the manager
    out = swarm.cli("ls").stdout
    assert all(worker in out for worker in workers), out


def test_a_swarm_session_is_contained(bed, swarm):
    sid, kc, reply = swarm.open_session()
    # The server reaches it only through a port its node publishes on the loopback.
    assert reply["connection"]["ip"] == "127.0.0.1"
    facts = json.loads(run_ok(kc, (
        "import json, os, socket\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "def writable(path):\n"
        "    try:\n"
        "        open(path, 'w').close(); return True\n"
        "    except OSError:\n"
        "        return False\n"
        "routes = [l.split() for l in open('/proc/net/route').read().splitlines()[1:]]\n"
        "v6 = [l.split() for l in open('/proc/net/ipv6_route').read().splitlines()] "
        "if os.path.exists('/proc/net/ipv6_route') else []\n"
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def errno_of(nr, *args):\n"
        "    return ctypes.get_errno() if libc.syscall(nr, *args) == -1 else 0\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(),\n"
        "  'cap_eff': status['CapEff'].strip(), 'cap_bnd': status['CapBnd'].strip(),\n"
        "  'no_new_privs': status['NoNewPrivs'].strip(),\n"
        "  'seccomp': status['Seccomp'].strip(), 'filters': int(status['Seccomp_filters']),\n"
        # Docker's profile alone lets these two through (checked on the
        # testbed: inotify_init1 gives a descriptor, PTRACE_TRACEME succeeds);
        # cellblock's says EPERM (the shim's program; here the nodes' engine
        # profile is cellblock's too, as deploy/swarm/README.md suggests).
        "  'inotify_init1': errno_of(294, 0), 'ptrace': errno_of(101, 0, 0, 0, 0),\n"
        "  'default_v4': [r for r in routes if r[1] == '00000000'],\n"
        "  'default_v6': [r for r in v6 if r[0] == '0' * 32 and r[1] == '00' and r[9] != 'lo'],\n"
        "  'interfaces': sorted(os.listdir('/sys/class/net')),\n"
        "  'root_writable': writable('/cellblock-probe'), 'usr_writable': writable('/usr/probe'),\n"
        "  'tmp_writable': writable('/tmp/probe'), 'home_writable': writable(os.path.expanduser('~/p')),\n"
        "  'secret_mode': oct(os.stat('/run/secrets/cellblock-connection.json').st_mode & 0o777)}))")))
    # A uid of its own, in this server's block: not the image's 1000, not a
    # neighbour's (checked below with a second session).
    assert facts["gid"] == facts["uid"], facts
    assert SWARM_FIRST_UID <= facts["uid"] < SWARM_FIRST_UID + SWARM_UID_SPAN, facts
    assert int(facts["cap_eff"], 16) == 0, facts
    assert facts["no_new_privs"] == "1", facts
    # cellblock's seccomp program on top of the engine's profile: two filters,
    # and calls Docker's default allows refused with EPERM.
    assert facts["seccomp"] == "2" and facts["filters"] >= 2, facts
    assert facts["inotify_init1"] == errno.EPERM, facts
    assert facts["ptrace"] == errno.EPERM, facts
    sid2, kc2, _ = swarm.open_session()
    try:
        assert int(run_ok(kc2, "import os; print(os.getuid())")) not in (facts["uid"], 1000)
    finally:
        kc2.stop_channels()
        swarm.ok("session_close_request", {"session_id": sid2})
    assert facts["default_v4"] == [] and facts["default_v6"] == [], facts
    assert facts["interfaces"] == ["eth0", "lo"], facts
    assert not facts["root_writable"] and not facts["usr_writable"], facts
    assert facts["tmp_writable"] and facts["home_writable"], facts
    assert facts["secret_mode"] == "0o400", facts

    # A listener on the host's loopback stays out of reach: the session's
    # 127.0.0.1 is its own, and it has no route anywhere else.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        out = run_ok(kc, (
            "import socket\n"
            "s = socket.socket(); s.settimeout(3)\n"
            f"print(s.connect_ex(('127.0.0.1', {port})))"))
        assert int(out) != 0, out
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()

    # Files live on a node the server has no directory on: the kernel is
    # asked (test_files_go_to_and_from_a_swarm_session_through_its_kernel).
    reply = swarm.call("file_get_request", {"session_id": sid, "path": "result.csv"})
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "FileNotFound", reply["content"]
    assert "/data/output/result.csv" in reply["content"]["evalue"], reply["content"]
    swarm.ok("session_close_request", {"session_id": sid})


class BridgeCapture:
    """Every TCP payload to or from `ports` seen on the host's `interface` (an
    AF_PACKET socket: the frames as they cross the bridge the nodes sit on),
    until the `with` block ends. `flows`: (source port, destination port) →
    the bytes, in the order they were seen."""

    def __init__(self, interface, ports):
        self.ports = set(ports)
        self.flows = {}
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)  # the last frames in flight
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def _run(self):
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(262144)
            except socket.timeout:
                continue
            if len(frame) < 54 or frame[12:14] != b"\x08\x00":  # IPv4 only: the bridge's
                continue
            ip = frame[14:]
            if ip[9] != 6:  # TCP
                continue
            tcp = ip[(ip[0] & 0x0F) * 4:int.from_bytes(ip[2:4], "big")]
            source, destination = int.from_bytes(tcp[0:2], "big"), int.from_bytes(tcp[2:4], "big")
            if source in self.ports or destination in self.ports:
                payload = tcp[(tcp[12] >> 4) * 4:]
                self.flows.setdefault((source, destination), bytearray()).extend(payload)

    def seen(self):
        return b"".join(bytes(b) for b in self.flows.values())


def published_ports(bed, sid):
    """The ports session `sid`'s task publishes on its node (at 127.0.0.1 on
    this host): the kernel's five in the connection file's order, then its
    egress tunnel's (the module's server has a gateway)."""
    task = bed.docker("service", "ps", "-q", "--no-trunc", f"cb-{sid}").split()[0]
    ports = json.loads(bed.docker("inspect", "--type", "task", "--format",
                                  "{{json .Status.PortStatus.Ports}}", task))
    return [p["PublishedPort"] for p in sorted(ports, key=lambda p: p["TargetPort"])]


def test_no_code_or_output_crosses_to_a_node_in_clear(bed, swarm, upstream):
    # The front's channels to a node are CurveZMQ with a key pair made for the
    # session: captured on the bridge between this host and the workers,
    # neither the code of an execution nor its output shows, nor what the
    # code fetched through the egress tunnel, while clear bytes sent to the
    # same port by the same path do.
    sid, kc, _ = swarm.open_session(limits={"network": {"mode": "gateway"}})
    ports = published_ports(bed, sid)
    assert len(ports) == 6, ports
    token = uuid.uuid4().hex
    code_text, output_text = f"cbcode{token}", f"cbcode{token}"[::-1]
    probe = f"cbprobe{token}".encode()
    fetched_path = f"/cbpath{token}"
    with BridgeCapture(bed.describe()["bridge"], ports) as capture:
        assert run_ok(kc, f"word = {code_text!r}\nprint(word[::-1])") == output_text + "\n"
        got = egress.fetch(kc, f"http://{egress.API}:{upstream}{fetched_path}")
        assert got["status"] == 200 and json.loads(got["body"])["path"] == fetched_path, got
        mechanisms = [zmtp_mechanism(port, then_send=probe if port == ports[0] else b"")
                      for port in ports]
    assert mechanisms == ["CURVE"] * 6, mechanisms
    tunnel_bytes = sum(len(b) for (src, dst), b in capture.flows.items()
                       if ports[5] in (src, dst))
    assert tunnel_bytes > len(fetched_path) * 2, "the fetch must cross the tunnel's port"
    assert fetched_path.encode() not in capture.seen(), "egress crossed to the node in clear"
    seen = capture.seen()
    assert probe in seen, "the capture must see clear bytes sent to the session's node"
    session_bytes = sum(len(b) for b in capture.flows.values())
    assert session_bytes > 2 * len(probe) + 500, capture.flows.keys()
    assert code_text.encode() not in seen, "the code crossed to the node in clear"
    assert output_text.encode() not in seen, "the output crossed from the node in clear"
    assert b"execute_request" not in seen and b"kernel_info" not in seen
    swarm.ok("session_close_request", {"session_id": sid})


def post_reversed(kc, url, size):
    """The session's code posts `size` pseudo-random bytes through its proxy:
    [status, the reply's length, whether it is the body reversed] (what
    test_egress's Upstream answers a POST with)."""
    code = egress.FETCH + f"""
import random
body = random.Random(7).randbytes({size})
got = fetch({url!r}, data=body)
reply = got["body"].encode("latin-1")
print(json.dumps([got["status"], len(reply), reply == body[::-1]]))
"""
    return json.loads(run_ok(kc, code, timeout=120).splitlines()[-1])


def test_a_swarm_session_reaches_its_allowlist_through_the_front_and_nothing_else(swarm,
                                                                                  upstream):
    """The egress gateway serves Swarm sessions: the kernel carries the
    code's proxy connections over its CurveZMQ egress tunnel to the front,
    which hands them to the gateway on this machine; the allowlist, the
    audit and the trust store are the gateway's, as on runc; the way out
    follows the session into the service it wakes in."""
    sid, kc, reply = swarm.open_session(limits={"network": {"mode": "gateway"}})
    assert reply["limits"]["network"]["mode"] == "gateway"
    base = f"http://{egress.API}:{upstream}"
    got = egress.fetch(kc, base + "/echo")
    assert got["status"] == 200 and json.loads(got["body"])["path"] == "/echo", got
    # Four windows each way (the tunnel's TUNNEL_WINDOW is 256 KiB).
    size = 1 << 20
    assert post_reversed(kc, base + "/post", size) == [201, size, True]
    # Refused by the gateway, saying why, and audited.
    got = egress.fetch(kc, f"http://elsewhere.cellblock.test:{upstream}/")
    assert got["status"] == 403, got
    events = wait_for(lambda: len(egress.egress_events(swarm, sid)) >= 3 and
                      egress.egress_events(swarm, sid))
    verdicts = [(e["verdict"], e["host"]) for e in events]
    assert ("allowed", egress.API) in verdicts and \
        ("refused", "elsewhere.cellblock.test") in verdicts, verdicts
    # The trust store the front sent with its hello is the code's.
    assert run_ok(kc, "import os; print(os.path.getsize(os.environ['SSL_CERT_FILE']) > 1000)") \
        == "True\n"
    # A session without the gateway on the same server is told it has none.
    other, other_kc, _ = swarm.open_session()
    got = egress.fetch(other_kc, base + "/echo")
    assert got["status"] == 403 and "no network access" in got["body"], got
    assert egress.egress_events(swarm, other) == []
    swarm.ok("session_close_request", {"session_id": other})
    # Hibernated and woken in a new service: its way out comes back with it.
    reply = swarm.ok("session_hibernate_request", {"session_id": sid}, timeout=180)["content"]
    assert reply["state"] == "hibernated", reply
    woken = run_ok(kc, egress.FETCH + f"print(json.dumps(fetch({base + '/after-wake'!r})))",
                   timeout=180)
    got = json.loads(woken.splitlines()[-1])
    assert got["status"] == 200 and json.loads(got["body"])["path"] == "/after-wake", got
    swarm.ok("session_close_request", {"session_id": sid})
    assert not os.path.exists(os.path.join(swarm.state_dir, "remote-egress", sid))


def test_a_swarm_sessions_secrets_are_added_by_the_gateway_on_the_front(bed, tmp_path):
    """A secret the gateway adds to a host's HTTPS requests works for a Swarm
    session as for a runc one: the session's CA, in the trust store the front
    sends with its hello, is what the task's code trusts; the credential
    itself stays on the front."""
    host = egress_secrets.SECRET_HOST
    key, cert = egress_secrets.make_cert(str(tmp_path), "up", [host])
    upstream = egress_secrets.tls_server(key, cert)
    port = upstream.server_address[1]
    token = "Bearer tok-" + uuid.uuid4().hex
    os.environ["CB_TEST_SWARM_TOKEN"] = token
    try:
        srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=0) + [
            "--egress-allow", f"{host}:{port}", "--egress-resolve", f"{host}=127.0.0.1",
            "--egress-private", "127.0.0.1/32", "--egress-no-dns", "--egress-ca", cert,
            "--egress-secret", f"{host}:Authorization=env:CB_TEST_SWARM_TOKEN"]).start()
    finally:
        del os.environ["CB_TEST_SWARM_TOKEN"]
    try:
        secret = {"host": host, "header": "Authorization", "value_from": "env:CB_TEST_SWARM_TOKEN"}
        sid, kc, _ = srv.open_session(limits={"network": {"mode": "gateway",
                                                          "secrets": [secret]}})
        code = egress_secrets.FETCH + f"print(json.dumps(fetch({f'https://{host}:{port}/v1'!r})))"
        got = json.loads(run_ok(kc, code, timeout=120).strip().splitlines()[-1])
        assert got["status"] == 200, got
        seen = json.loads(got["body"])
        assert seen["authorization_sha256"] == egress_secrets.sha(token), seen
        issuer = run_ok(kc, egress_secrets.TUNNEL + f"""
t = tunnel("{host}", {port}, verify=True)
print(dict(x[0] for x in t.getpeercert()["issuer"])["commonName"])
t.close()
""")
        assert issuer.strip() == f"cellblock session {sid}", issuer
        assert run_ok(kc, "import os; print(any(v.startswith('Bearer tok-') "
                          "for v in os.environ.values()))") == "False\n"
    finally:
        problems = srv.shutdown()
        upstream.shutdown()
        upstream.server_close()
        assert not problems, "\n".join(problems)


def test_a_runtime_the_swarm_cannot_run_is_refused(swarm):
    # Services run on each node engine's default runtime: a session that asks
    # for gVisor is told so at once, not run on runc without a word.
    reply = swarm.call("session_create_request", {"runtime": "runsc"})
    ename, evalue = error_of(reply)
    assert ename == "UnknownRuntime", reply["content"]
    assert "not available on the swarm backend" in evalue, evalue


def test_png_analysis_through_a_swarm_session(swarm):
    sid, kc, _ = swarm.open_session()
    rep, iopub = execute(kc, conformance.PLOT_CODE)
    assert rep["content"]["status"] == "ok", rep["content"]
    pngs = [m["content"]["data"]["image/png"] for m in iopub
            if m["msg_type"] == "display_data" and "image/png" in m["content"]["data"]]
    assert len(pngs) == 1
    import base64
    assert base64.b64decode(pngs[0]).startswith(conformance.PNG_MAGIC)
    swarm.ok("session_close_request", {"session_id": sid})


def test_caps_timeouts_and_close_as_with_runc(bed, swarm):
    sid, kc, _ = swarm.open_session(limits={"max_executions": 2})
    assert run_ok(kc, "x = 1") == ""
    assert run_ok(kc, "print(x + 1)") == "2\n"
    rep, _ = execute(kc, "print(3)")
    assert error_of(rep)[0] == "ExecutionLimitExceeded", rep["content"]
    swarm.ok("session_close_request", {"session_id": sid})
    # Closed: its service is gone from the engine, and the session answers SessionClosed.
    wait_for(lambda: f"cb-{sid}" not in services_of(bed, server_id_of(swarm)), timeout=30)
    rep, _ = execute(kc, "print(4)")
    assert error_of(rep)[0] == "SessionClosed", rep["content"]

    # An interrupt reaches a kernel on another node as a message on its
    # control channel: the timed-out cell ends, the session lives on.
    sid, kc, _ = swarm.open_session(limits={"exec_timeout_s": 2})
    # As with runc (test_server.py), the kernel's own KeyboardInterrupt answers.
    rep, iopub = execute(kc, "while True: pass", timeout=60)
    assert error_of(rep)[0] == "KeyboardInterrupt", rep["content"]
    assert rep["metadata"]["cellblock"]["timeout_s"] == 2
    assert run_ok(kc, "print('still here')") == "still here\n"

    # One that ignores the interrupt is killed: its service is removed.
    rep, _ = execute(kc, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                         "while True: pass", timeout=90)
    assert error_of(rep)[0] == "ExecutionTimeout", rep["content"]
    info = wait_for(lambda: (lambda i: i if i["state"] == "closed" else None)(swarm.info_of(sid)),
                    timeout=30)
    assert info["close_reason"] == "exec_timeout", info
    wait_for(lambda: f"cb-{sid}" not in services_of(bed, server_id_of(swarm)), timeout=30)


def test_a_swarm_sessions_cpu_and_memory_are_its_tasks_own(swarm):
    """The server cannot read a node's cgroups: the kernel reports its task's
    (cellblock_ipykernel.CgroupUsage) and the reply's figures are this
    execution's, not the kernel's whole life's."""
    sid, kc, _ = swarm.open_session()
    spin_and_fill = ("import time\n"
                     "t = time.process_time()\n"
                     "while time.process_time() - t < 0.6: pass\n"
                     "block = bytearray(96 << 20)\n"
                     "block[::4096] = b'x' * (96 << 8)\n")
    rep, _ = execute(kc, spin_and_fill)
    assert rep["content"]["status"] == "ok", rep["content"]
    md = rep["metadata"]["cellblock"]
    assert md["cpu_ms"] >= 550, md
    assert md["memory_peak_bytes"] >= 96 << 20, md
    rep, _ = execute(kc, "pass")
    assert rep["metadata"]["cellblock"]["cpu_ms"] < 300, rep["metadata"]["cellblock"]
    usage = swarm.info_of(sid)["usage"]
    assert usage["memory_bytes"] >= 96 << 20 and usage["cpu_ms"] >= 600, usage
    swarm.ok("session_close_request", {"session_id": sid})


# What a kernel says of its own memory: its personality, a str hash, the bytes
# of its mappings marked for KSM (VmFlags mg), and whether the mapping holding
# a 32 MB array the cell makes is one of them.
MEMORY_FACTS = (
    "import ctypes, json\n"
    "data = bytearray(32 << 20)\n"
    "where = ctypes.addressof((ctypes.c_char * 1).from_buffer(data))\n"
    "marked, data_marked, start, end = 0, False, 0, 0\n"
    "for line in open('/proc/self/smaps'):\n"
    "    head = line.split()[0]\n"
    "    if '-' in head and not head.endswith(':'):\n"
    "        start, end = (int(x, 16) for x in head.split('-'))\n"
    "    elif head == 'VmFlags:' and 'mg' in line.split()[1:]:\n"
    "        marked += end - start\n"
    "        data_marked = data_marked or start <= where < end\n"
    "print(json.dumps({'personality': open('/proc/self/personality').read().strip(),\n"
    "                  'hash': hash('cellblock'), 'marked': marked,\n"
    "                  'data_marked': data_marked}))\n")


def test_the_attack_suites_system_call_cases_hold_in_a_swarm_session(swarm):
    """test_attacks_syscalls.py's cases against a swarm-placed session: every
    call of the policy with arguments the kernel would reject on its own is
    stopped by the filters, and the session cannot join same-page merging."""
    sid, kc, _ = swarm.open_session()
    try:
        attacks.test_raw_syscalls_with_invalid_arguments_are_stopped_by_the_policy({"kc": kc})
        attacks.test_no_session_can_join_same_page_merging({"kc": kc})
    finally:
        kc.stop_channels()
        swarm.ok("session_close_request", {"session_id": sid})


def test_kernels_share_their_boot_memory_only_when_the_server_asks(bed, swarm):
    """serve --swarm-share-boot-memory (docs/scale-out.md, "Density"): on nodes
    whose engine profile is cellblock's, each kernel boots with a fixed layout
    and hash seed and marks its boot memory for KSM, never the session's own
    data; the default server's kernels keep a random layout and mark nothing."""
    srv = ServerProcess(new_state_dir(),
                        swarm_args(bed, pool=1) + ["--swarm-share-boot-memory"]).start()
    try:
        facts = []
        for _ in range(2):
            sid, kc, _ = srv.open_session()
            facts.append(json.loads(run_ok(kc, MEMORY_FACTS)))
            srv.ok("session_close_request", {"session_id": sid})
        for seen in facts:
            assert int(seen["personality"], 16) & 0x0040000, seen  # ADDR_NO_RANDOMIZE
            assert seen["marked"] > 8 << 20, seen  # the interpreter's and ipykernel's pages
            assert not seen["data_marked"], f"the session's own array was marked: {seen}"
        assert facts[0]["hash"] == facts[1]["hash"]
    finally:
        srv.close_clients()
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    _, kc, _ = swarm.open_session()
    plain = json.loads(run_ok(kc, MEMORY_FACTS))
    assert not int(plain["personality"], 16) & 0x0040000, plain
    assert plain["marked"] == 0, plain


def test_a_swarm_session_killed_at_its_memory_limit_says_so(swarm):
    """The front cannot read a node's cgroups: the task's shim writes to its
    log that its memory cgroup killed the kernel (kMemoryLimitReached) and
    how the kernel ended, and the front reads that once the task has ended.
    The client is told MemoryLimitExceeded with the limit, as on runc."""
    sid, kc, _ = swarm.open_session(limits={"memory_mb": 256})
    bomb = ("chunks = []\n"
            "for i in range(64):\n"
            "    chunks.append(b'\\x5a' * (64 << 20))\n"
            "print('allocated', len(chunks) * 64, 'MB without being stopped')\n")
    rep, iopub = execute(kc, bomb, timeout=180)
    content = rep["content"]
    assert content["status"] == "error" and content["ename"] == "MemoryLimitExceeded", content
    assert "memory limit of 256 MB reached" in content["evalue"], content
    assert "killed by signal 9" in content["evalue"], content
    info = swarm.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"].startswith("memory_limit: "), info


def _sha(data):
    import hashlib
    return hashlib.sha256(data).hexdigest()


def test_files_go_to_and_from_a_swarm_session_through_its_kernel(swarm, tmp_path):
    """A swarm session has no directory on the front's host: the front keeps a
    copy (STATE_DIR/remote-files/<session>, root's, 0700) and moves the bytes
    over the kernel's control channel (server/kernel_files.hpp). Streamed
    (over several 4 MiB pieces), whole, and by descriptor, both ways; the
    listing; the errors the local files give; the copy gone at close."""
    sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", ""), "clients",
                                    "python"))
    import cellblock

    check = ("import hashlib, os\n"
             "def seen(p):\n"
             "    b = open(p, 'rb').read()\n"
             "    print(hashlib.sha256(b).hexdigest(), len(b))\n")
    with cellblock.connect(state_dir=swarm.state_dir) as cb, \
            cb.session(limits={"disk_mb": 48, "output_mb": 64}) as s:
        staged = os.path.join(swarm.state_dir, "remote-files", s.id)
        big = os.urandom((9 << 20) + 123)
        done = []
        assert s.put("in/data.bin", big, progress=lambda d, t: done.append(d),
                     local=False) == "/data/input/in/data.bin"
        assert done[-1] == len(big)
        r = s.run(check + "seen('/data/input/in/data.bin')")
        assert r.stdout.split() == [_sha(big), str(len(big))], (r.stdout, r.error)
        assert s.put("small.txt", b"hello") == "/data/input/small.txt"
        assert s.run("print(open('/data/input/small.txt').read())").stdout == "hello\n"
        # A put again replaces it.
        s.put("small.txt", b"hello again")
        assert s.run("print(open('/data/input/small.txt').read())").stdout == "hello again\n"
        # By descriptor, from a file on the front's host.
        local_file = tmp_path / "local.bin"
        local_bytes = os.urandom(5 << 20)
        local_file.write_bytes(local_bytes)
        assert s.put("local.bin", local_file, local=True, sha256=_sha(local_bytes)) == \
            "/data/input/local.bin"
        r = s.run(check + "seen('/data/input/local.bin')")
        assert r.stdout.split() == [_sha(local_bytes), str(len(local_bytes))], r.error
        # Over the session's disk_mb (48 MB: 14 MiB are in already): refused
        # at the front, before a byte moves.
        with pytest.raises(cellblock.FileTooLarge):
            s.put("huge.bin", b"x" * (40 << 20), local=False)

        r = s.run("import hashlib, os\n"
                  "os.makedirs('/data/output/out', exist_ok=True)\n"
                  "b = bytes(range(256)) * (26 << 12)\n"
                  "open('/data/output/out/result.bin', 'wb').write(b)\n"
                  "open('/data/output/table.csv', 'w').write('a,b\\n1,2\\n')\n"
                  "os.symlink('/etc/passwd', '/data/output/link')\n"
                  "print(hashlib.sha256(b).hexdigest(), len(b))")
        want_sha, want_size = r.stdout.split()
        got = s.get("out/result.bin", local=False)
        assert _sha(got) == want_sha and len(got) == int(want_size) > (8 << 20)
        dest = tmp_path / "result.bin"
        s.get("out/result.bin", dest, local=True)
        assert _sha(dest.read_bytes()) == want_sha
        assert s.get("table.csv") == b"a,b\n1,2\n"
        listing = swarm.ok("file_list_request", {"session_id": s.id})["content"]
        listed = {f["path"]: f["size"] for f in listing["files"]}
        assert listed == {"out/result.bin": int(want_size), "table.csv": 8}, listing
        with pytest.raises(cellblock.FileNotFound):
            s.get("missing.bin")
        with pytest.raises(cellblock.FileError):
            s.get("link")   # the code's link is not followed
        with pytest.raises(cellblock.InvalidPath):
            s.get("../input/small.txt")
        # Gets at once: each whole (their own partial files at the front), at
        # most 4 moving through the kernel, the fifth told so.
        replies = swarm.call_many([("file_get_request", {"session_id": s.id,
                                                         "path": "out/result.bin"})] * 5)
        statuses = [r["content"]["status"] for r in replies]
        assert statuses.count("ok") == 4, [r["content"] for r in replies]
        assert replies[4]["content"]["ename"] == "TooManyTransfers", replies[4]["content"]
        for r in replies[:4]:
            assert r["content"]["size"] == int(want_size)
        # The front's copy is root's alone; the pulled files did not stay.
        st = os.stat(staged)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700, oct(st.st_mode)
        assert os.listdir(os.path.join(staged, "output")) in ([], ["out"]), \
            os.listdir(os.path.join(staged, "output"))
    assert not os.path.exists(staged), os.listdir(staged)


def test_a_client_cannot_send_the_kernel_the_servers_own_file_messages(swarm):
    """cellblock_file_* go from the front to the kernel only: sent by a
    client on the session's control channel, they are refused there, and the
    kernel never writes the file."""
    sid, kc, _ = swarm.open_session()
    msg = kc.session.msg("cellblock_file_write_request",
                         {"transfer": "t1", "path": "planted.txt", "offset": 0, "last": True})
    kc.control_channel.send(msg)
    reply = kc.get_control_msg(timeout=30)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "UnknownRequest", reply["content"]
    assert "server's own" in reply["content"]["evalue"]
    assert run_ok(kc, "import os; print(os.path.exists('/data/input/planted.txt'))") == \
        "False\n"
    swarm.ok("session_close_request", {"session_id": sid})


def test_a_swarm_session_hibernates_and_wakes_in_a_new_service_with_everything(bed, swarm):
    """Hibernation through the kernel: the snapshot is fetched over the
    control channel into the front's sealed store with the inputs the front
    keeps, the service goes (nothing of the session runs on any node), and
    the next request wakes it in another service, its inputs and the
    snapshot sent to the new kernel first."""
    sid, kc, _ = swarm.open_session()
    server_id = server_id_of(swarm)
    swarm.ok("file_put_request", {"session_id": sid, "path": "in/data.txt"},
             buffers=[b"kept input"])
    assert run_ok(kc, "x = 41\nimport pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})") == ""
    wait_for(lambda: f"cb-{sid}" in services_of(bed, server_id), timeout=60)
    before = services_of(bed, server_id)[f"cb-{sid}"]
    reply = swarm.ok("session_hibernate_request", {"session_id": sid}, timeout=180)["content"]
    assert reply["state"] == "hibernated" and reply["snapshot_bytes"] > 0, reply
    wait_for(lambda: f"cb-{sid}" not in services_of(bed, server_id), timeout=30)
    assert swarm.info_of(sid)["state"] == "hibernated"
    # The same client: its next cell wakes it, in a new service.
    assert run_ok(kc, "print(x + 1, df['a'].sum(), open('/data/input/in/data.txt').read())",
                  timeout=180) == "42 3 kept input\n"
    services = services_of(bed, server_id)
    assert f"cb-{sid}" not in services or services[f"cb-{sid}"] != before, services
    # The snapshot it was restored from stays neither in the task nor in the
    # front's copy.
    # (The kernel's own .cellblock-partial, where uploads are written, stays.)
    assert run_ok(kc, "import os; print(sorted(os.listdir('/data/input')))") == \
        "['.cellblock-partial', 'in']\n"
    staged = os.path.join(swarm.state_dir, "remote-files", sid, "input")
    assert sorted(os.listdir(staged)) == ["in"], os.listdir(staged)
    kinds = [e["kind"] for e in swarm.ok("session_history_request",
                                         {"session_id": sid})["content"]["events"]]
    assert "hibernated" in kinds and "resumed" in kinds, kinds
    swarm.ok("session_close_request", {"session_id": sid})


def test_a_drained_worker_moves_its_sessions_to_another_with_their_state(bed, swarm):
    """`docker node update --availability drain` of a session's worker: the
    engine stops its task after the service's stop grace (the shim holds the
    SIGTERM), and meanwhile the session hibernates through its kernel and
    wakes in a new service on the other worker, with its variables and
    inputs, for the same client. A cell that comes during the move waits
    for it."""
    sid, kc, _ = swarm.open_session()
    server_id = server_id_of(swarm)
    swarm.ok("file_put_request", {"session_id": sid, "path": "kept.txt"}, buffers=[b"input"])
    assert run_ok(kc, "x = 41") == ""
    drained = node_of(bed, sid)
    before = services_of(bed, server_id)[f"cb-{sid}"]

    def kinds():
        return [e["kind"] for e in swarm.ok("session_history_request",
                                            {"session_id": sid})["content"]["events"]]

    bed.docker("node", "update", "--availability", "drain", drained)
    try:
        assert wait_for(lambda: "moving" in kinds(), timeout=60), kinds()
        # Sent while it moves: answered once it has, by the woken kernel.
        assert run_ok(kc, "print(x + 1, open('/data/input/kept.txt').read())",
                      timeout=180) == "42 input\n"
        # Its old service is gone: the kernel that answered is a new one,
        # which the engine places on no drained node.
        assert wait_for(lambda: before not in services_of(bed, server_id).values(),
                        timeout=30), services_of(bed, server_id)
        assert ["moving", "hibernated", "resumed"] == \
            [k for k in kinds() if k in ("moving", "hibernated", "resumed")], kinds()
        events = swarm.ok("session_history_request", {"session_id": sid})["content"]["events"]
        print("the move:", [(e["kind"], e.get("detail", "")) for e in events
                            if e["kind"] in ("moving", "hibernated", "resumed")])
        assert swarm.info_of(sid)["state"] != "closed"
        # The drained task's kernel was asked to exit once its service went:
        # nothing of the session is left on the drained node, long before
        # the grace of 120 s (swarm_args) would have ended it.
        worker = next(w["name"] for w in bed.describe()["workers"] if w["container"] == drained)

        def left():
            return [c["Names"] for c in bed.containers_on(worker)
                    if c["Names"].startswith(f"cb-{sid}.")]
        assert wait_for(lambda: not left(), timeout=60), left()
    finally:
        bed.docker("node", "update", "--availability", "active", drained)
    swarm.ok("session_close_request", {"session_id": sid})


class SwarmKernelTests(conformance.ServerSessionKernelTests):
    """jupyter_kernel_test's suite, and cellblock's own conformance checks,
    against a session the swarm placed."""

    __test__ = True


@pytest.fixture(scope="module", autouse=True)
def _kernel_tests_server(swarm_server):
    SwarmKernelTests.server_for_class = swarm_server
    yield


def secrets_of(bed, server_id):
    return bed.docker("secret", "ls", "--filter", f"label=cellblock.server={server_id}",
                      "-q").split()


def test_kill9_of_the_server_then_restart_adopts_its_services(bed, tmp_path, upstream):
    """Phase 3 of docs/restarts.md: the services outlive a killed server, and
    the next start on its state dir takes each session's service back (the
    same task: the kernel and its variables) through its clients' old
    connection info; what no session held (the pool's) is removed. A
    session with the egress gateway has its way out again (a new tunnel to
    the same task, to the new server's gateway)."""
    srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=1) + egress_args(upstream) + [
        "--key-file", str(tmp_path / "server.key")]).start()
    echo = f"http://{egress.API}:{upstream}/echo"
    try:
        opened = []
        for n in range(2):
            network = {"mode": "gateway" if n == 1 else "none"}
            sid, kc, _ = srv.open_session(limits={"network": network})
            assert run_ok(kc, f"kept = {n} * 10 + 7") == ""
            opened.append((sid, kc))
        assert egress.fetch(opened[1][1], echo)["status"] == 200
        server_id = server_id_of(srv)
        wait_for(lambda: len(services_of(bed, server_id)) == 3, timeout=60)
        before = services_of(bed, server_id)
        tasks = {sid: node_of(bed, sid) for sid, _ in opened}
        watch = ShellWatch(opened[0][1])
        srv.kill9()
        # Nothing removes them while the grace runs.
        time.sleep(1)
        assert services_of(bed, server_id) == before
        # Sent while no server runs (once the client has seen it go):
        # answered once the next one adopts it.
        assert watch.wait_closed(timeout=60)
        pending = opened[0][1].execute("print(kept + 1)")
        # What a session no longer live left in the front's directory goes at
        # the next start; an adopted gateway session's listener is made again.
        stale = os.path.join(srv.state_dir, "remote-egress", "0123456789abcdef")
        os.makedirs(stale)
        srv.start()
        assert not os.path.exists(stale)
        assert os.listdir(os.path.join(srv.state_dir, "remote-egress")) == [opened[1][0]]
        log = srv.log()
        for sid, _ in opened:
            assert f"session {sid}: its service adopted" in log, log[-3000:]
            assert f"session {sid}: adopted" in log, log[-3000:]
        pool = set(before) - {f"cb-{sid}" for sid, _ in opened}
        for name in pool:
            assert f"removed service {name}" in log, log[-3000:]
        after = services_of(bed, server_id)
        for sid, _ in opened:
            assert after[f"cb-{sid}"] == before[f"cb-{sid}"], (before, after)
            assert node_of(bed, sid) == tasks[sid]
        reply = opened[0][1].get_shell_msg(timeout=120)
        while reply["parent_header"].get("msg_id") != pending:
            reply = opened[0][1].get_shell_msg(timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        for n, (sid, kc) in enumerate(opened):
            assert run_ok(kc, "print(kept)") == f"{n * 10 + 7}\n"
            kinds = [e["kind"] for e in srv.ok("session_history_request",
                                               {"session_id": sid})["content"]["events"]]
            assert "adopted" in kinds, kinds
        got = egress.fetch(opened[1][1], echo)
        assert got["status"] == 200 and json.loads(got["body"])["path"] == "/echo", got
        assert egress.fetch(opened[0][1], echo)["status"] == 403
        sid, kc, _ = srv.open_session()
        assert run_ok(kc, "print(2)") == "2\n"
    finally:
        server_id = server_id_of(srv)
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    assert services_of(bed, server_id) == {}
    assert secrets_of(bed, server_id) == []


def test_sighup_leaves_the_services_running_and_the_next_start_adopts_them(bed, tmp_path):
    """A planned restart (SIGHUP) of a Swarm server: a session's service runs
    on through the exec (the same service, task and node) and the next start
    adopts it, so its client goes on with its variables through its old
    connection info. Swarm sessions cannot hibernate: until stop 46 SIGHUP
    closed them."""
    srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=1) + [
        "--key-file", str(tmp_path / "server.key")]).start()
    try:
        sid, kc, _ = srv.open_session()
        assert run_ok(kc, "kept = 17") == ""
        server_id = server_id_of(srv)
        wait_for(lambda: f"cb-{sid}" in services_of(bed, server_id), timeout=60)
        before = services_of(bed, server_id)[f"cb-{sid}"]
        node = node_of(bed, sid)
        starts = srv.log().count("cellblock serve: manager on")
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: srv.log().count("cellblock serve: manager on") > starts,
                        timeout=120), srv.log()[-3000:]
        assert f"session {sid}: its service adopted" in srv.log(), srv.log()[-3000:]
        assert run_ok(kc, "print(kept)") == "17\n"
        assert services_of(bed, server_id)[f"cb-{sid}"] == before
        assert node_of(bed, sid) == node
        kinds = [e["kind"] for e in srv.ok("session_history_request",
                                           {"session_id": sid})["content"]["events"]]
        assert "handed_over" in kinds and "adopted" in kinds, kinds
    finally:
        server_id = server_id_of(srv)
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    assert services_of(bed, server_id) == {}


def test_sigusr2_hibernates_swarm_sessions_and_the_next_start_wakes_them(bed, tmp_path):
    """SIGUSR2 hands over and exits: a swarm session hibernates through its
    kernel (its service removed) and the next server on the state dir wakes
    it in a new service at its client's first request, through the same
    connection info, with its variables and inputs. Until stop 51 swarm
    sessions could not hibernate and were closed."""
    srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=1) + [
        "--key-file", str(tmp_path / "server.key")]).start()
    try:
        sid, kc, _ = srv.open_session()
        server_id = server_id_of(srv)
        srv.ok("file_put_request", {"session_id": sid, "path": "note.txt"}, buffers=[b"still"])
        assert run_ok(kc, "kept = 23") == ""
        wait_for(lambda: f"cb-{sid}" in services_of(bed, server_id), timeout=60)
        srv.proc.send_signal(signal.SIGUSR2)
        assert srv.proc.wait(timeout=180) == 0, srv.log()[-3000:]
        assert "1 session(s) handed over" in srv.log(), srv.log()[-3000:]
        assert f"cb-{sid}" not in services_of(bed, server_id)
        srv.start()
        assert srv.info_of(sid)["state"] == "hibernated"
        assert run_ok(kc, "print(kept, open('/data/input/note.txt').read())",
                      timeout=180) == "23 still\n"
    finally:
        server_id = server_id_of(srv)
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    assert services_of(bed, server_id) == {}


def test_without_a_grace_a_restart_removes_every_service_it_had(bed):
    srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=1) + ["--adopt-grace", "0"]).start()
    try:
        sid, kc, _ = srv.open_session()
        assert run_ok(kc, "print(1)") == "1\n"
        server_id = server_id_of(srv)
        wait_for(lambda: len(services_of(bed, server_id)) == 2, timeout=60)
        before = services_of(bed, server_id)
        srv.close_clients()
        srv.kill9()
        # Nothing removed them: they run on, unowned, until the server is back.
        assert services_of(bed, server_id) == before
        srv.start()
        for name in before:
            assert f"removed service {name}" in srv.log(), srv.log()
        assert not set(services_of(bed, server_id)) & set(before)
        assert srv.info_of(sid)["state"] == "closed"
    finally:
        server_id = server_id_of(srv)
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)
    assert services_of(bed, server_id) == {}


def test_when_no_server_comes_back_the_keeper_removes_the_services(bed, tmp_path):
    """No server starts after the crash: past --adopt-grace the keeper the
    server started removes every service and secret labelled with its id and
    marks the sessions closed, naming why."""
    srv = ServerProcess(new_state_dir(), swarm_args(bed, pool=1) + [
        "--key-file", str(tmp_path / "server.key"), "--adopt-grace", "3"]).start()
    server_id = server_id_of(srv)
    try:
        sid, kc, _ = srv.open_session()
        assert run_ok(kc, "z = 1") == ""
        wait_for(lambda: len(services_of(bed, server_id)) == 2, timeout=60)
        srv.close_clients()
        srv.kill9()
        assert wait_for(lambda: services_of(bed, server_id) == {}
                        and secrets_of(bed, server_id) == [], timeout=90), \
            (services_of(bed, server_id), srv.log()[-3000:])
        assert "cellblock keep: removed swarm service cb-" + sid in srv.log(), srv.log()[-3000:]
        srv.start()
        info = srv.info_of(sid)
        assert info["state"] == "closed" and info["close_reason"] == "server_restart", info
    finally:
        problems = srv.shutdown()
        assert not problems, "\n".join(problems)


def test_a_killed_worker_closes_its_sessions_as_node_lost(bed, swarm):
    # Runs last: it takes a worker away for good.
    opened = []
    for _ in range(4):
        sid, kc, _ = swarm.open_session()
        assert run_ok(kc, "y = 7") == ""
        opened.append((sid, kc, node_of(bed, sid)))
    victim = opened[0][2]
    worker = next(w["name"] for w in bed.describe()["workers"] if w["container"] == victim)
    lost = [(sid, kc) for sid, kc, node in opened if node == victim]
    kept = [(sid, kc) for sid, kc, node in opened if node != victim]
    bed.kill_worker(worker)

    def closed(sid):
        info = swarm.info_of(sid)
        return info if info["state"] == "closed" else None

    for sid, kc in lost:
        info = wait_for(lambda: closed(sid), timeout=90)
        assert info and info["close_reason"].startswith("node_lost: "), info
        assert victim in info["close_reason"], info
        rep, _ = execute(kc, "print(y)")
        ename, evalue = error_of(rep)
        assert ename == "SessionClosed" and "node_lost" in evalue, rep["content"]
        # Its service is removed from the engine, not left to be re-placed.
        wait_for(lambda: f"cb-{sid}" not in services_of(bed, server_id_of(swarm)), timeout=30)
    for sid, kc in kept:
        assert run_ok(kc, "print(y)") == "7\n"
        assert swarm.info_of(sid)["state"] != "closed"
    # New sessions go to the live worker.
    for _ in range(2):
        sid, kc, _ = swarm.open_session()
        assert run_ok(kc, "print('fresh')") == "fresh\n"
        assert node_of(bed, sid) != victim
