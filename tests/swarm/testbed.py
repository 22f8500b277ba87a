#!/usr/bin/python3
"""A three-node Docker Swarm on one host, private to one instance, for cellblock's Swarm backend.

    /usr/bin/python3 tests/swarm/testbed.py up --dir DIR [--workers 2]   # prints JSON, leaves it up
    /usr/bin/python3 tests/swarm/testbed.py status --dir DIR
    /usr/bin/python3 tests/swarm/testbed.py down --dir DIR               # idempotent, also after a crash

The manager is a private dockerd on the host (own data/exec root, socket, bridge,
containerd namespace), drained so that sessions only run on the workers. Each
worker is a docker-in-docker container on that daemon with its own network
namespace and firewall (deploy/swarm/node-setup.sh runs inside it) and a
disjoint range of host ports: a session published on a worker at port P is
reached at 127.0.0.1:P. See README.md beside this file.
"""

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import residue  # noqa: E402
import skeleton  # noqa: E402

DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
DOCKER_INIT = "/usr/bin/docker-init"  # tini, which docker.io depends on
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE_SETUP = os.path.join(REPO, "deploy", "swarm", "node-setup.sh")

NODE_IMAGE = "cellblock-testbed/node:1"
SESSION_NETWORK = "cellblock-sessions"
SESSION_CONFIG_NETWORK = "cellblock-sessions-config"
SESSION_SUBNET = "10.215.0.0/24"
SESSION_BRIDGE = "cbsess0"
WORKER_SOCKET = "unix:///run/docker.sock"
# up(engine_profile=...): the instance's copy (outer/), and where a worker binds it.
ENGINE_PROFILE_NAME = "engine-seccomp.json"
WORKER_ENGINE_PROFILE = "/etc/cellblock-engine-seccomp.json"
CONNECT_HOST = "127.0.0.1"
PORTS_PER_WORKER = 40
# Host ports handed to workers: below the host's ephemeral range, so that no
# outgoing connection of the host takes one between allocation and use.
PORT_SEARCH = (30000, 32760)
DATA_PATH_PORTS = (47890, 47990)
MANAGER_NETS = ("10.213", "10.214")  # the workers' bridge, the manager's docker_gwbridge
SOCKET_PATH_MAX = 107
# What a host image's sessions bind from their node besides /usr (images/host
# host_binds): a worker binds the host's, as a node with Python installed has them.
with open(os.path.join(REPO, "images", "host", "image.json")) as _f:
    HOST_IMAGE_BINDS = [p for p in json.load(_f).get("host_binds", []) if os.path.exists(p)]
ALLOCATION_LOCK = "\0cellblock-swarm-testbed-allocation"  # abstract: vanishes with its holder

CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
    "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST",
    "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO",
    "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE",
    "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM",
    "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE")


class TestbedError(RuntimeError):
    """A step of the testbed failed; the message names the step."""


class AlreadyUp(TestbedError):
    """The directory holds an instance already (which `up` must not tear down)."""


class DaemonStartFailed(TestbedError):
    """The private dockerd did not come up: the host cannot run this testbed."""


def run(argv, *, input=None, check=True, timeout=120, env=None):
    """Runs a command, returns its stdout as text; on failure raises naming the command."""
    try:
        done = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"{' '.join(argv)}: no answer in {timeout} s") from None
    if check and done.returncode != 0:
        shown = " ".join(argv[:10]) + (" …" if len(argv) > 10 else "")
        raise TestbedError(f"{shown}: exit {done.returncode}: "
                           f"{done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode(errors="replace") if isinstance(done.stdout, bytes) else done.stdout


def bounding_capabilities() -> list:
    """Docker's names for the capabilities this host may grant (`--privileged` asks for all,
    and fails where the bounding set lacks one, as CAP_SYS_RESOURCE here)."""
    with open("/proc/self/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    return [name for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1]


class Testbed:
    """One instance, described by DIR/state.json (written before anything is created)."""

    def __init__(self, directory: str, state: dict):
        self.dir = directory
        self.state = state

    # --- paths and names ---------------------------------------------------
    @property
    def tag(self) -> str:
        return self.state["tag"]

    @property
    def manager_socket(self) -> str:
        return os.path.join(self.dir, "outer", "docker.sock")

    @property
    def manager_addr(self) -> str:
        return f"{MANAGER_NETS[0]}.{self.state['net']}.1"

    @property
    def workers(self) -> list:
        return [w["name"] for w in self.state["workers"]]

    def worker(self, name: str) -> dict:
        for w in self.state["workers"]:
            if w["name"] == name:
                return w
        raise TestbedError(f"no worker {name} in {self.dir} (have {', '.join(self.workers)})")

    def marks(self) -> list:
        return [self.dir.rstrip("/") + "/", self.tag,
                f"-container-ip {MANAGER_NETS[0]}.{self.state['net']}."]

    # --- docker on the manager and inside workers --------------------------
    def docker(self, *args, input=None, check=True, timeout=120) -> str:
        return run([DOCKER, "-H", "unix://" + self.manager_socket, *args],
                   input=input, check=check, timeout=timeout)

    def worker_exec(self, name: str, argv: list, input=None, check=True, timeout=120) -> str:
        """Runs `docker ARGV` against the worker's own dockerd, inside the worker."""
        container = self.worker(name)["container"]
        return self.docker("exec", *(["-i"] if input is not None else []), container,
                           DOCKER, "-H", WORKER_SOCKET, *argv,
                           input=input, check=check, timeout=timeout)

    def nodes(self) -> list:
        """`docker node inspect` of every node, with `Worker` (w1, ... or None) added."""
        ids = self.docker("node", "ls", "-q").split()
        by_host = {w["container"]: w["name"] for w in self.state["workers"]}
        nodes = json.loads(self.docker("node", "inspect", *ids)) if ids else []
        for node in nodes:
            node["Worker"] = by_host.get(node["Description"]["Hostname"])
        return nodes

    def containers_on(self, name: str, all: bool = False) -> list:
        """`docker ps` of the worker's dockerd, one dict per container."""
        out = self.worker_exec(name, ["ps", "--no-trunc", "--format", "{{json .}}"]
                               + (["--all"] if all else []))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def kill_worker(self, name: str) -> None:
        """The worker's container dies at once with everything in it, as a host would."""
        self.docker("kill", self.worker(name)["container"])

    def load_image(self, tar_path: str, tag: str) -> str:
        """`docker import` a root tar on the manager and load it on every worker; returns its id."""
        with open(tar_path, "rb") as f:
            self.docker("import", "-", tag, input=f.read(), timeout=300)
        return self.load_image_ref(tag)

    def load_image_ref(self, tag: str) -> str:
        """Copies an image already on the manager to every worker (same id everywhere)."""
        saved = subprocess.run([DOCKER, "-H", "unix://" + self.manager_socket, "save", tag],
                               capture_output=True, timeout=300)
        if saved.returncode != 0:
            raise TestbedError(f"docker save {tag}: {saved.stderr.decode(errors='replace').strip()}")
        image = saved.stdout
        for name in self.workers:
            if self.worker_running(name):
                self.worker_exec(name, ["load", "-q"], input=image, timeout=300)
        return self.docker("image", "inspect", "--format", "{{.Id}}", tag).strip()

    def node_setup(self, name: str, *extra) -> str:
        """Runs deploy/swarm/node-setup.sh inside the worker as an operator runs it on a node,
        with the front's address being the manager's end of the bridge: every connection
        from the host's 127.0.0.1 ports comes from there."""
        with open(NODE_SETUP, "rb") as script:
            return self.docker("exec", "-i", "-e", f"DOCKER={DOCKER}", self.worker(name)["container"],
                               "/usr/bin/bash", "-s", "--", "-H", WORKER_SOCKET,
                               "--allow-from", f"{self.manager_addr}/32", *extra,
                               input=script.read())

    def worker_running(self, name: str) -> bool:
        out = self.docker("inspect", "--format", "{{.State.Running}}",
                          self.worker(name)["container"], check=False)
        return out.strip() == "true"

    def container_ids(self) -> set:
        """The manager daemon's containers, from its data root: known after a crash too."""
        ids = {w["container_id"] for w in self.state["workers"] if w.get("container_id")}
        try:
            ids |= set(os.listdir(os.path.join(self.dir, "outer", "data", "containers")))
        except OSError:
            pass
        return ids

    def shim_sockets(self) -> list:
        address = os.path.join(self.dir, "outer", "exec", "containerd", "containerd.sock")
        return residue.shim_sockets(address, self.tag, self.container_ids())

    def describe(self) -> dict:
        return {
            "dir": self.dir,
            "tag": self.tag,
            "manager_socket": self.manager_socket,
            "docker_host": "unix://" + self.manager_socket,
            "manager_addr": self.manager_addr,
            "connect_host": CONNECT_HOST,
            "bridge": self.tag,
            "session_network": SESSION_NETWORK,
            "session_subnet": SESSION_SUBNET,
            "session_bridge": SESSION_BRIDGE,
            "node_image": NODE_IMAGE,
            "node_image_id": self.state.get("node_image_id"),
            "engine_profile": WORKER_ENGINE_PROFILE if self.state.get("engine_profile") else None,
            "workers": [{"name": w["name"], "container": w["container"], "addr": w.get("addr"),
                         "node_id": w.get("node_id"), "ports": w["ports"],
                         "docker_host_inside": WORKER_SOCKET} for w in self.state["workers"]],
            "timings": self.state.get("timings", {}),
        }

    def save(self) -> None:
        path = os.path.join(self.dir, "state.json")
        with open(path + ".new", "w") as f:
            json.dump(self.state, f, indent=2)
        os.replace(path + ".new", path)

    @classmethod
    def open(cls, directory: str) -> "Testbed":
        directory = os.path.realpath(directory)
        try:
            with open(os.path.join(directory, "state.json")) as f:
                return cls(directory, json.load(f))
        except FileNotFoundError:
            raise TestbedError(f"no testbed in {directory} (no state.json)") from None


# --- bring-up ---------------------------------------------------------------

def up(directory: str, workers: int = 2, ports_per_worker: int = PORTS_PER_WORKER,
       engine_profile: str = None) -> Testbed:
    """Creates and starts an instance in `directory` (created; must not hold one already).
    `engine_profile`: a seccomp profile file every worker's dockerd makes its
    containers' default (`dockerd --seccomp-profile`, as deploy/swarm/README.md
    has a node do with `cellblock seccomp-profile`); None keeps Docker's own.
    On failure the partial instance is left for `down` (which the CLI runs itself)."""
    started = time.monotonic()
    directory = os.path.realpath(directory)
    if os.path.exists(os.path.join(directory, "state.json")):
        raise AlreadyUp(f"{directory} already holds a testbed: run down first")
    if os.path.isdir(directory) and os.listdir(directory):
        # down removes the whole directory: it must hold nothing but the instance.
        raise AlreadyUp(f"{directory} is not empty: give a new or empty directory")
    outer = os.path.join(directory, "outer")
    longest = os.path.join(outer, "exec", "containerd", "containerd.sock.ttrpc")
    if len(longest) > SOCKET_PATH_MAX:
        raise TestbedError(f"{directory}: too long for the daemon's unix sockets "
                           f"({len(longest)} > {SOCKET_PATH_MAX} chars for {longest})")
    for tool in (DOCKER, DOCKERD):
        if not os.access(tool, os.X_OK):
            raise DaemonStartFailed(f"{tool} is not installed (apt-get install docker.io)")
    os.makedirs(outer, exist_ok=True)
    if engine_profile:
        # The workers bind the instance's own copy (read-only).
        shutil.copyfile(engine_profile, os.path.join(outer, ENGINE_PROFILE_NAME))
        os.chmod(os.path.join(outer, ENGINE_PROFILE_NAME), 0o644)

    with _allocation_lock():
        bed = Testbed(directory, _allocate(directory, workers, ports_per_worker))
        bed.state["engine_profile"] = bool(engine_profile)
        bed.save()
        _create_bridge(bed)
        _start_manager_daemon(bed)
        bed.state["timings"]["daemon_s"] = round(time.monotonic() - started, 2)
        _init_swarm(bed)
        bed.docker("import", "-", NODE_IMAGE, input=skeleton.skeleton_tar())
        bed.state["node_image_id"] = bed.docker("image", "inspect", "--format", "{{.Id}}",
                                                NODE_IMAGE).strip()
        # Creating the workers binds their host ports: only then may another instance allocate.
        for w in bed.state["workers"]:
            _create_worker(bed, w)
        bed.save()

    token = bed.docker("swarm", "join-token", "-q", "worker").strip()
    with concurrent.futures.ThreadPoolExecutor(len(bed.state["workers"])) as pool:
        for future in [pool.submit(_join_worker, bed, w, token) for w in bed.state["workers"]]:
            future.result()
    bed.docker("network", "create", "-d", "bridge", "--scope", "swarm",
               "--config-from", SESSION_CONFIG_NETWORK, SESSION_NETWORK)
    _wait_ready(bed)
    bed.load_image_ref(NODE_IMAGE)
    bed.state["status"] = "up"
    bed.state["timings"]["up_s"] = round(time.monotonic() - started, 2)
    bed.save()
    return bed


class _allocation_lock:
    """Serializes the choice of subnets and ports between instances on this host."""

    def __enter__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.sock.bind(ALLOCATION_LOCK)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise TestbedError("allocation lock: another testbed held it for 120 s")
                time.sleep(0.2)

    def __exit__(self, *exc):
        self.sock.close()


def _used_ipv4_prefixes() -> set:
    """The /16.x prefixes ("10.213.7") that an address or route of the host touches."""
    out = run(["ip", "-4", "-o", "addr", "show"]) + run(["ip", "-4", "route", "show", "table", "all"])
    used = set()
    for word in out.split():
        head = word.split("/")[0].split(".")
        if len(head) == 4 and all(p.isdigit() for p in head):
            used.add(".".join(head[:3]))
            if "/" in word and int(word.split("/")[1]) < 24:
                used.add(".".join(head[:2]) + ".*")  # a wider route covers them all
    return used


def _port_block_free(lo: int, hi: int) -> bool:
    for port in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind((CONNECT_HOST, port))
            except OSError:
                return False
    return True


def _udp_port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _allocate(directory: str, workers: int, ports_per_worker: int) -> dict:
    links = set(residue.links_with_tag("cbsw"))
    while True:
        tag = "cbsw%06x" % random.randrange(16 ** 6)
        if not any(link.startswith(tag) for link in links) and not residue.cgroup_dirs(tag):
            break
    used = _used_ipv4_prefixes()
    net = next((n for n in range(1, 255)
                if not any(f"{m}.{n}" in used or f"{m}.*" in used for m in MANAGER_NETS)), None)
    if net is None:
        raise TestbedError(f"no free /24 in {MANAGER_NETS[0]}.0.0/16 and {MANAGER_NETS[1]}.0.0/16")
    blocks, lo = [], PORT_SEARCH[0]
    while len(blocks) < workers and lo + ports_per_worker - 1 <= PORT_SEARCH[1]:
        hi = lo + ports_per_worker - 1
        if _port_block_free(lo, hi):
            blocks.append([lo, hi])
        lo = hi + 1
    if len(blocks) < workers:
        raise TestbedError(f"ports: fewer than {workers} free blocks of {ports_per_worker} "
                           f"in {PORT_SEARCH[0]}-{PORT_SEARCH[1]} on {CONNECT_HOST}")
    # VXLAN sockets of the manager sit in the host's namespace: one port per swarm, or a
    # second swarm's overlay fails with "file exists" against the first one's.
    data_path_port = next((p for p in range(*DATA_PATH_PORTS) if _udp_port_free(p)), None)
    if data_path_port is None:
        raise TestbedError(f"no free UDP port in {DATA_PATH_PORTS} for the swarm's data path")
    return {
        "tag": tag, "dir": directory, "net": net, "status": "starting", "timings": {},
        "data_path_port": data_path_port,
        "workers": [{"name": f"w{k + 1}", "container": f"{tag}-w{k + 1}", "ports": blocks[k]}
                    for k in range(workers)],
    }


def _create_bridge(bed: Testbed) -> None:
    bridge = bed.tag
    run(["ip", "link", "add", bridge, "type", "bridge"])
    bed.state["bridge_created"] = True
    bed.save()
    run(["ip", "addr", "add", f"{bed.manager_addr}/24", "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])


def _start_manager_daemon(bed: Testbed) -> None:
    outer = os.path.join(bed.dir, "outer")
    config = os.path.join(outer, "daemon.json")
    with open(config, "w") as f:
        # A config file of our own, so that the host's /etc/docker/daemon.json does not
        # apply, and the engine key is not the host-wide /etc/docker/key.json.
        json.dump({"deprecated-key-path": os.path.join(outer, "key.json")}, f)
    argv = [DOCKERD, "--config-file", config,
            "--data-root", os.path.join(outer, "data"), "--exec-root", os.path.join(outer, "exec"),
            "--pidfile", os.path.join(outer, "dockerd.pid"), "-H", "unix://" + bed.manager_socket,
            "--bridge", bed.tag, "--iptables=false", "--ip-forward=false", "--ip-masq=false",
            "--cgroup-parent", f"{bed.tag}-outer",
            "--containerd-namespace", bed.tag, "--containerd-plugins-namespace", f"{bed.tag}-plugins"]
    env = dict(os.environ, DOCKER_SERVICE_PREFER_OFFLINE_IMAGE="1")
    with open(os.path.join(outer, "dockerd.log"), "ab") as log:
        daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  env=env, start_new_session=True)
    bed.state["dockerd_pid"] = daemon.pid
    bed.save()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise DaemonStartFailed(f"dockerd exited with {daemon.returncode}: {_log_tail(outer)}")
        if subprocess.run([DOCKER, "-H", "unix://" + bed.manager_socket, "version"],
                          capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise DaemonStartFailed(f"dockerd did not answer in 60 s: {_log_tail(outer)}")


def _log_tail(outer: str) -> str:
    try:
        with open(os.path.join(outer, "dockerd.log"), errors="replace") as f:
            return "".join(f.readlines()[-15:])
    except OSError:
        return "(no log)"


def _init_swarm(bed: Testbed) -> None:
    # Swarm puts the ingress sandbox on docker_gwbridge; made first here with a bridge
    # name of this instance's, it cannot collide with another daemon's docker_gwbridge.
    bed.docker("network", "create", "--subnet", f"{MANAGER_NETS[1]}.{bed.state['net']}.0/24",
               "-o", f"com.docker.network.bridge.name={bed.tag}g",
               "-o", "com.docker.network.bridge.enable_icc=false",
               "-o", "com.docker.network.bridge.enable_ip_masquerade=false", "docker_gwbridge")
    bed.docker("swarm", "init", "--advertise-addr", bed.manager_addr,
               "--listen-addr", f"{bed.manager_addr}:2377",
               "--data-path-port", str(bed.state["data_path_port"]))
    # The routing mesh is unused (sessions publish in host mode) and its overlay's VXLAN
    # lives in the host's namespace, where a second swarm's would collide with it.
    bed.docker("network", "rm", "ingress", input=b"y\n")
    node_id = bed.docker("info", "--format", "{{.Swarm.NodeID}}").strip()
    bed.docker("node", "update", "--availability", "drain", node_id)
    bed.state["manager_node_id"] = node_id


def _create_worker(bed: Testbed, w: dict) -> None:
    lo, hi = w["ports"]
    var_lib = os.path.join(bed.dir, w["name"])
    os.makedirs(var_lib, exist_ok=True)
    caps = bounding_capabilities()
    while True:
        try:
            _run_worker(bed, w, caps, var_lib)
            break
        except TestbedError as e:
            # Docker 20.10 refuses the capabilities newer than it (PERFMON, BPF, ...).
            unknown = str(e).partition('unknown capability: "CAP_')[2].partition('"')[0]
            if unknown not in caps:
                raise
            caps.remove(unknown)
            bed.docker("rm", "-f", w["container"], check=False)
    w["addr"], w["container_id"] = bed.docker(
        "inspect", "--format", "{{.NetworkSettings.IPAddress}} {{.Id}}", w["container"]).split()


def _run_worker(bed: Testbed, w: dict, caps: list, var_lib: str) -> None:
    lo, hi = w["ports"]
    profile_binds, profile_args = [], []
    if bed.state.get("engine_profile"):
        profile_binds = ["-v", f"{os.path.join(bed.dir, 'outer', ENGINE_PROFILE_NAME)}:"
                               f"{WORKER_ENGINE_PROFILE}:ro"]
        profile_args = ["--seccomp-profile", WORKER_ENGINE_PROFILE]
    bed.docker(
        "run", "-d", "--name", w["container"], "--hostname", w["container"],
        *[arg for cap in caps for arg in ("--cap-add", cap)],
        "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
        "--security-opt", "systempaths=unconfined", "--device-cgroup-rule", "a *:* rwm",
        "-v", "/usr:/usr:ro", "-v", "/etc/alternatives:/etc/alternatives:ro",
        *[arg for path in HOST_IMAGE_BINDS if path != "/etc/alternatives"
          for arg in ("-v", f"{path}:{path}:ro")],
        "-v", "/lib/modules:/lib/modules:ro", "-v", "/sys/fs/cgroup:/sys/fs/cgroup",
        "-v", f"{var_lib}:/var/lib/docker", "--tmpfs", "/run", "--tmpfs", "/tmp",
        *profile_binds,
        # The worker's dockerd picks dynamic host ports from this range, all of which
        # the manager's daemon publishes on the host's loopback under the same numbers.
        "--sysctl", f"net.ipv4.ip_local_port_range={lo} {hi}",
        "-p", f"{CONNECT_HOST}:{lo}-{hi}:{lo}-{hi}",
        "-e", "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1",
        # Docker's init as PID 1: dockerd there would not reap the shims' orphans (zombies).
        # (`--init` cannot bind it: /sbin is a link into the read-only /usr.)
        NODE_IMAGE, DOCKER_INIT, "--", DOCKERD, "--cgroup-parent", f"{bed.tag}-{w['name']}",
        "-H", WORKER_SOCKET, *profile_args)


def _join_worker(bed: Testbed, w: dict, token: str) -> None:
    deadline = time.monotonic() + 60
    while not _worker_answers(bed, w):
        if time.monotonic() > deadline or not bed.worker_running(w["name"]):
            logs = bed.docker("logs", "--tail", "15", w["container"], check=False)
            raise TestbedError(f"worker {w['name']}: its dockerd did not answer: {logs}")
        time.sleep(0.2)
    w["node_setup"] = bed.node_setup(w["name"]).splitlines()
    bed.worker_exec(w["name"], ["swarm", "join", "--token", token,
                                "--advertise-addr", w["addr"], "--listen-addr", f"{w['addr']}:2377",
                                f"{bed.manager_addr}:2377"])
    w["node_id"] = bed.worker_exec(w["name"], ["info", "--format", "{{.Swarm.NodeID}}"]).strip()


def _worker_answers(bed: Testbed, w: dict) -> bool:
    probe = [DOCKER, "-H", "unix://" + bed.manager_socket, "exec", w["container"],
             DOCKER, "-H", WORKER_SOCKET, "version", "--format", "{{.Server.Version}}"]
    return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0


def _wait_ready(bed: Testbed, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        nodes = bed.nodes()
        ready = [n for n in nodes if n["Worker"] and n["Status"]["State"] == "ready"]
        if len(ready) == len(bed.state["workers"]):
            return
        if time.monotonic() > deadline:
            states = {n["Description"]["Hostname"]: n["Status"]["State"] for n in nodes}
            raise TestbedError(f"workers not ready in {timeout} s: {states}")
        time.sleep(0.2)


# --- teardown ---------------------------------------------------------------

def down(directory: str, log=print) -> list:
    """Removes everything of the instance in `directory`, however far `up` got or however it
    died. Idempotent. Returns what is still left (empty: clean)."""
    started = time.monotonic()
    directory = os.path.realpath(directory)
    try:
        bed = Testbed.open(directory)
    except TestbedError:
        bed = None
    if bed is None:
        if os.path.isdir(directory) and not _only_instance_files(directory):
            log(f"down: {directory} holds no testbed and other files: left as it is")
            return []
        if os.path.isdir(directory):
            left = residue.unmount_under(directory)
            if left:
                return [f"mount {p}" for p in left]
            shutil.rmtree(directory)
            log(f"down: {directory} held no testbed state; removed the directory")
        else:
            log(f"down: no testbed in {directory}: nothing to do")
        return []

    answering = subprocess.run([DOCKER, "-H", "unix://" + bed.manager_socket, "version"],
                               capture_output=True, timeout=20).returncode == 0
    if answering:
        _graceful_stop(bed, log)
    dockerd_pid = _daemon_pid(bed)
    roots = {dockerd_pid} if dockerd_pid else set()
    table = residue.process_table()
    doomed = residue.instance_pids(bed.marks(), bed.tag, roots)
    if dockerd_pid in table:
        log(f"down: stopping dockerd {dockerd_pid}")
        residue.kill_pids({dockerd_pid}, grace=20)
    # Its containerd-shims were reparented away from it: they are found by their marks.
    doomed = (doomed | residue.instance_pids(bed.marks(), bed.tag)) - {dockerd_pid}
    if doomed:
        names = sorted({table[p].cmdline.split(" ")[0] for p in doomed if p in table})
        log(f"down: stopping {len(doomed)} leftover processes of the instance ({', '.join(names)})")
        residue.kill_pids(doomed, grace=3)
    sockets = bed.shim_sockets()
    for path in sockets:
        os.unlink(path)
    left_mounts = residue.unmount_under(directory)
    if bed.tag in residue.links_with_tag(bed.tag):
        run(["ip", "link", "del", bed.tag], check=False)
    for link in residue.links_with_tag(bed.tag):
        run(["ip", "link", "del", link], check=False)
    residue.remove_cgroups(bed.tag)
    if not left_mounts and os.path.isdir(directory):
        shutil.rmtree(directory, ignore_errors=True)
    left = residue.find_residue(directory, bed.tag, bed.marks(), sockets)
    log(f"down: {directory} in {time.monotonic() - started:.1f} s; "
        + ("nothing left" if not left else "LEFT: " + "; ".join(left)))
    return left


def _only_instance_files(directory: str) -> bool:
    """What `up` makes before its state file: outer/, wK/, state.json.new."""
    return all(name in ("outer", "state.json.new") or (name[0] == "w" and name[1:].isdigit())
               for name in os.listdir(directory))


def _daemon_pid(bed: Testbed):
    for source in (os.path.join(bed.dir, "outer", "dockerd.pid"), None):
        try:
            if source:
                with open(source) as f:
                    pid = int(f.read().strip())
            else:
                pid = bed.state.get("dockerd_pid")
            if not pid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if bed.dir.encode() in f.read():  # not a reused pid
                    return pid
        except (OSError, ValueError):
            continue
    return None


def _graceful_stop(bed: Testbed, log) -> None:
    """What the swarm undoes itself; each step is best effort, the sweep after it is not."""
    services = bed.docker("service", "ls", "-q", check=False).split()
    if services:
        bed.docker("service", "rm", *services, check=False)
        log(f"down: removed {len(services)} services")

    def leave(name):
        if bed.worker_running(name):
            bed.worker_exec(name, ["swarm", "leave", "--force"], check=False, timeout=20)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(bed.workers))) as pool:
        list(pool.map(leave, bed.workers))
    containers = bed.docker("ps", "-aq", "--filter", f"name={bed.tag}-", check=False).split()
    if containers:
        bed.docker("rm", "-f", *containers, check=False, timeout=60)
        log(f"down: removed {len(containers)} worker containers")
    bed.docker("swarm", "leave", "--force", check=False, timeout=30)


def status(directory: str) -> dict:
    bed = Testbed.open(directory)
    description = bed.describe()
    description["status"] = bed.state.get("status")
    try:
        description["nodes"] = [{"id": n["ID"], "hostname": n["Description"]["Hostname"],
                                 "worker": n["Worker"], "role": n["Spec"]["Role"],
                                 "availability": n["Spec"]["Availability"],
                                 "state": n["Status"]["State"], "addr": n["Status"].get("Addr")}
                                for n in bed.nodes()]
        description["services"] = bed.docker("service", "ls", "--format", "{{.Name}}").split()
    except TestbedError as e:
        description["status"] = f"{bed.state.get('status')}, manager not answering: {e}"
    return description


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", required=True, help="the instance's directory (all its state)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ports-per-worker", type=int, default=PORTS_PER_WORKER,
                        help="host ports each worker may publish (a cellblock session takes 5)")
    parser.add_argument("--engine-profile", help="a seccomp profile the workers' dockerd make "
                        "their default (e.g. the output of `cellblock seccomp-profile`)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("testbed: needs root (bridges, dockerd, cgroups)", file=sys.stderr)
        return 2
    if args.command == "up":
        try:
            bed = up(args.dir, args.workers, args.ports_per_worker, args.engine_profile)
        except AlreadyUp as e:
            print(f"testbed up: {e}", file=sys.stderr)
            return 1
        except (Exception, KeyboardInterrupt) as e:
            print(f"testbed up: {e}", file=sys.stderr)
            print("testbed up: removing the partial instance", file=sys.stderr)
            down(args.dir, log=lambda m: print(m, file=sys.stderr))
            return 3 if isinstance(e, DaemonStartFailed) else 1
        print(json.dumps(bed.describe(), indent=2))
        return 0
    if args.command == "down":
        return 1 if down(args.dir) else 0
    try:
        print(json.dumps(status(args.dir), indent=2))
    except TestbedError as e:
        print(f"testbed status: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
