"""The swarm testbed does what cellblock's Swarm backend will rely on.

Run: sudo /usr/bin/python3 -m pytest -v tests/swarm/test_testbed.py   (about 50 s)
"""

import json
import os
import socket
import subprocess
import tempfile
import time

import pytest

import testbed
import residue

# A one-line service: answers each connection with its hostname and the peer's address.
ECHO = ("import socket, os\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 5555)); s.listen()\n"
        "while True:\n"
        "    c, a = s.accept(); c.sendall(('%s %s\\n' % (os.uname().nodename, a[0])).encode()); c.close()\n")

# Run inside the service's container: which of the (host, port) pairs it can connect to.
PROBE = ("import json, socket, sys\n"
         "reached = []\n"
         "for host, port in json.loads(sys.argv[1]):\n"
         "    with socket.socket() as s:\n"
         "        s.settimeout(1.5)\n"
         "        if s.connect_ex((host, port)) == 0:\n"
         "            reached.append([host, port])\n"
         "print(json.dumps(reached))\n"
         "try:\n"
         "    socket.getaddrinfo('exfiltrate.example', 80)\n"
         "except OSError:\n"
         "    pass\n")


def _up(workers):
    directory = tempfile.mkdtemp(prefix="cbsw-test-", dir="/tmp")
    try:
        return testbed.up(directory, workers)
    except testbed.DaemonStartFailed as e:
        testbed.down(directory)
        pytest.skip(f"dockerd cannot start on this host: {e}")
    except Exception:
        testbed.down(directory)
        raise


@pytest.fixture(scope="module")
def bed():
    if os.geteuid() != 0:
        pytest.skip("the swarm testbed needs root (bridges, dockerd, cgroups)")
    started = time.monotonic()
    instance = _up(2)
    print(f"\nup: {time.monotonic() - started:.1f} s")
    yield instance
    if os.path.isdir(instance.dir):
        testbed.down(instance.dir)


def _task(bed, service):
    ids = bed.docker("service", "ps", "-q", "--no-trunc", "--filter", "desired-state=running",
                     service).split()
    return json.loads(bed.docker("inspect", *ids))[0] if ids else None


def _node_ids(bed):
    return {n["Worker"]: n["ID"] for n in bed.nodes()}


def _read_line(port, timeout=5.0):
    with socket.create_connection((testbed.CONNECT_HOST, port), timeout=timeout) as s:
        s.settimeout(timeout)
        return s.recv(200).decode()


def test_three_nodes_manager_drained_workers_ready(bed):
    nodes = bed.nodes()
    assert len(nodes) == 3
    managers = [n for n in nodes if n["Spec"]["Role"] == "manager"]
    workers = [n for n in nodes if n["Spec"]["Role"] == "worker"]
    assert len(managers) == 1 and managers[0]["Spec"]["Availability"] == "drain"
    assert managers[0]["ManagerStatus"]["Leader"] is True
    assert sorted(n["Worker"] for n in workers) == ["w1", "w2"]
    for n in nodes:
        assert n["Status"]["State"] == "ready", n["Status"]
    for n in workers:
        assert n["Spec"]["Availability"] == "active"
        assert n["Status"]["Addr"] == bed.worker(n["Worker"])["addr"]
    ranges = [tuple(w["ports"]) for w in bed.state["workers"]]
    assert ranges[0][1] < ranges[1][0], "workers' port ranges overlap"


def test_node_setup_check_passes_on_every_worker_and_rerun_changes_nothing(bed):
    for name in bed.workers:
        out = bed.node_setup(name, "--check")
        assert "node-setup: ready" in out and "missing" not in out, out
        rerun = bed.node_setup(name)
        assert all(line.split()[1] in ("present", "ready") for line in rerun.splitlines()), rerun


def test_session_like_service_reachable_from_host_and_fenced(bed):
    # A resolver on the manager's address: Docker's DNS forwards a session's queries to it
    # from the session's own namespace, which the node's firewall must stop.
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resolver.bind((bed.manager_addr, 53))
    resolver.setblocking(False)
    created = time.monotonic()
    bed.docker("service", "create", "-d", "--name", "echo", "--no-resolve-image",
               "--network", testbed.SESSION_NETWORK, "--endpoint-mode", "dnsrr",
               "--dns", bed.manager_addr, "--dns-option", "timeout:1", "--dns-option", "attempts:1",
               "--publish", "mode=host,target=5555", "--stop-grace-period", "0s",
               "--mount", "type=bind,src=/usr,dst=/usr,ro",
               testbed.NODE_IMAGE, "/usr/bin/python3", "-c", ECHO)
    deadline = created + 60
    answer = port = task = None
    while time.monotonic() < deadline and answer is None:
        task = _task(bed, "echo")
        ports = (task or {}).get("Status", {}).get("PortStatus", {}).get("Ports", [])
        if task and task["Status"]["State"] == "running" and ports:
            port = ports[0]["PublishedPort"]
            try:
                # Docker's proxy on the host accepts before the task listens and closes at
                # once while it does not: an empty read means "not yet", not "no answer".
                answer = _read_line(port, timeout=2) or None
            except OSError:
                pass
        if answer is None:
            time.sleep(0.1)
    reachable_s = time.monotonic() - created
    print(f"\nservice create -> reachable at {testbed.CONNECT_HOST}:{port}: {reachable_s:.2f} s")
    assert answer, f"no answer from the service within 60 s; last task: {task}"

    node_ids = _node_ids(bed)
    worker = next((w for w, i in node_ids.items() if i == task["NodeID"]), None)
    assert worker in ("w1", "w2"), f"task placed on {task['NodeID']}, not on a worker"
    lo, hi = bed.worker(worker)["ports"]
    assert lo <= port <= hi
    # The session sees the connection come from its node's end of the sessions'
    # bridge (node-setup masquerades into it: a session has no default route).
    assert answer.split()[1] == testbed.SESSION_SUBNET.rsplit(".", 1)[0] + ".1"

    container = task["Status"]["ContainerStatus"]["ContainerID"]
    ours = [c["ID"] for c in bed.containers_on(worker)]
    assert container in ours
    links = bed.worker_exec(worker, ["exec", container, "/usr/sbin/ip", "-o", "link", "show"])
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) \
        == ["eth0", "lo"], links
    addrs = bed.worker_exec(worker, ["exec", container, "/usr/sbin/ip", "-o", "addr", "show"])
    inet = [line.split()[3] for line in addrs.splitlines() if line.split()[1:3] == ["eth0", "inet"]]
    assert len(inet) == 1 and inet[0].startswith("10.215.0.") and inet[0].endswith("/24"), addrs

    # node-setup.sh's firewall: the session reaches neither its node nor the manager.
    w = bed.worker(worker)
    other = next(x for x in bed.state["workers"] if x is not w)
    targets = [[bed.manager_addr, 2377], [w["addr"], 2377], [w["addr"], 7946],
               ["10.215.0.1", 2377], [other["addr"], 2377], ["127.0.0.1", 5555]]
    reached = json.loads(bed.worker_exec(worker, ["exec", container, "/usr/bin/python3", "-c",
                                                  PROBE, json.dumps(targets)]))
    assert reached == [["127.0.0.1", 5555]], reached
    try:
        query = resolver.recvfrom(512)
    except BlockingIOError:
        query = None
    resolver.close()
    assert query is None, f"a DNS query left the session: {query}"

    # --allow-from: the other worker, not being the front, cannot open the session's port.
    other_probe = testbed.run([testbed.DOCKER, "-H", "unix://" + bed.manager_socket, "exec",
                               other["container"], "/usr/bin/python3", "-c", PROBE,
                               json.dumps([[w["addr"], port]])])
    assert json.loads(other_probe) == [], "a non-front source reached the session's port"
    assert _read_line(port).split()[0], "the front lost the session after the probe"


def test_killed_worker_is_down_within_60s(bed):
    task = _task(bed, "echo")
    assert task, "needs the echo service of the previous test"
    victim = next(w for w, i in _node_ids(bed).items() if i == task["NodeID"])
    killed = time.monotonic()
    bed.kill_worker(victim)
    state = None
    while time.monotonic() - killed < 60:
        node = next(n for n in bed.nodes() if n["Worker"] == victim)
        state = node["Status"]["State"]
        if state == "down":
            break
        time.sleep(0.5)
    print(f"\n{victim} killed -> node down: {time.monotonic() - killed:.1f} s")
    assert state == "down"
    # The lost task keeps State running; only its DesiredState and its node tell it is gone.
    lost = json.loads(bed.docker("inspect", task["ID"]))[0]
    assert lost["NodeID"] == task["NodeID"] and lost["DesiredState"] in ("running", "shutdown")


def test_two_instances_coexist_and_down_after_crash_leaves_nothing(bed):
    second = _up(1)
    try:
        assert second.tag != bed.tag and second.state["net"] != bed.state["net"]
        # No collision with the first instance's ports in use. A worker the test
        # before killed (whichever ran the echo task) holds none: its block may
        # be given out again, and a killed worker is never started again.
        live = [w["ports"] for w in bed.state["workers"] if bed.worker_running(w["name"])]
        assert live, "the first instance has no running worker left"
        assert all(w["ports"] not in live for w in second.state["workers"]), (
            second.state["workers"], live)
        assert [n["Status"]["State"] for n in second.nodes()].count("ready") == 2
    finally:
        # A crash: the manager's dockerd dies without cleaning anything up.
        pid = int(open(os.path.join(second.dir, "outer", "dockerd.pid")).read())
        os.kill(pid, 9)
        left = testbed.down(second.dir)
    assert left == []
    assert residue.find_residue(second.dir, second.tag, second.marks()) == []
    assert second.shim_sockets() == [], "a killed shim's socket in /run/containerd/s"


def test_down_leaves_nothing_and_is_idempotent(bed):
    started = time.monotonic()
    left = testbed.down(bed.dir)
    print(f"\ndown: {time.monotonic() - started:.1f} s")
    assert left == []
    assert residue.find_residue(bed.dir, bed.tag, bed.marks()) == []
    assert bed.shim_sockets() == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert bed.tag not in links
    assert testbed.down(bed.dir) == []
