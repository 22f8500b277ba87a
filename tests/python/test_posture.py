"""Sandbox posture, read from the host against a live session (after gVisor's
sandbox-posture test): what every process and every thread of a sandbox runs
with, as the host kernel reports it in /proc, and the seccomp filter as loaded
(read back with PTRACE_SECCOMP_GET_FILTER and evaluated here), not as declared.

The session's tasks are found by cgroup (/proc/<pid>/cgroup naming
/cellblock/cb-<session>). A few extra tasks are started in the sandbox first so
that more than the init and the kernel are checked: a thread, a child process,
and a double-forked daemon in its own session blocking every signal.

Related: test_containment.py checks identity and caps from inside the
sandbox; test_destroy.py and test_server.py::test_kill9_then_restart check that
a killed server's sandboxes end; test_attacks.py attacks.
"""
import ctypes
import errno
import glob
import json
import os
import platform
import re
import secrets
import signal
import struct
import time

import pytest

from attack_helpers import syscall_numbers
from conftest import STATE_DIR, start_kernel, stop_kernel, wait_for
from test_containment import (HOST_ID_BASE, cell, cellblock_pid, proc_state, run_ok,
                              sandbox_pids, session_id_of, session_residue, status_fields,
                              stop_quietly)

SOURCE_DIR = os.environ.get("CELLBLOCK_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

NAMESPACES = ("mnt", "pid", "ipc", "uts", "net", "user", "cgroup")
# Inode numbers the kernel gives its initial namespaces (include/linux/proc_ns.h):
# they show that the test process, the reference for "the host", runs in them.
INITIAL_NS_INODES = {"ipc": 0xEFFFFFFF, "uts": 0xEFFFFFFE, "user": 0xEFFFFFFD,
                     "pid": 0xEFFFFFFC, "cgroup": 0xEFFFFFFB}

# The environment a sandbox task may have: sandbox_environment() in
# sessions/oci_bundle.cpp, the image's env, and what ipykernel itself sets for
# the processes it starts.
BASE_ENV = {"PATH", "HOME", "USER", "LANG", "TMPDIR", "IPYTHONDIR", "MPLCONFIGDIR",
            "XDG_CACHE_HOME",
            # the egress forwarder and the gateway sessions' trust store (docs/network.md)
            "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy",
            "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
            # a session's own packages (pip --target into its home, on the import path)
            "PIP_TARGET", "PYTHONPATH", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK"}
IPYKERNEL_ENV = {"TERM", "CLICOLOR", "PAGER", "GIT_PAGER", "PYDEVD_USE_FRAME_EVAL",
                 "JPY_PARENT_PID", "MPLBACKEND"}
# Only the init, only under runsc: where its lifeline socket is (not a secret).
INIT_ONLY_ENV = {"CELLBLOCK_LIFELINE"}
CANARIES = ("CELLBLOCK_POSTURE_CANARY", "AWS_SECRET_ACCESS_KEY", "JPY_SESSION_NAME")

EXTRA_TASKS = r"""
import os, subprocess, sys, threading, time
posture_stop = threading.Event()
posture_thread = threading.Thread(target=posture_stop.wait, name='posture-thread', daemon=True)
posture_thread.start()
posture_child = subprocess.Popen(['/usr/bin/sleep', '600'])
code = '''
import os, signal, threading, time
signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
os.setsid()
if os.fork():
    os._exit(0)
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
time.sleep(600)
'''
subprocess.run([sys.executable, '-c', code, 'posture-daemon'])
time.sleep(0.3)
result = posture_child.pid
"""


# ---------------------------------------------------------------- helpers

def tasks_of(sid):
    """(pid, tid) of every thread of every live process of the session."""
    out = []
    for pid in sandbox_pids(sid, include_zombies=False):
        try:
            out += [(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
    return out


def ns_inode(path):
    link = os.readlink(path)
    return int(re.search(r"\[(\d+)\]", link).group(1))


def read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def host_pid_of(sid, ns_pid):
    for pid in sandbox_pids(sid, include_zombies=False):
        if status_fields(pid).get("NSpid", [""])[-1] == str(ns_pid):
            return pid
    return None


@pytest.fixture(scope="module")
def sandbox():
    canaries = {name: f"canary-{secrets.token_hex(12)}" for name in CANARIES}
    km, kc = start_kernel(extra_env=canaries)
    sid = session_id_of(km)
    child_ns_pid = run_ok(kc, cell(EXTRA_TASKS))
    yield {"km": km, "kc": kc, "sid": sid, "canaries": canaries,
           "child": host_pid_of(sid, child_ns_pid)}
    stop_quietly(km, kc)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)


def test_the_sandbox_has_the_expected_tasks(sandbox):
    """Init, kernel (with its threads), the child, the daemon and its thread: the later
    checks cover them all."""
    tasks = tasks_of(sandbox["sid"])
    pids = {pid for pid, _ in tasks}
    assert len(pids) >= 4, pids
    assert len(tasks) >= len(pids) + 4, tasks
    cmdlines = [read(f"/proc/{pid}/cmdline", "rb") for pid in pids]
    assert any(c.startswith(b"/opt/cellblock/cellblock-shim") for c in cmdlines), cmdlines
    assert any(b"posture-daemon" in c for c in cmdlines), cmdlines
    assert sandbox["child"] in pids


# ---------------------------------------------------------------- per task

def test_every_task_is_filtered_unprivileged_and_without_capabilities(sandbox):
    problems = []
    for pid, tid in tasks_of(sandbox["sid"]):
        try:
            st = status_fields(f"{pid}/task/{tid}")
        except OSError:
            continue  # ended meanwhile
        where = f"pid {pid} tid {tid} ({read(f'/proc/{pid}/comm').strip()})"
        if st["Seccomp"] != ["2"]:
            problems.append(f"{where}: Seccomp {st['Seccomp']} (2 = filter)")
        if st.get("Seccomp_filters", ["0"]) == ["0"]:
            problems.append(f"{where}: no seccomp filter")
        if st["NoNewPrivs"] != ["1"]:
            problems.append(f"{where}: NoNewPrivs {st['NoNewPrivs']}")
        for cap in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
            if st[cap] != ["0" * 16]:
                problems.append(f"{where}: {cap} {st[cap]}")
        ids = [int(x) for x in st["Uid"] + st["Gid"] + st.get("Groups", [])]
        if any(i < HOST_ID_BASE for i in ids):
            problems.append(f"{where}: host ids {st['Uid']} {st['Gid']} groups {st.get('Groups')}")
    assert problems == [], "\n".join(problems)


def test_every_task_is_in_the_sandbox_namespaces(sandbox):
    """mnt, pid, ipc, uts, net, user and cgroup namespaces differ from the host's.
    The host's are the test process's own (the machine's PID 1 is not ours to
    read); they are shown to be the initial ones where the kernel fixes the inode."""
    host = {ns: ns_inode(f"/proc/self/ns/{ns}") for ns in NAMESPACES}
    for ns, inode in INITIAL_NS_INODES.items():
        assert host[ns] == inode, f"the test does not run in the initial {ns} namespace"
    server = {ns: ns_inode(f"/proc/{cellblock_pid(sandbox['km'])}/ns/{ns}") for ns in NAMESPACES}
    assert server == host, "the server runs outside the host's namespaces: the reference is wrong"
    seen, problems = set(), []
    for pid, tid in tasks_of(sandbox["sid"]):
        try:
            mine = {ns: ns_inode(f"/proc/{pid}/task/{tid}/ns/{ns}") for ns in NAMESPACES}
        except OSError:
            continue
        shared = [ns for ns in NAMESPACES if mine[ns] == host[ns]]
        if shared:
            problems.append(f"pid {pid} tid {tid} shares the host's {shared}")
        seen.add(tuple(sorted(mine.items())))
    assert problems == [], problems
    assert len(seen) == 1, f"the sandbox's tasks are in {len(seen)} different namespace sets"


def test_every_process_has_its_limits(sandbox):
    """cgroups (every controller at /cellblock/cb-<session>, with the image's limits),
    rlimits and oom_score_adj, process by process."""
    sid = sandbox["sid"]
    problems = []
    for pid in sandbox_pids(sid, include_zombies=False):
        try:
            cgroups = read(f"/proc/{pid}/cgroup").splitlines()
            limits = read(f"/proc/{pid}/limits")
            oom = read(f"/proc/{pid}/oom_score_adj").strip()
        except OSError:
            continue
        outside = [line for line in cgroups if not line.endswith(f"/cellblock/cb-{sid}")
                   and line.split(":")[1] not in ("", "rdma", "misc")]
        if outside:
            problems.append(f"pid {pid}: cgroups outside the session's: {outside}")
        for name, soft in (("Max open files", "4096"), ("Max core file size", "0"),
                           ("Max processes", "1024")):
            row = next((r for r in limits.splitlines() if r.startswith(name)), "")
            if row.split()[-3:-1] != [soft, soft]:
                problems.append(f"pid {pid}: {row.strip()!r} (expected {soft})")
        if oom != "1000":
            problems.append(f"pid {pid}: oom_score_adj {oom}")
    assert problems == [], "\n".join(problems)
    values = {}
    for pattern in ("memory/cellblock/cb-{}/memory.limit_in_bytes", "pids/cellblock/cb-{}/pids.max",
                    "cpu/cellblock/cb-{}/cpu.cfs_quota_us", "cpu/cellblock/cb-{}/cpu.cfs_period_us",
                    "cellblock/cb-{}/memory.max", "cellblock/cb-{}/pids.max", "cellblock/cb-{}/cpu.max"):
        for path in glob.glob("/sys/fs/cgroup/" + pattern.format(sid)):
            values[path.rsplit("/", 1)[1]] = read(path).strip()
    if "memory.limit_in_bytes" in values:  # cgroup v1 (this machine)
        assert values["memory.limit_in_bytes"] == str(1024 << 20), values
        assert values["pids.max"] == "256", values
        assert (values["cpu.cfs_quota_us"], values["cpu.cfs_period_us"]) == ("100000", "100000"), values
    else:
        assert values.get("memory.max") == str(1024 << 20), values
        assert values.get("pids.max") == "256" and values.get("cpu.max") == "100000 100000", values


def test_environment_is_near_empty_and_free_of_server_secrets(sandbox):
    with open(os.path.join(SOURCE_DIR, "images", "host", "image.json")) as f:
        image_env = set(json.load(f).get("env", {}))
    allowed = BASE_ENV | image_env | IPYKERNEL_ENV
    server_env = read(f"/proc/{cellblock_pid(sandbox['km'])}/environ", "rb")
    for value in sandbox["canaries"].values():
        assert value.encode() in server_env, "the canary never reached the server"
    problems = []
    for pid in sandbox_pids(sandbox["sid"], include_zombies=False):
        try:
            environ = read(f"/proc/{pid}/environ", "rb")
            cmdline = read(f"/proc/{pid}/cmdline", "rb")
        except OSError:
            continue
        ns_pid = status_fields(pid)["NSpid"][-1]
        names = {entry.split(b"=", 1)[0].decode() for entry in environ.split(b"\0") if entry}
        extra = names - allowed - (INIT_ONLY_ENV if ns_pid == "1" else set())
        if extra:
            problems.append(f"pid {pid} (sandbox pid {ns_pid}): unexpected variables {sorted(extra)}")
        for name, value in sandbox["canaries"].items():
            if value.encode() in environ or value.encode() in cmdline or name in names:
                problems.append(f"pid {pid}: the server's {name} leaked in")
    assert problems == [], "\n".join(problems)


def test_no_host_file_is_open_in_the_sandbox(sandbox):
    """Every open file, working directory and root of every process is reachable
    inside the sandbox under the name the kernel gives it (the same inode at
    /proc/<pid>/root/<name>): no leaked host descriptor (the runc CVE-2024-21626
    kind). One exception by design: the init's stdout/stderr are the host's
    shim.log of the session, opened by the server (test_attacks.py shows what a
    kernel that takes over the init does with it)."""
    sid = sandbox["sid"]
    shim_log = os.path.join(STATE_DIR, "sessions", sid, "log", "shim.log")
    rootfs = os.stat(os.path.join(STATE_DIR, "sessions", sid, "bundle", "rootfs"))
    problems, by_design = [], []
    for pid in sandbox_pids(sid, include_zombies=False):
        ns_pid = status_fields(pid)["NSpid"][-1]
        root = os.stat(f"/proc/{pid}/root")
        if (root.st_dev, root.st_ino) != (rootfs.st_dev, rootfs.st_ino):
            problems.append(f"pid {pid}: its root is not the session's rootfs")
        links = {"cwd": f"/proc/{pid}/cwd"}
        try:
            links.update({f"fd {fd}": f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")})
        except OSError:
            continue
        for what, link in links.items():
            try:
                target = os.readlink(link)
                actual = os.stat(link)
            except OSError:
                continue
            if not target.startswith("/"):
                continue  # socket:[…], pipe:[…], anon_inode:…
            try:
                inside = os.stat(f"/proc/{pid}/root{target}")
                reachable = (inside.st_dev, inside.st_ino) == (actual.st_dev, actual.st_ino)
            except OSError:
                reachable = False
            if reachable:
                continue
            if ns_pid == "1" and what in ("fd 1", "fd 2") and target == shim_log:
                by_design.append(what)
                continue
            problems.append(f"pid {pid} (sandbox pid {ns_pid}) {what} -> {target}: a host file")
    assert problems == [], "\n".join(problems)
    assert sorted(by_design) == ["fd 1", "fd 2"], by_design


# ---------------------------------------------------------------- the filter as loaded

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
ACTION_MASK = 0xFFFF0000



def dump_filter(pid):
    """The task's seccomp filter (instruction list), read with ptrace from the host."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SECCOMP_GET_FILTER = 16, 17, 0x420C
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), f"PTRACE_ATTACH {pid}")
    try:
        os.waitpid(pid, 0x40000000)  # __WALL
        count = libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, None, None)
        if count <= 0:
            raise OSError(ctypes.get_errno(), f"PTRACE_SECCOMP_GET_FILTER {pid}")
        buf = (ctypes.c_ubyte * (8 * count))()
        if libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, None, buf) != count:
            raise OSError(ctypes.get_errno(), "PTRACE_SECCOMP_GET_FILTER")
    finally:
        libc.ptrace(PTRACE_DETACH, pid, None, None)
    raw = bytes(buf)
    return [struct.unpack_from("<HBBI", raw, 8 * i) for i in range(count)]


def run_filter(prog, nr, arch=AUDIT_ARCH_X86_64, args=(0, 0, 0, 0, 0, 0)):
    """Classic BPF, as the kernel runs a seccomp filter over struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & 0xFFFFFFFFFFFFFFFF for a in args])
    a = x = 0
    mem = [0] * 16
    pc = 0
    for _ in range(100000):
        code, jt, jf, k = prog[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x00:  # LD
            mode = code & 0xE0
            a = struct.unpack_from("<I", data, k)[0] if mode == 0x20 else \
                k if mode == 0x00 else mem[k] if mode == 0x60 else len(data)
        elif cls == 0x01:  # LDX
            mode = code & 0xE0
            x = k if mode == 0x00 else mem[k] if mode == 0x60 else len(data)
        elif cls == 0x02:
            mem[k] = a
        elif cls == 0x03:
            mem[k] = x
        elif cls == 0x04:  # ALU
            op, src = code & 0xF0, (x if code & 0x08 else k)
            a = {0x00: lambda: a + src, 0x10: lambda: a - src, 0x20: lambda: a * src,
                 0x30: lambda: a // src, 0x40: lambda: a | src, 0x50: lambda: a & src,
                 0x60: lambda: a << src, 0x70: lambda: a >> src, 0x80: lambda: -a,
                 0x90: lambda: a % src, 0xA0: lambda: a ^ src}[op]() & 0xFFFFFFFF
        elif cls == 0x05:  # JMP
            op = code & 0xF0
            if op == 0x00:
                pc += k
                continue
            src = x if code & 0x08 else k
            taken = {0x10: a == src, 0x20: a > src, 0x30: a >= src, 0x40: (a & src) != 0}[op]
            pc += jt if taken else jf
        elif cls == 0x06:  # RET
            return k if code & 0x18 == 0x00 else a
        else:  # MISC
            if code & 0xF8 == 0x00:
                x = a
            else:
                a = x
    raise AssertionError("the filter did not return")


def describe(ret):
    if ret == RET_ALLOW:
        return "allow"
    if ret & ACTION_MASK == RET_ERRNO:
        return f"errno {errno.errorcode.get(ret & 0xFFFF, ret & 0xFFFF)}"
    return hex(ret)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers are x86-64's")
def test_loaded_seccomp_filter_matches_the_declared_profile(sandbox):
    """The filter read back from the init and from a child is one program; run here
    over every rule of the profile declared in the session's config.json, on the
    x86-64 and i386 ABIs: each allowed call is allowed, each denied call answers its
    errno, clone with a namespace flag and socket(AF_VSOCK) fall to the default, and
    so does every call the profile does not name (an allowlist: docs/security.md) —
    i386-only names and numbers newer than the headers included. This is what tells
    a policy EPERM/ENOSYS from a kernel capability check's EPERM in test_attacks.py."""
    sid = sandbox["sid"]
    init = host_pid_of(sid, 1)
    programs = [dump_filter(init), dump_filter(sandbox["child"])]
    assert programs[0] == programs[1], "the init and a child run different filters"
    prog = programs[0]
    with open(os.path.join(STATE_DIR, "sessions", sid, "bundle", "config.json")) as f:
        declared = json.load(f)["linux"]["seccomp"]
    assert declared["defaultAction"] == "SCMP_ACT_ERRNO", declared["defaultAction"]
    default = RET_ERRNO | declared.get("defaultErrnoRet", errno.EPERM)
    nr64 = syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    nr32 = syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_32.h")
    wrong, named = [], set()
    for rule in declared["syscalls"]:
        if rule["action"] == "SCMP_ACT_ERRNO":
            expect = RET_ERRNO | rule.get("errnoRet", errno.EPERM)
        else:
            assert rule["action"] == "SCMP_ACT_ALLOW", rule
            expect = RET_ALLOW
        for name in rule["names"]:
            named.add(name)
            for arch, table in ((AUDIT_ARCH_X86_64, nr64), (AUDIT_ARCH_I386, nr32)):
                if name not in table:
                    continue
                if rule.get("args"):
                    continue  # argument rules: checked one by one below
                got = run_filter(prog, table[name], arch)
                if got != expect:
                    wrong.append(f"{name} on {'x86-64' if arch == AUDIT_ARCH_X86_64 else 'i386'}: "
                                 f"{describe(got)}, declared {describe(expect)}")
    assert wrong == [], "\n".join(wrong)
    # The argument rules allow only what they name.
    assert run_filter(prog, nr64["clone"], args=(0x11, 0, 0, 0, 0, 0)) == RET_ALLOW  # fork()
    assert run_filter(prog, nr64["clone"], args=(0x10000011, 0, 0, 0, 0, 0)) == default
    assert run_filter(prog, nr64["socket"], args=(2, 1, 0, 0, 0, 0)) == RET_ALLOW
    assert run_filter(prog, nr64["socket"], args=(40, 1, 0, 0, 0, 0)) == default
    # Default refuse: every call the profile does not name, on both ABIs.
    unnamed64 = {name: nr for name, nr in nr64.items() if name not in named}
    leaked = [name for name, nr in unnamed64.items() if run_filter(prog, nr) == RET_ALLOW]
    assert leaked == [], f"x86-64 calls allowed without being named: {leaked}"
    i386_only = {name: nr for name, nr in nr32.items() if name not in nr64}
    leaked32 = [name for name, nr in i386_only.items()
                if run_filter(prog, nr, AUDIT_ARCH_I386) == RET_ALLOW]
    assert leaked32 == [], f"i386-only calls allowed: {leaked32}"
    assert run_filter(prog, 467) == default, "a call newer than the headers is allowed"
    allowed = [name for name, nr in nr64.items() if run_filter(prog, nr) == RET_ALLOW]
    assert {"read", "write", "execve", "openat", "mmap"} <= set(allowed)
    print(f"loaded filter: {len(prog)} instructions; {len(allowed)} of {len(nr64)} x86-64 calls "
          f"allowed; default {describe(default)} (467, open_tree_attr: {describe(run_filter(prog, 467))})")


# ---------------------------------------------------------------- the lifeline

def test_the_whole_sandbox_dies_with_the_server():
    """SIGKILL to the server: every task of its sandbox (a signal-blocking daemon in
    its own session and threads included) is gone within 5 s. The next cellblock
    process reaps what only it can clean."""
    km, kc = start_kernel()
    sid = session_id_of(km)
    try:
        run_ok(kc, cell(EXTRA_TASKS))
        tasks = tasks_of(sid)
        assert len({pid for pid, _ in tasks}) >= 4 and len(tasks) >= 8, tasks
        server = km.provisioner.process
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        t0 = time.monotonic()
        gone = wait_for(lambda: all(proc_state(tid) in (None, "Z") for _, tid in tasks), timeout=5)
        alive = [(pid, tid) for pid, tid in tasks if proc_state(tid) not in (None, "Z")]
        assert gone, f"{len(alive)} sandbox tasks outlived the server by 5 s: {alive}"
        assert time.monotonic() - t0 < 5
    finally:
        try:
            kc.stop_channels()
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    successor_km, successor_kc = start_kernel()
    stop_kernel(successor_km, successor_kc)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)
