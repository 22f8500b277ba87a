"""What the figures measure against: a `cellblock serve` process, and bare ipykernels."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from jupyter_client.manager import KernelManager

from client import BenchError, KernelChannels, ManagerClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLBLOCK = os.path.join(ROOT, "build", "bin", "cellblock")
HOST_IMAGE = os.path.join(ROOT, "images", "host", "image.json")


def proc_status(pid, field):
    """A /proc/<pid>/status field in bytes (VmRSS, RssAnon, ...), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mem_available():
    """The host's MemAvailable in bytes (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid):
    """Proportional set size of one process (/proc/<pid>/smaps_rollup), or None."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_sched(pids):
    """(CPU ns, run-queue wait ns) summed over every thread of the processes `pids`
    (/proc/<pid>/task/*/schedstat: time on a CPU, time runnable but waiting for one)."""
    cpu = wait = 0
    found = False
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    fields = f.read().split()
                cpu += int(fields[0])
                wait += int(fields[1])
                found = True
            except (OSError, ValueError, IndexError):
                continue
    return (cpu, wait) if found else (None, None)


def cgroup_cpu_s(sid):
    """CPU seconds a session's sandbox has used so far (cpuacct.usage), or None once it is gone."""
    for path in (f"/sys/fs/cgroup/cpuacct/cellblock/cb-{sid}/cpuacct.usage",
                 f"/sys/fs/cgroup/cpu,cpuacct/cellblock/cb-{sid}/cpuacct.usage"):
        try:
            with open(path) as f:
                return int(f.read()) / 1e9
        except (OSError, ValueError):
            continue
    try:
        with open(f"/sys/fs/cgroup/cellblock/cb-{sid}/cpu.stat") as f:
            return int(dict(line.split() for line in f)["usage_usec"]) / 1e6
    except (OSError, ValueError, KeyError):
        return None


def host_cpu_s():
    """Busy CPU seconds of the whole host so far (/proc/stat, all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cgroup_throttling(sid):
    """(nr_throttled, throttled ms) of a session's CPU cgroup so far, or None."""
    for path in (f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}/cpu.stat",
                 f"/sys/fs/cgroup/cpu,cpuacct/cellblock/cb-{sid}/cpu.stat",
                 f"/sys/fs/cgroup/cellblock/cb-{sid}/cpu.stat"):
        try:
            with open(path) as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            continue
        if "throttled_time" in stat:
            return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e6
        if "throttled_usec" in stat:
            return int(stat["nr_throttled"]), int(stat["throttled_usec"]) / 1e3
    return None


def process_cpu_ns(pid):
    """CPU time of every thread of a process (ns)."""
    return process_sched([pid])[0]


# Arguments every `cellblock serve` of the run gets (bench/run.py --server-arg),
# e.g. --kernel-transport libzmq to measure the other transport.
SERVER_ARGS = []


class CellblockServer:
    """`cellblock serve` with its own state dir under /run, stopped and removed on exit."""

    def __init__(self, name, pool, extra_args=(), images_dir=None, workers=2):
        self.state_dir = f"/run/cellblock-bench-{name}"
        self.log_path = f"/run/cellblock-bench-{name}.log"
        self.args = [CELLBLOCK, "serve", "--state-dir", self.state_dir,
                     "--pool-workers", str(workers)]
        for image, n in pool.items():
            self.args += ["--pool", f"{image}={n}"]
        self.args += list(extra_args) + list(SERVER_ARGS)
        self.images_dir = images_dir
        self.proc = None
        self.manager = None
        self.info = None

    def __enter__(self):
        if os.path.exists(self.state_dir):
            raise BenchError(f"{self.state_dir} exists: another benchmark running, or a leftover "
                             "(remove it when no `cellblock serve` uses it)")
        env = dict(os.environ)
        if self.images_dir:
            env["CELLBLOCK_IMAGES_DIR"] = self.images_dir
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=self._log, env=env)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                # A server that did not start leaves no state dir to block the next run.
                shutil.rmtree(self.state_dir, ignore_errors=True)
                raise BenchError(f"cellblock serve exited with {self.proc.returncode}: {tail}")
            try:
                with open(os.path.join(self.state_dir, "server.json")) as f:
                    info = json.load(f)
                if info.get("pid") == self.proc.pid:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise BenchError("no server.json in 60 s")
            time.sleep(0.05)
        self.info = info
        import zmq
        self.ctx = zmq.Context()
        self.manager = ManagerClient(self.ctx, info)
        return self

    def kill9_and_start(self, timeout=300):
        """SIGKILL, then a new `cellblock serve` on the same state dir and
        arguments (figure 18's crash); returns once its server.json is written."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        env = dict(os.environ)
        if self.images_dir:
            env["CELLBLOCK_IMAGES_DIR"] = self.images_dir
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=self._log, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"cellblock serve exited with {self.proc.returncode}: "
                                 f"{self.log_tail()}")
            try:
                with open(os.path.join(self.state_dir, "server.json")) as f:
                    if json.load(f).get("pid") == self.proc.pid:
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"no server.json from the restarted server in {timeout} s")
            time.sleep(0.01)

    def __exit__(self, *exc):
        if self.manager:
            self.manager.close()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if exc[0] is None:
            os.unlink(self.log_path)
        else:
            print(f"  (server log kept: {self.log_path})")
        return False

    def log_tail(self, n=2000):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    @property
    def pid(self):
        return self.proc.pid

    def server_info(self):
        return self.manager.call("server_info_request", {})

    def wait_pool(self, image="host", timeout=300):
        """Waits (outside any timed region) until the pool of `image` is full and idle."""
        deadline = time.monotonic() + timeout
        while True:
            pool = self.server_info()["pool"].get(image, {})
            if pool.get("ready", 0) >= pool.get("target", 0) and pool.get("starting", 0) == 0:
                return pool
            if time.monotonic() > deadline:
                raise BenchError(f"pool {image} not full after {timeout} s: {pool}")
            time.sleep(0.1)

    def wait_sessions_gone(self, ids, timeout=120):
        """Waits until the directories of closed sessions `ids` are removed (their
        sandboxes destroyed); raises BenchError if one is still there after timeout."""
        deadline = time.monotonic() + timeout
        left = list(ids)
        while left:
            left = [i for i in left if os.path.lexists(os.path.join(self.state_dir, "sessions", i))]
            if not left:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{len(left)} closed session(s) not destroyed after {timeout} s")
            time.sleep(0.1)

    def create(self, content=None, timeout=300):
        return self.manager.call("session_create_request", content or {}, timeout=timeout)

    def close_session(self, sid):
        return self.manager.call("session_close_request", {"session_id": sid}, check=False)

    def open_channels(self, connection):
        return KernelChannels(self.ctx, connection)

    def create_many(self, n, content=None, timeout=900):
        """Sends n session_create_requests at once; returns (replies, seconds until the last)."""
        t0 = time.perf_counter()
        ids = [self.manager.send("session_create_request", content or {}) for _ in range(n)]
        replies = [self.manager.wait(i, timeout)["content"] for i in ids]
        elapsed = time.perf_counter() - t0
        bad = [r for r in replies if r.get("status") != "ok"]
        if bad:
            raise BenchError(f"{len(bad)} of {n} session_create_requests failed: "
                             f"{bad[0].get('ename')}: {bad[0].get('evalue')}")
        return replies, elapsed

    def session_pids(self, sid):
        """Host pids of a session's sandbox processes (by their cgroup)."""
        return self.sessions_pids([sid])

    @staticmethod
    def sessions_pids(sids):
        """Host pids of these sessions' sandbox processes (by their cgroup), in one pass."""
        markers = [f"/cellblock/cb-{sid}" for sid in sids]
        return host_pids("cgroup", lambda text: "/cellblock/cb-" in text
                         and any(m in text for m in markers))


def host_pids(name, matches):
    """Host pids whose /proc/<pid>/<name> text `matches` (a predicate); a
    process that ends while it is read is left out."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/{name}") as f:
                text = f.read()
        except OSError:
            continue
        if matches(text):
            pids.append(int(entry))
    return pids


def memory_cgroup(sid):
    for path in (f"/sys/fs/cgroup/memory/cellblock/cb-{sid}", f"/sys/fs/cgroup/cellblock/cb-{sid}"):
        if os.path.isdir(path):
            return path
    return None


def cgroup_memory(sid):
    """(usage bytes, memory.stat dict) of a session's memory cgroup, v1 or v2."""
    path = memory_cgroup(sid)
    if path is None:
        raise BenchError(f"no memory cgroup for session {sid}")
    stat = {}
    with open(os.path.join(path, "memory.stat")) as f:
        for line in f:
            k, v = line.split()
            stat[k] = int(v)
    usage_file = "memory.usage_in_bytes" if os.path.exists(
        os.path.join(path, "memory.usage_in_bytes")) else "memory.current"
    with open(os.path.join(path, usage_file)) as f:
        usage = int(f.read())
    return usage, stat


class BareKernels:
    """Debian's ipykernel started by jupyter_client, with no sandbox: the baseline."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.managers = []
        self.channels = []
        self.tmp = tempfile.mkdtemp(prefix="cellblock-bench-bare-", dir="/dev/shm")

    def start(self, n, timeout=600):
        """Starts n kernels at once; returns their channels and the seconds until all answered."""
        t0 = time.perf_counter()
        env = dict(os.environ)
        # What the sandbox gives its kernel: a tmpfs home for IPython, no debugger noise.
        env.update(IPYTHONDIR=os.path.join(self.tmp, "ipython"),
                   PYDEVD_DISABLE_FILE_VALIDATION="1", PYTHONDONTWRITEBYTECODE="1",
                   MPLBACKEND="module://matplotlib_inline.backend_inline")
        def launch():
            km = KernelManager(kernel_name="python3")
            km.start_kernel(env=env, cwd=self.tmp)
            return km

        new = [launch() for _ in range(n)]
        started = []
        deadline = time.monotonic() + timeout
        for km in new:
            # jupyter_client picks free ports before the kernel binds them; on
            # a host where other servers bind ports meanwhile, a kernel can
            # lose that race and exit ("Address already in use"): start it again.
            # A kernel can also lose only its heartbeat or iopub port and stay
            # alive without answering (or its client reach another kernel's
            # port): one that is silent for a minute is started again too.
            for attempt in range(4):
                ch = KernelChannels(self.ctx, km.get_connection_info(session=False))
                try:
                    wait_ready(ch, min(deadline, time.monotonic() + 60), alive=km.is_alive)
                    break
                except BenchError:
                    ch.close()
                    if attempt == 3 or time.monotonic() >= deadline:
                        raise
                    if km.is_alive():
                        km.shutdown_kernel(now=True)
                    km.cleanup_resources()
                    km = launch()
            self.managers.append(km)
            started.append(ch)
        self.channels += started
        return started, time.perf_counter() - t0

    def pids(self):
        return [km.provisioner.process.pid for km in self.managers
                if km.provisioner and km.provisioner.process]

    def stop(self):
        for ch in self.channels:
            ch.close()
        for km in self.managers:
            try:
                km.shutdown_kernel(now=True)
            except Exception:
                pass
        self.managers.clear()
        self.channels.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_ready(channels, deadline, alive=None):
    """Executes a no-op until a reply and its idle arrive (shell up, iopub subscribed)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError("kernel not ready in time")
        if alive is not None and not alive():
            raise BenchError("kernel exited before it answered")
        try:
            channels.execute("pass", timeout=min(2.0, left))
            return
        except BenchError:
            continue


def sessions_and_bare_kernels(srv, bare, k, code, content=None):
    """k sessions of `srv` and k bare kernels of `bare`, each ready and having
    run `code`: (create replies, their channels, the bare kernels' channels)."""
    replies, _ = srv.create_many(k, content)
    chans = [srv.open_channels(r["connection"]) for r in replies]
    bare_chans, _ = bare.start(k)
    for side, cs in (("cellblock", chans), ("bare", bare_chans)):
        for ch in cs:
            wait_ready(ch, time.monotonic() + 300)
            ex = ch.execute(code, timeout=300)
            if ex.status() != "ok":
                raise BenchError(f"{side}: {code!r} failed: {ex.reply['content']}")
    return replies, chans, bare_chans
