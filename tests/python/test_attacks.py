"""The attack suite: hostile code in a cellblock session, and what the host sees.

Every case runs as a cell of a real session (kernel mode through the
cellblock-python kernelspec, or `cellblock serve` where two sessions or the
output policy matter). After every test the host is checked directly, never
through cellblock's own view (see HostWatch): sentinel files and host files by
sha256, two host sleepers (one of them running as the very host uid the
sandbox user maps to), loopback TCP/UDP listeners and an abstract and a
pathname unix listener whose hit counters must stay 0, the host's mounts and
cgroups, the host's hostname and sysctls.

What is already proven elsewhere is not repeated here:
  test_containment.py  identity and caps seen from inside; a short list of
                       denied syscalls with valid arguments; /etc/shadow;
                       read-only directories; tmpfs caps; only `lo`; host
                       loopback listeners unreachable; sessions cannot see
                       each other's tmp files or listeners; environment
                       canaries; memory bomb; fork bomb; double-forked daemon.
  test_bad_input.py    hostile messages from the network on the outer channels.
  test_destroy.py      nothing is left after shutdown, SIGTERM, SIGKILL, kernel death.

A case that finds a gap FAILS and says what got through: the fix belongs in
the C++ code, never in a weaker assertion here. Traffic only ever goes to
127.0.0.0/8, ::1 or unix sockets.
"""
import errno
import glob
import hashlib
import json
import os
import platform
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

import server_helpers as sh
from conftest import STATE_DIR, run_cell, start_kernel, stream_text, wait_for
from test_containment import (HOST_ID_BASE, PIDS_LIMIT, SANDBOX_UID, cell, cellblock_pid,
                              proc_state, run_ok, sandbox_pids, session_id_of, session_residue,
                              status_fields, stop_quietly)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="raw syscall numbers and the i386 trampoline are x86-64's")

HOST_SANDBOX_UID = HOST_ID_BASE + SANDBOX_UID
# Set by test_images_attacks.py, which runs this suite on a built image.
BUILT_IMAGE = os.environ.get("CELLBLOCK_ATTACK_IMAGE", "")
BLOCKED = (errno.EPERM, errno.ENOSYS)   # what the seccomp policy answers with


# ---------------------------------------------------------------- syscall tables

def _syscall_numbers(header):
    numbers = {}
    with open(header) as f:
        for line in f:
            m = re.match(r"#define __NR_(\w+)\s+(\d+)", line)
            if m:
                numbers[m.group(1)] = int(m.group(2))
    return numbers


NR64 = _syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
NR32 = _syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_32.h")

# Invalid arguments (NULL pointers, fd -1, unknown flags): if the call reaches
# the kernel it answers EFAULT/EBADF/EINVAL/... (or a harmless success), never
# doing anything; only the seccomp policy answers EPERM (or ENOSYS for clone3)
# before looking at them. The brief's list first, then the rest of the profile.
INVALID_ARGS = {
    "mount": (0, 0, 0, 0, 0), "umount2": (0, 0), "pivot_root": (0, 0), "unshare": (-1,),
    "setns": (-1, 0), "keyctl": (-1, 0, 0, 0, 0), "add_key": (0, 0, 0, 0, 0),
    "request_key": (0, 0, 0, 0), "bpf": (-1, 0, 0), "userfaultfd": (-1,),
    "io_uring_setup": (0, 0), "perf_event_open": (0, 0, -1, -1, 0), "kexec_load": (0, 0, 0, 0),
    "init_module": (0, 0, 0), "finit_module": (-1, 0, 0), "delete_module": (0, 0),
    "open_by_handle_at": (-1, 0, 0), "reboot": (0, 0, 0, 0), "swapon": (0, 0), "swapoff": (0,),
    "clock_settime": (-1, 0), "settimeofday": (0, 0), "sethostname": (0, 0),
    "setdomainname": (0, 0), "acct": (0,), "quotactl": (0, 0, 0, 0), "syslog": (10, 0, 0),
    "ptrace": (-1, 0, 0, 0), "process_vm_readv": (0, 0, 0, 0, 0, 0),
    "process_vm_writev": (0, 0, 0, 0, 0, 0), "pidfd_getfd": (-1, -1, 0), "fsopen": (0, 0),
    "fsmount": (-1, 0, 0), "move_mount": (-1, 0, -1, 0, 0), "open_tree": (-1, 0, 0),
    # the rest of make_seccomp_profile()'s list
    "chroot": (0,), "clock_adjtime": (-1, 0), "create_module": (0, 0), "fanotify_init": (-1, 0),
    "fsconfig": (-1, 0, 0, 0, 0), "fspick": (-1, 0, 0), "get_kernel_syms": (0,),
    "io_uring_enter": (-1, 0, 0, 0, 0, 0), "io_uring_register": (-1, 0, 0, 0), "ioperm": (0, 0, 0),
    "iopl": (0,), "kcmp": (0, 0, -1, 0, 0), "kexec_file_load": (-1, -1, 0, 0, 0),
    "lookup_dcookie": (0, 0, 0), "mount_setattr": (-1, 0, 0, 0, 0),
    "name_to_handle_at": (-1, 0, 0, 0, 0), "nfsservctl": (0, 0, 0),
    "process_madvise": (-1, 0, 0, 0, 0), "query_module": (0, 0, 0, 0, 0),
    "quotactl_fd": (-1, 0, 0, 0), "_sysctl": (0,), "uselib": (0,), "ustat": (0, 0),
    "vhangup": (),
}
# clone with each namespace flag plus CLONE_THREAD without CLONE_SIGHAND: the
# kernel itself would answer EINVAL and create nothing.
CLONE_NS_FLAGS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x2000000,
                  "CLONE_NEWUTS": 0x4000000, "CLONE_NEWIPC": 0x8000000,
                  "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                  "CLONE_NEWNET": 0x40000000}
CLONE_THREAD = 0x10000

SYSCALL_HELPER = r"""
import ctypes, mmap
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    '''A raw x86-64 syscall: its return value, or -errno.'''
    ctypes.set_errno(0)
    rc = _libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return rc if rc >= 0 else -ctypes.get_errno()
# The i386 ABI (int 0x80) from this 64-bit process: a 23-byte trampoline
#   push rbx; mov eax,edi; mov ebx,esi; mov r10d,edx; mov edx,ecx; mov ecx,r10d;
#   mov esi,r8d; mov edi,r9d; int 0x80; pop rbx; ret
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_page = _libc.mmap(None, 4096, 7, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40 | 0, -1, 0)
_code = bytes.fromhex('5389f889f34189d289ca4489d14489c64489cfcd805bc3')
ctypes.memmove(_page, _code, len(_code))
_i386 = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_uint] * 6)(_page)
I386_ARGS = _page + 2048   # scratch memory below 4 GiB for pointer arguments
def sc32(nr, *args):
    args = [a & 0xffffffff for a in args] + [0] * (5 - len(args))
    return _i386(nr, *args)
"""


# ---------------------------------------------------------------- the host, watched

def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _start_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _host_mounts():
    """Mounts of the host's namespace, without the sandboxes' own (they come and go)."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    out = set()
    for row in rows:
        mount_point = row[4]
        if mount_point.startswith("/run/cellblock"):
            continue
        sep = row.index("-")
        out.add((mount_point, row[sep + 1], row[sep + 2]))
    return out


def _host_cgroups():
    """Every cgroup directory two levels deep, without the sandboxes' cb-* ones."""
    out = set()
    for path in glob.glob("/sys/fs/cgroup/*/*/") + glob.glob("/sys/fs/cgroup/*/*/*/"):
        rel = os.path.relpath(path, "/sys/fs/cgroup")
        if re.search(r"(^|/)cellblock/cb-", rel) or "/cellblock-test" in rel:
            continue
        out.add(rel)
    return out


class HostWatch:
    """What the host looks like; check() lists every difference since the start."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="cellblock-attack-", dir="/var/tmp")  # 0700, root
        self.sentinels = []
        for name in ("sentinel-a", "sentinel-b"):
            path = os.path.join(self.dir, name)
            with open(path, "wb") as f:
                f.write(secrets.token_bytes(4096))
            self.sentinels.append(path)
        # Host files a sandbox could target. (Not cellblock's own build output: other
        # work rebuilds it at any time; the cases that target it check the refusal.)
        self.files = self.sentinels + [p for p in (
            "/etc/shadow", "/etc/passwd", "/etc/group", "/etc/hosts", "/etc/hostname",
            "/etc/resolv.conf", "/usr/bin/python3.11", "/usr/bin/su", "/usr/bin/mount",
            "/usr/lib/x86_64-linux-gnu/libc.so.6") if os.path.isfile(p)]
        self.digests = {p: _sha256(p) for p in self.files}
        self.sysctls = {p: self._read(p) for p in (
            "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe",
            "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname",
            "/proc/sys/kernel/dmesg_restrict", "/proc/sys/vm/overcommit_memory")}
        self.hostname = socket.gethostname()
        # Sleepers: one as root, one as the host uid the sandbox user maps to.
        self.sleepers = [
            subprocess.Popen(["/usr/bin/sleep", "3600"], stdin=subprocess.DEVNULL),
            subprocess.Popen(["/usr/bin/sleep", "3600"], stdin=subprocess.DEVNULL,
                             user=HOST_SANDBOX_UID, group=HOST_SANDBOX_UID, extra_groups=[]),
        ]
        self.sleeper_ticks = {p.pid: wait_for(lambda p=p: _start_ticks(p.pid)) for p in self.sleepers}
        # Listeners whose hit counters must stay 0.
        self.listeners = {}
        self.listeners["tcp 127.0.0.1"] = self._stream(socket.AF_INET, ("127.0.0.1", 0))
        try:
            self.listeners["tcp ::1"] = self._stream(socket.AF_INET6, ("::1", 0))
        except OSError:
            pass
        self.abstract = f"\0cellblock-attack-{secrets.token_hex(8)}"
        self.listeners["unix abstract"] = self._stream(socket.AF_UNIX, self.abstract)
        self.unix_path = os.path.join(self.dir, "host.sock")  # only root can reach it
        self.listeners["unix path"] = self._stream(socket.AF_UNIX, self.unix_path)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        udp.setblocking(False)
        self.udp = udp
        self.hits = {name: 0 for name in self.listeners} | {"udp 127.0.0.1": 0}
        self.mounts = _host_mounts()
        self.cgroups = _host_cgroups()

    @staticmethod
    def _read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    @staticmethod
    def _stream(family, address):
        s = socket.socket(family, socket.SOCK_STREAM)
        if family != socket.AF_UNIX:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        s.listen(64)
        s.setblocking(False)
        return s

    def addresses(self):
        """Where the host listens, for cells that try to get there."""
        out = {name: list(s.getsockname())[:2] for name, s in self.listeners.items()
               if name.startswith("tcp")}
        out["udp 127.0.0.1"] = list(self.udp.getsockname())
        return out

    def collect_hits(self):
        for name, s in self.listeners.items():
            while True:
                try:
                    conn, _ = s.accept()
                except (BlockingIOError, InterruptedError):
                    break
                conn.close()
                self.hits[name] += 1
        while True:
            try:
                self.udp.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                break
            self.hits["udp 127.0.0.1"] += 1
        return dict(self.hits)

    def take_hits(self):
        """The hits so far, then zero: for a case that reports them itself."""
        hits = self.collect_hits()
        self.hits = {name: 0 for name in self.hits}
        return hits

    def problems(self):
        out = []
        for path, digest in self.digests.items():
            try:
                now = _sha256(path)
            except OSError as e:
                now = f"unreadable: {e}"
            if now != digest:
                out.append(f"host file {path} changed (sha256 {digest[:12]} -> {now[:12]})")
        for path, value in self.sysctls.items():
            if self._read(path) != value:
                out.append(f"host {path} changed: {value!r} -> {self._read(path)!r}")
        if socket.gethostname() != self.hostname:
            out.append(f"host hostname changed to {socket.gethostname()!r}")
        for p in self.sleepers:
            if p.poll() is not None or _start_ticks(p.pid) != self.sleeper_ticks[p.pid]:
                out.append(f"host sleeper {p.pid} (started by this test) died: {p.returncode}")
        hits = {name: n for name, n in self.collect_hits().items() if n}
        if hits:
            out.append(f"host listeners were reached: {hits}")
        new_mounts = _host_mounts() - self.mounts
        if new_mounts:
            out.append(f"new host mounts: {sorted(new_mounts)}")
        gone_mounts = self.mounts - _host_mounts()
        if gone_mounts:
            out.append(f"host mounts vanished: {sorted(gone_mounts)}")
        new_cgroups = _host_cgroups() - self.cgroups
        if new_cgroups:
            out.append(f"new host cgroups outside cellblock/cb-*: {sorted(new_cgroups)}")
        return out

    def close(self):
        for p in self.sleepers:
            p.kill()
            p.wait(timeout=10)
        for s in self.listeners.values():
            s.close()
        self.udp.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def host():
    watch = HostWatch()
    yield watch
    problems = watch.problems()
    watch.close()
    assert problems == [], problems


@pytest.fixture(autouse=True)
def host_unchanged(host):
    """After every case: the host is as it was."""
    yield
    problems = host.problems()
    assert problems == [], "the host changed during this case:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def box(host):
    """One session shared by the cases that leave it usable."""
    km, kc = start_kernel()
    sid = session_id_of(km)
    assert run_ok(kc, cell(SYSCALL_HELPER + "\nresult = sc(39)")) > 0  # getpid: helpers work
    yield {"km": km, "kc": kc, "sid": sid}
    stop_quietly(km, kc)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)


@pytest.fixture
def fresh(host):
    """A session of its own, for cases that wreck or end it; checked gone afterwards."""
    km, kc = start_kernel()
    sid = session_id_of(km)
    yield km, kc, sid
    stop_quietly(km, kc)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)


def gaps(outcomes, allowed=BLOCKED):
    """The entries of {label: rc} whose result is not a refusal by the policy."""
    return {label: (errno.errorcode.get(-rc, rc) if isinstance(rc, int) and rc < 0 else rc)
            for label, rc in outcomes.items() if not (isinstance(rc, int) and -rc in allowed)}


def errname(value):
    return errno.errorcode.get(value, value) if isinstance(value, int) else value


# ================================================================ host escape

def test_proc_1_root_is_the_sandbox_own_root(box, host):
    """/proc/1/root is the sandbox's rootfs skeleton, not the host's /."""
    host_top = sorted(os.listdir("/"))
    inside = run_ok(box["kc"], cell(f"""
import os
# The init is non-dumpable, so /proc/1/root may be refused outright (EACCES):
# then the same claims are checked through the kernel's own /proc/self/root.
try:
    os.listdir('/proc/1/root')
    p1 = '/proc/1/root'
except PermissionError:
    p1 = '/proc/self/root'
st_root, st_p1 = os.stat('/'), os.stat(p1)
result = {{'proc1_root': sorted(os.listdir(p1)), 'root': sorted(os.listdir('/')),
           'same_inode': (st_root.st_dev, st_root.st_ino) == (st_p1.st_dev, st_p1.st_ino),
           'up': sorted(os.listdir(p1 + '/../../..')),
           'host_sentinel': os.path.exists(p1 + {host.sentinels[0]!r}),
           'host_dir': os.path.exists(p1 + {host.dir!r}),
           'self_root': sorted(os.listdir('/proc/self/root'))}}
"""))
    assert inside["same_inode"], inside
    assert inside["proc1_root"] == inside["root"] == inside["up"] == inside["self_root"], inside
    assert inside["host_sentinel"] is False and inside["host_dir"] is False, inside
    if not BUILT_IMAGE:
        # The host image's skeleton has none of the host's top-level dirs; a
        # built Debian root has its own (checked by inode below instead).
        host_only = {"root", "var", "boot", "srv", "mnt", "media"} & set(host_top)
        assert host_only, f"the host's / has none of {host_only}: the check proves nothing"
        assert not host_only & set(inside["proc1_root"]), (host_only, inside["proc1_root"])
    # From the host: the shim's root is the bundle's root (the session's
    # skeleton for `host`, the shared read-only root of a built image).
    shim = [p for p in sandbox_pids(box["sid"], include_zombies=False)
            if status_fields(p)["NSpid"][-1] == "1"]
    assert len(shim) == 1, shim
    shim = shim[0]
    st_shim = os.stat(f"/proc/{shim}/root")
    with open(os.path.join(STATE_DIR, "sessions", box["sid"], "bundle", "config.json")) as f:
        st_rootfs = os.stat(json.load(f)["root"]["path"])
    assert (st_shim.st_dev, st_shim.st_ino) == (st_rootfs.st_dev, st_rootfs.st_ino)


def test_init_exe_and_host_log_fd_cannot_be_reopened_for_writing(box, host):
    """CVE-2019-5736's route: overwrite the init's binary through /proc/1/exe, or reopen
    the host log file the init holds (its stderr) through /proc/1/fd."""
    inside = run_ok(box["kc"], cell("""
import os
try:
    result = {'fd_targets': {fd: os.readlink(f'/proc/1/fd/{fd}') for fd in os.listdir('/proc/1/fd')}}
except PermissionError:
    result = {'fd_targets': None}  # the init is non-dumpable: its fds are root's
for path in ['/proc/1/exe', '/proc/self/exe', '/opt/cellblock/cellblock-shim',
             '/proc/1/fd/1', '/proc/1/fd/2']:
    for mode in ('r+b', 'ab'):
        try:
            with open(path, mode) as f:
                f.write(b'#!/bin/sh\\necho pwned\\n')
            result[f'{path} {mode}'] = 'written'
        except OSError as e:
            result[f'{path} {mode}'] = e.errno
try:
    result['read log'] = len(open('/proc/1/fd/2', 'rb').read())
except OSError as e:
    result['read log'] = e.errno
"""))
    targets = inside.pop("fd_targets")
    if targets is not None:
        log_fds = [fd for fd, t in targets.items() if t.endswith("/shim.log")]
        assert log_fds, f"the init holds no host log fd: the case proves nothing ({targets})"
    else:
        # Non-dumpable init: its fd table cannot even be listed; each reopen below
        # must still be refused.
        assert inside["/proc/1/fd/2 ab"] in (errno.EACCES, errno.EPERM), inside
    for what, outcome in inside.items():
        assert outcome in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY), \
            f"{what}: {errname(outcome)} (expected a refusal)"
    # /proc/self/exe is the host's /usr/bin/python3.11, which HostWatch hashes.


# Position-independent x86-64: write(2, msg, LEN) COUNT times, then pause() forever.
#   mov r12d,COUNT; 1: mov eax,1; mov edi,2; lea rsi,[rip+msg]; mov edx,LEN; syscall;
#   dec r12d; jnz 1b; 2: mov eax,34; syscall; jmp 2b; msg:
HIJACK_CODE = "41bc44332211b801000000bf02000000488d3515000000ba887766550f0541ffcc75e3b8220000000f05ebf7"

PROC_MEM_PROBE = """
import os
try:
    # The init is non-dumpable: even its map is root's (EACCES).
    rw = [l for l in open('/proc/1/maps') if l.split()[1].startswith('rw')]
    start = int(rw[0].split('-')[0], 16)
    with open('/proc/1/mem', 'r+b', buffering=0) as mem:
        mem.seek(start)
        data = mem.read(8)
        mem.seek(start)
        result = {'wrote': mem.write(data)}   # its own bytes back: proof, no harm
except OSError as e:
    result = {'errno': e.errno}
"""

PROC_MEM_HIJACK = """
import os, struct, time
tag = b'{tag}\\n'
msg = tag * (4096 // len(tag))
code = bytearray.fromhex('{code}')
struct.pack_into('<I', code, 2, 256)          # 256 writes...
struct.pack_into('<I', code, 0x18, len(msg))  # ...of 4 KiB: 1 MiB, 16 x the shim's 64 KiB cap
fields = open('/proc/1/syscall').read().split()
pc = int(fields[-1], 16)                      # where the init resumes after poll()
with open('/proc/1/mem', 'r+b', buffering=0) as mem:
    mem.seek(pc)
    mem.write(bytes(code) + msg)
pid = os.fork()                               # an orphan exits: SIGCHLD wakes the init
if pid == 0:
    if os.fork() == 0:
        time.sleep(0.2)
        os._exit(0)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(1)
result = {{'init_syscall_before': fields[0], 'init_syscall_now': open('/proc/1/syscall').read().split()[0]}}
"""


def test_sandbox_init_cannot_be_taken_over_through_proc_mem(fresh):
    """ptrace and process_vm_writev are denied, but /proc/1/mem is not a syscall: the
    kernel runs as the same uid as the sandbox's init (cellblock-shim), which is
    dumpable, so it may open the init's memory for writing, code pages included
    (FOLL_FORCE). The init holds the host's shim.log open for writing (its stderr,
    capped at 64 KiB only by the shim's own code) and the server's lifeline.

    If the write is possible this case shows what it buys, then fails: it makes the
    init write 1 MiB of its choosing into the host file, and SIGKILLs the server to
    see whether the sandbox still dies with it."""
    km, kc, sid = fresh
    probe = run_ok(kc, cell(PROC_MEM_PROBE))
    if "errno" in probe:
        assert probe["errno"] in (errno.EACCES, errno.EPERM), probe
        return
    log = os.path.join(STATE_DIR, "sessions", sid, "log", "shim.log")
    tag = f"CELLBLOCK-HIJACK-{secrets.token_hex(6)}"
    size_before = os.path.getsize(log)
    hijack = run_ok(kc, cell(PROC_MEM_HIJACK.format(tag=tag, code=HIJACK_CODE)))
    with open(log, "rb") as f:
        data = f.read()
    pids = sandbox_pids(sid, include_zombies=False)
    server = km.provisioner.process
    os.kill(server.pid, signal.SIGKILL)
    server.wait(timeout=10)
    time.sleep(5)
    survivors = [p for p in pids if proc_state(p) not in (None, "Z")]
    # Clean up as designed: the next cellblock process reaps what is left.
    km2, kc2 = start_kernel()
    stop_quietly(km2, kc2)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)
    pytest.fail(
        "GAP: the kernel wrote the memory of the sandbox's init through /proc/1/mem "
        f"({probe}); with it the init wrote {len(data) - size_before} bytes "
        f"({data.count(tag.encode())} lines chosen by the sandbox) to the host file {log} "
        f"(the shim caps kernel stderr at 65536 bytes); init syscall {hijack}; "
        f"sandbox processes alive 5 s after SIGKILL of the server: {survivors} of {pids}")


def test_kernel_sysctls_and_core_pattern_are_read_only(box, host):
    inside = run_ok(box["kc"], cell("""
import os
result = {}
# Each file gets its own current value written back: a write that got through
# would be reported (and seen by HostWatch) without changing the host.
def current(path):
    try:
        return open(path).read()
    except OSError:
        return '\\n'
for path, value in [('/proc/sys/kernel/core_pattern', current('/proc/sys/kernel/core_pattern')),
                    ('/proc/sys/kernel/modprobe', current('/proc/sys/kernel/modprobe')),
                    ('/proc/sys/kernel/hostname', 'sandbox'),
                    ('/proc/sys/vm/overcommit_memory', current('/proc/sys/vm/overcommit_memory')),
                    ('/proc/sysrq-trigger', 'h'),
                    ('/sys/kernel/uevent_helper', current('/sys/kernel/uevent_helper'))]:
    try:
        with open(path, 'w') as f:
            f.write(value)
        result[path] = 'written'
    except OSError as e:
        result[path] = e.errno
result['proc_sys_ro'] = bool(os.statvfs('/proc/sys').f_flag & os.ST_RDONLY)
result['sys_ro'] = bool(os.statvfs('/sys').f_flag & os.ST_RDONLY)
"""))
    assert inside.pop("proc_sys_ro") and inside.pop("sys_ro"), inside
    for path, outcome in inside.items():
        assert outcome in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT), \
            f"write to {path}: {errname(outcome)}"


def test_raw_block_and_memory_devices_are_absent(box):
    inside = run_ok(box["kc"], cell("""
import os
result = {}
for path in ['/dev/sda', '/dev/vda', '/dev/nvme0n1', '/dev/mem', '/dev/kmem', '/dev/port',
             '/dev/kmsg', '/dev/kvm', '/dev/vsock', '/dev/vhost-vsock', '/dev/fuse',
             '/dev/net/tun', '/dev/loop0', '/dev/loop-control', '/dev/dm-0', '/dev/console']:
    for flags in (os.O_RDONLY, os.O_RDWR):
        try:
            os.close(os.open(path, flags))
            result[f'{path} {flags}'] = 'opened'
        except OSError as e:
            result[f'{path} {flags}'] = e.errno
"""))
    for what, outcome in inside.items():
        assert outcome in (errno.ENOENT, errno.EPERM, errno.EACCES, errno.ENXIO), \
            f"{what}: {errname(outcome)}"


def test_namespace_ptrace_and_kernel_state_calls_are_refused(box, host):
    """The brief's escapes with real arguments: pivot_root, setns into every namespace
    of the sandbox's init, ptrace of the parent and of the init, userfaultfd,
    perf_event_open, clock_settime, sethostname, bpf."""
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + """
import os, ctypes, struct, time
N = %s
result, opens = {}, {}
os.makedirs('/tmp/newroot/old', exist_ok=True)
new, old = ctypes.create_string_buffer(b'/tmp/newroot'), ctypes.create_string_buffer(b'/tmp/newroot/old')
result['pivot_root'] = sc(N['pivot_root'], ctypes.addressof(new), ctypes.addressof(old))
result['init ns sealed'] = False
for owner in ('1', 'self'):
    try:
        names = sorted(os.listdir(f'/proc/{owner}/ns'))
    except PermissionError:
        result['init ns sealed'] = True  # non-dumpable init: its ns links are root's
        continue
    for ns in names:
        try:
            fd = os.open(f'/proc/{owner}/ns/{ns}', os.O_RDONLY)
        except OSError as e:
            opens[f'/proc/{owner}/ns/{ns}'] = e.errno
            continue
        result[f'setns /proc/{owner}/ns/{ns}'] = sc(N['setns'], fd, 0)
        os.close(fd)
for who, pid in (('parent', os.getppid()), ('init', 1)):
    result[f'ptrace ATTACH {who}'] = sc(N['ptrace'], 16, pid, 0, 0)
    result[f'ptrace SEIZE {who}'] = sc(N['ptrace'], 0x4206, pid, 0, 0)
result['ptrace TRACEME'] = sc(N['ptrace'], 0, 0, 0, 0)
result['process_vm_readv init'] = sc(N['process_vm_readv'], 1, 0, 0, 0, 0, 0)
result['userfaultfd'] = sc(N['userfaultfd'], os.O_CLOEXEC | os.O_NONBLOCK)
attr = ctypes.create_string_buffer(struct.pack('IIQQQQ', 1, 128, 0, 0, 0, 0) + bytes(88))  # sw cpu-clock
result['perf_event_open'] = sc(N['perf_event_open'], ctypes.addressof(attr), 0, -1, -1, 0)
ts = ctypes.create_string_buffer(struct.pack('qq', int(time.time()), 0))  # "now": harmless even if it got through
result['clock_settime'] = sc(N['clock_settime'], 0, ctypes.addressof(ts))
name = ctypes.create_string_buffer(b'pwned')
result['sethostname'] = sc(N['sethostname'], ctypes.addressof(name), 5)
mattr = ctypes.create_string_buffer(struct.pack('IIII', 2, 4, 4, 1) + bytes(112))  # BPF_MAP_TYPE_ARRAY
result['bpf MAP_CREATE'] = sc(N['bpf'], 0, ctypes.addressof(mattr), 128)
result['hostname after'] = open('/proc/sys/kernel/hostname').read().strip()
result['ppid'] = os.getppid()
result['ns open errors'] = opens
""" % {n: NR64[n] for n in ("pivot_root", "setns", "ptrace", "process_vm_readv", "userfaultfd",
                            "perf_event_open", "clock_settime", "sethostname", "bpf")}))
    assert inside.pop("hostname after") == "sandbox", inside
    assert inside.pop("ppid") == 1, "the kernel's parent is the sandbox's init"
    assert inside.pop("ns open errors") == {}, "some namespaces could not be opened"
    init_sealed = inside.pop("init ns sealed")
    # The init's namespaces cannot even be opened when it is non-dumpable; then
    # setns must still be refused on the kernel's own namespaces.
    owner = "self" if init_sealed else "1"
    setns = [k for k in inside if k.startswith(f"setns /proc/{owner}/ns/")]
    assert len(setns) >= 7, f"too few namespaces could be opened: {inside}"
    assert gaps(inside) == {}, f"reached the kernel or succeeded (a GAP): {gaps(inside)}"


def test_raw_syscalls_with_invalid_arguments_are_stopped_by_the_policy(box):
    """Every call of the brief and of the profile, with arguments the kernel would reject
    on its own: EPERM/ENOSYS means the policy stopped it; EFAULT, EBADF, EINVAL, any
    other errno or a success means it reached the kernel: a GAP, named below.

    EPERM can also be a kernel capability check (e.g. reboot checks CAP_SYS_BOOT
    before its arguments); test_posture.py reads the loaded filter itself to tell."""
    calls = [(name, NR64[name], args) for name, args in INVALID_ARGS.items() if name in NR64]
    missing = sorted(set(INVALID_ARGS) - set(NR64))
    assert not missing, f"no x86-64 number for {missing}"
    calls += [(f"clone({flag}|CLONE_THREAD)", NR64["clone"], (bit | CLONE_THREAD, 0, 0, 0, 0))
              for flag, bit in CLONE_NS_FLAGS.items()]
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + f"""
import os
result = {{}}
me = os.getpid()
for name, nr, args in {calls!r}:
    rc = sc(nr, *args)
    if rc == 0 and os.getpid() != me:
        os._exit(0)  # a clone got through and this is the child: leave at once
    result[name] = rc
result['clone3'] = sc({NR64['clone3']}, 0, 0)
"""))
    clone3 = inside.pop("clone3")
    assert clone3 == -errno.ENOSYS, \
        f"clone3 must fail with ENOSYS (glibc then falls back to the filterable clone): {errname(-clone3)}"
    assert set(inside) == {name for name, _, _ in calls}, inside
    found = gaps(inside)
    assert found == {}, "these syscalls reached the kernel (GAP in the seccomp policy): " + \
        ", ".join(f"{name} -> {what}" for name, what in sorted(found.items()))


# The i386 names of the same operations. umount, stime, clock_settime64 and
# clock_adjtime64 exist only there: a deny-list of x86-64 names misses them.
I386_CALLS = {
    "mount": (0, 0, 0, 0, 0), "umount": (0,), "umount2": (0, 0), "pivot_root": (0, 0),
    "unshare": (-1,), "setns": (-1, 0), "ptrace": (-1, 0, 0, 0), "keyctl": (-1, 0, 0, 0, 0),
    "add_key": (0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0), "bpf": (-1, 0, 0),
    "userfaultfd": (-1,), "io_uring_setup": (0, 0), "perf_event_open": (0, 0, -1, -1, 0),
    "kexec_load": (0, 0, 0, 0), "init_module": (0, 0, 0), "finit_module": (-1, 0, 0),
    "delete_module": (0, 0), "open_by_handle_at": (-1, 0, 0), "reboot": (0, 0, 0, 0),
    "swapon": (0, 0), "swapoff": (0,), "clock_settime": (-1, 0), "clock_settime64": (-1, 0),
    "clock_adjtime": (-1, 0), "clock_adjtime64": (-1, 0), "settimeofday": (0, 0), "stime": (0,),
    "sethostname": (0, 0), "setdomainname": (0, 0), "acct": (0,), "quotactl": (0, 0, 0, 0),
    "syslog": (10, 0, 0), "process_vm_readv": (0, 0, 0, 0, 0), "pidfd_getfd": (-1, -1, 0),
    "fsopen": (0, 0), "fsmount": (-1, 0, 0), "move_mount": (-1, 0, -1, 0, 0),
    "open_tree": (-1, 0, 0), "chroot": (0,), "name_to_handle_at": (-1, 0, 0, 0, 0),
    "fanotify_init": (-1, 0), "kcmp": (0, 0, -1, 0, 0), "iopl": (0,), "ioperm": (0, 0, 0),
}


def test_i386_and_x32_syscall_abis_are_filtered_too(box):
    """The same calls through `int 0x80` (the kernel has IA32 emulation) and the x32
    numbering: the filter must cover every ABI the kernel accepts."""
    calls = [(name, NR32[name], args) for name, args in I386_CALLS.items() if name in NR32]
    clone_calls = [(f"clone({flag}|CLONE_THREAD)", NR32["clone"], (bit | CLONE_THREAD, 0, 0, 0, 0))
                   for flag, bit in CLONE_NS_FLAGS.items()]
    x32 = {name: 0x40000000 | NR64[name] for name in ("unshare", "mount", "setns", "ptrace",
                                                       "keyctl", "bpf", "pivot_root")}
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + f"""
import os, ctypes
result = {{'getpid': [sc32({NR32['getpid']}), os.getpid()]}}
me = os.getpid()
for name, nr, args in {calls + clone_calls!r}:
    rc = sc32(nr, *args)
    if rc == 0 and os.getpid() != me:
        os._exit(0)
    result['i386 ' + name] = rc
for family in (40, 16, 2):  # AF_VSOCK, AF_NETLINK, AF_INET through socketcall and socket
    ctypes.memmove(I386_ARGS, (ctypes.c_uint * 3)(family, 1 if family != 16 else 3, 0), 12)
    rc = sc32({NR32['socketcall']}, 1, I386_ARGS)
    if rc >= 0: os.close(rc)
    result[f'i386 socketcall(SOCKET, {{family}})'] = rc
    rc = sc32({NR32['socket']}, family, 1 if family != 16 else 3, 0)
    if rc >= 0: os.close(rc)
    result[f'i386 socket({{family}})'] = rc
result['i386 clone3'] = sc32({NR32['clone3']}, 0, 0)
for name, nr in {x32!r}.items():
    result['x32 ' + name] = sc(nr, -1, 0, 0, 0, 0)
"""))
    pid32, pid = inside.pop("getpid")
    assert pid32 == pid, "the int 0x80 trampoline does not work: the case proves nothing"
    assert inside.pop("i386 clone3") == -errno.ENOSYS, inside
    # AF_INET/AF_NETLINK sockets are allowed on x86-64; on i386 socketcall is refused whole
    # and the direct socket call gives an fd: report only, they are not policy targets.
    for family in (16, 2):
        inside.pop(f"i386 socketcall(SOCKET, {family})")
        inside.pop(f"i386 socket({family})")
    found = gaps(inside)
    assert found == {}, "reached the kernel through another ABI (GAP in the seccomp policy): " + \
        ", ".join(f"{name} -> {what}" for name, what in sorted(found.items()))


def test_newer_variants_of_denied_calls_are_denied(box):
    """A deny-list only names the calls its author knew. open_tree is denied; its
    variant open_tree_attr (Linux 6.15, x86-64 number 467, newer than the
    headers and libseccomp here) must be too. Run on this machine's kernel."""
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if release < (6, 15):
        pytest.skip(f"kernel {platform.release()} has no open_tree_attr")
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + """
result = {'open_tree_attr': sc(467, -1, 0, 0, 0, 0), 'open_tree': sc(428, -1, 0, 0)}
"""))
    assert inside["open_tree"] in (-errno.EPERM,), inside
    found = gaps(inside)
    assert found == {}, "a newer variant of a denied call reached the kernel (GAP: deny-list " \
        f"with default allow): {found}"


# ================================================================ privilege

def test_setuid_binaries_gain_no_privilege(box):
    """Every setuid/setgid file under /usr runs with the sandbox user's ids only:
    /usr is mounted nosuid, no_new_privs is set, and the files' owner (host root)
    is not even mapped in the sandbox. Observed from /proc while each runs."""
    inside = run_ok(box["kc"], cell("""
import os, stat, subprocess, time
found = []
for root, dirs, files in os.walk('/usr'):
    for n in files:
        p = os.path.join(root, n)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            found.append((p, st.st_uid, st.st_gid, bool(st.st_mode & stat.S_ISUID)))
argv = {'/usr/bin/su': ['-c', 'id -u > /tmp/su-ran'], '/usr/bin/mount': ['-t', 'tmpfs', 'none', '/tmp'],
        '/usr/bin/umount': ['/data/input'], '/usr/sbin/unix_chkpwd': ['root', 'nullok'],
        '/usr/lib/polkit-1/polkit-agent-helper-1': ['root'], '/usr/bin/newgrp': [],
        '/usr/bin/ssh-agent': ['-D', '-a', '/tmp/setuid-agent.sock'], '/usr/bin/passwd': ['root']}
runs = {}
for path, uid, gid, suid in found:
    if not os.access(path, os.X_OK):
        runs[path] = {'executable': False}
        continue
    proc = subprocess.Popen([path] + argv.get(path, []), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen, t0 = set(), time.monotonic()
    while time.monotonic() - t0 < 1.0 and proc.poll() is None:
        try:
            exe = os.readlink(f'/proc/{proc.pid}/exe')
            ids = [l.split()[1:] for l in open(f'/proc/{proc.pid}/status') if l.startswith(('Uid:', 'Gid:'))]
            st = [l.split()[1] for l in open(f'/proc/{proc.pid}/status') if l.startswith('CapEff:')]
            if exe == path:
                seen.add(tuple(ids[0] + ids[1] + st))
        except OSError:
            pass
        time.sleep(0.002)
    proc.kill()
    out = proc.communicate()[0]
    runs[path] = {'executable': True, 'suid': suid, 'owner': [uid, gid], 'seen': sorted(seen),
                  'rc': proc.returncode, 'out': out[:200].decode(errors='replace')}
if os.path.lexists('/tmp/setuid-agent.sock'):
    os.unlink('/tmp/setuid-agent.sock')
mounts = open('/proc/self/mountinfo').read()
result = {'runs': runs, 'su_ran': os.path.exists('/tmp/su-ran'), 'euid': os.geteuid(),
          'usr_nosuid': any(l.split()[4] == '/usr' and 'nosuid' in l.split()[5] for l in mounts.splitlines()),
          'tmpfs_on_tmp_by_mount': mounts.count(' /tmp ')}
"""), timeout=180)
    runs = inside["runs"]
    if BUILT_IMAGE:
        # A stored root is sealed (image_builder.cpp, seal_root): Debian's su,
        # mount and passwd are there, but not one setuid or setgid file is.
        assert runs == {}, f"setuid/setgid files in the sealed image {BUILT_IMAGE}: {runs}"
    else:
        assert any(r.get("suid") for r in runs.values()), \
            f"no setuid binary found: proves nothing {runs}"
    assert inside["usr_nosuid"] and inside["euid"] == SANDBOX_UID, inside
    assert inside["su_ran"] is False, "su ran its command"
    assert inside["tmpfs_on_tmp_by_mount"] == 1, "mount(8) added a mount on /tmp"
    observed = {p: r for p, r in runs.items() if r.get("seen")}
    # su and unix_chkpwd wait for a password: they are always seen running.
    for path in ("/usr/bin/su", "/usr/sbin/unix_chkpwd"):
        if path in runs:
            assert path in observed, f"{path} was never seen running: {runs[path]}"
    for path, r in observed.items():
        for ids in r["seen"]:
            assert ids == [str(SANDBOX_UID)] * 8 + ["0" * 16], \
                f"{path} ran with ids {ids[:4]}/{ids[4:8]} caps {ids[8]} (expected {SANDBOX_UID} and none)"
    # Owned by host root, which the sandbox cannot map: the owner shows as the overflow id.
    for path, r in runs.items():
        if r.get("executable"):
            assert r["owner"] == [65534, 65534], (path, r)


def test_masked_proc_files_give_nothing(box):
    inside = run_ok(box["kc"], cell("""
import os
result = {}
for path in ['/proc/kcore', '/proc/keys', '/proc/timer_list', '/proc/sched_debug',
             '/proc/latency_stats', '/proc/timer_stats', '/proc/interrupts', '/proc/kmsg',
             '/proc/sysrq-trigger', '/proc/acpi', '/proc/scsi', '/sys/firmware',
             '/sys/devices/virtual/powercap']:
    try:
        if os.path.isdir(path):
            result[path] = {'entries': len(os.listdir(path))}
        else:
            with open(path, 'rb') as f:
                result[path] = {'bytes': len(f.read(1 << 16))}
    except OSError as e:
        result[path] = {'errno': e.errno}
"""))
    for path, outcome in inside.items():
        ok = outcome.get("bytes") == 0 or outcome.get("entries") == 0 or \
            outcome.get("errno") in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EIO)
        assert ok, f"{path}: {outcome} (expected empty, absent or refused)"


def test_host_daemon_sockets_are_not_visible(box):
    """No host daemon socket in the sandbox: not at the usual paths, and no unix
    socket anywhere in its file tree but the kernel's own under /run/cellblock."""
    inside = run_ok(box["kc"], cell("""
import os, stat
paths = ['/run/dbus/system_bus_socket', '/var/run/dbus/system_bus_socket', '/var/run/docker.sock',
         '/run/docker.sock', '/run/containerd/containerd.sock', '/run/systemd', '/run/systemd/private',
         '/run/user', '/var/run', '/run/podman/podman.sock', '/run/crio/crio.sock',
         '/var/lib/kubelet', '/run/snapd.socket', '/tmp/.X11-unix']
# A built Debian root has its own /var/run: a symlink to its (empty) /run.
result = {'present': [p for p in paths if os.path.lexists(p)
                      and not (p == '/var/run' and os.readlink(p).strip('/') == 'run')],
          'sockets': []}
for top in ['/']:
    for dirpath, dirs, files in os.walk(top):
        if dirpath in ('/proc', '/sys', '/usr'):  # /usr: the host's, read-only, holds no socket
            dirs[:] = []
            continue
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    result['sockets'].append(p)
            except OSError:
                pass
"""), timeout=120)
    assert inside["present"] == [], inside["present"]
    assert all(re.fullmatch(r"/run/cellblock/k-\d", p) for p in inside["sockets"]), inside["sockets"]


def test_raw_sockets_and_network_changes_are_refused(box):
    inside = run_ok(box["kc"], cell("""
import fcntl, socket, struct
result = {}
for name, fam, typ, proto in [('AF_PACKET raw', 17, socket.SOCK_RAW, 0x0300),
                              ('AF_PACKET dgram', 17, socket.SOCK_DGRAM, 0x0300),
                              ('AF_INET raw icmp', socket.AF_INET, socket.SOCK_RAW, 1),
                              ('AF_INET raw tcp', socket.AF_INET, socket.SOCK_RAW, 6),
                              ('AF_INET6 raw icmpv6', socket.AF_INET6, socket.SOCK_RAW, 58),
                              ('ICMP ping socket', socket.AF_INET, socket.SOCK_DGRAM, 1)]:
    try:
        socket.socket(fam, typ, proto).close()
        result[name] = 'created'
    except OSError as e:
        result[name] = e.errno
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
get = lambda: struct.unpack('16sH22x', fcntl.ioctl(s, 0x8913, struct.pack('16sH22x', b'lo', 0)))[1]
flags = get()
result['lo flags'] = flags
# SIOCSIFFLAGS with lo's own flags, and with lo down: both need CAP_NET_ADMIN.
for name, value in (('set lo flags', flags), ('take lo down', flags & ~1)):
    try:
        fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', value))
        result[name] = 'done'
    except OSError as e:
        result[name] = e.errno
result['lo flags after'] = get()
"""))
    # runc brings the sandbox's own lo up (IFF_UP|IFF_LOOPBACK): code can talk to
    # itself on 127.0.0.1; the host's loopback is another namespace (test_containment).
    flags, after = inside.pop("lo flags"), inside.pop("lo flags after")
    assert flags & 0x9 == 0x9 and after & 0x9 == 0x9, (flags, after)  # IFF_UP|IFF_LOOPBACK
    for name, outcome in inside.items():
        assert outcome in (errno.EPERM, errno.EACCES), f"{name}: {errname(outcome)}"


def test_no_resolver_and_no_route_out(box, host):
    """No DNS configuration, no route: name lookups fail fast without traffic, and the
    host's loopback UDP listener is never reached."""
    addresses = host.addresses()
    inside = run_ok(box["kc"], cell(f"""
import socket, time
result = {{}}
t0 = time.monotonic()
for name in ('example.com', 'cellblock-test.invalid', 'localhost.localdomain'):
    try:
        result[name] = socket.getaddrinfo(name, 80)[0][4][0]
    except socket.gaierror as e:
        result[name] = e.errno
result['lookup_seconds'] = time.monotonic() - t0
result['localhost'] = socket.gethostbyname('localhost')  # /etc/hosts still works
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b'dns?', tuple({addresses['udp 127.0.0.1']!r}))
    result['udp to host'] = 'sent'
except OSError as e:
    result['udp to host'] = e.errno
"""))
    assert inside.pop("lookup_seconds") < 5, inside
    assert inside.pop("localhost") == "127.0.0.1", inside
    # 127.0.0.1 inside is the sandbox's own loopback (up, in its own network namespace).
    assert inside.pop("udp to host") in (errno.ENETUNREACH, errno.EADDRNOTAVAIL, "sent"), inside
    for name, outcome in inside.items():
        assert outcome in (socket.EAI_NONAME, socket.EAI_AGAIN, socket.EAI_FAIL), \
            f"{name} resolved to {outcome}"
    time.sleep(0.2)
    assert host.collect_hits()["udp 127.0.0.1"] == 0


# ================================================================ resource exhaustion

THREAD_BOMB = """
import threading
threading.stack_size(256 * 1024)
bomb_release = threading.Event()
bomb_threads, bomb_error = [], None
for i in range(100000):
    t = threading.Thread(target=bomb_release.wait)
    try:
        t.start()
    except RuntimeError as e:
        bomb_error = str(e)
        break
    bomb_threads.append(t)
status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
result = {'started': len(bomb_threads), 'error': bomb_error, 'threads': int(status['Threads'])}
"""


def test_thread_bomb_is_stopped_by_the_pids_limit(fresh):
    km, kc, sid = fresh
    bomb = run_ok(kc, cell(THREAD_BOMB), timeout=120)
    try:
        assert bomb["error"] and "can't start new thread" in bomb["error"], bomb
        assert bomb["threads"] <= PIDS_LIMIT, bomb
        pids_dir = glob.glob(f"/sys/fs/cgroup/pids/cellblock/cb-{sid}") + \
            glob.glob(f"/sys/fs/cgroup/cellblock/cb-{sid}")
        with open(os.path.join(pids_dir[0], "pids.current")) as f:
            assert int(f.read()) <= PIDS_LIMIT
        # The host forks as usual meanwhile.
        assert subprocess.run(["/usr/bin/true"]).returncode == 0
        # The kernel, at its limit, still answers.
        assert run_ok(kc, cell("result = 6 * 7"), timeout=60) == 42
    finally:
        released = run_ok(kc, cell("""
bomb_release.set()
for t in bomb_threads:
    t.join()
import threading
result = threading.active_count()
"""), timeout=120)
    assert released < 20, released
    assert run_ok(kc, cell("import subprocess; result = subprocess.run(['/usr/bin/true']).returncode")) == 0


def test_a_million_open_files_stop_at_rlimit_nofile(box):
    server_fds = len(os.listdir(f"/proc/{cellblock_pid(box['km'])}/fd"))
    inside = run_ok(box["kc"], cell("""
import os, resource
fds, err = [], None
for i in range(1_000_000):
    try:
        fds.append(os.open('/dev/null', os.O_RDONLY))
    except OSError as e:
        err = e.errno
        break
opened = len(fds)
for fd in fds:
    os.close(fd)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
    raised = True
except (ValueError, OSError):
    raised = False
result = {'opened': opened, 'errno': err, 'limit': resource.getrlimit(resource.RLIMIT_NOFILE),
          'raised': raised}
"""), timeout=120)
    assert inside["errno"] == errno.EMFILE, inside
    assert inside["limit"] == [4096, 4096] and inside["raised"] is False, inside
    assert 3900 < inside["opened"] < 4096, inside
    assert len(os.listdir(f"/proc/{cellblock_pid(box['km'])}/fd")) <= server_fds + 4
    assert run_ok(box["kc"], cell("result = 1 + 1")) == 2


STUBBORN = r"""
import os, signal, subprocess, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)          # the kernel itself ignores them now
code = '''
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {{signal.SIGKILL, signal.SIGSTOP}})
os.setsid()
if os.fork():
    os._exit(0)
while True:
    open('/tmp/stubborn-' + sys.argv[1], 'w').write(str(time.time()))
    time.sleep(0.1)
'''
subprocess.run([sys.executable, '-c', code, '{tag}'])
time.sleep(0.5)
pid = next(int(p) for p in os.listdir('/proc') if p.isdigit() and
           b'stubborn' in open(f'/proc/{{p}}/cmdline', 'rb').read() and int(p) != os.getpid())
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
    os.kill(pid, s)
time.sleep(0.3)
state = open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()[0]
result = {{'pid': pid, 'state': state, 'ppid': int(open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()[1])}}
"""


def test_signal_ignoring_processes_die_at_session_close(fresh):
    """A kernel ignoring SIGTERM/SIGHUP/SIGQUIT (ipykernel restores its own SIGINT
    handler for each execution) and a setsid grandchild blocking every catchable
    signal: polite signals change nothing, the session's close kills both. (test_containment's double-forked daemon covers the
    plain SIG_IGN daemon; this adds blocked signals and a stubborn kernel.)"""
    km, kc, sid = fresh
    tag = secrets.token_hex(4)
    stubborn = run_ok(kc, cell(STUBBORN.format(tag=tag)))
    assert stubborn["state"] in ("S", "R") and stubborn["ppid"] == 1, stubborn
    host_pids = sandbox_pids(sid, include_zombies=False)
    assert len(host_pids) >= 3, host_pids
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    assert wait_for(lambda: not [p for p in host_pids if proc_state(p) not in (None, "Z")],
                    timeout=10), {p: proc_state(p) for p in host_pids}


def test_kill_minus_one_from_a_child_ends_the_session_not_the_host(fresh, host):
    """kill(-1, SIGKILL) from a process of the sandbox kills every process of the
    sandbox it may signal, the kernel included: the session ends with a clear
    error; the host's sleepers (one runs as the sandbox user's very host uid) live."""
    km, kc, sid = fresh
    reply, outputs = run_cell(kc, """
import os, subprocess, sys, time
kids = [subprocess.Popen(['/usr/bin/sleep', '300']) for _ in range(3)]
subprocess.run([sys.executable, '-c', 'import os, signal; os.kill(-1, signal.SIGKILL)'])
time.sleep(10)
print('the kernel survived')
""", timeout=60)
    assert "the kernel survived" not in stream_text(outputs)
    assert reply["status"] == "error" and reply["ename"] == "KernelDied", reply
    assert "signal 9" in reply["evalue"], reply
    assert km.provisioner.process.wait(timeout=15) == 1
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)
    assert all(p.poll() is None for p in host.sleepers)


def test_kill_minus_one_from_the_kernel_spares_only_itself_and_init(fresh, host):
    """From the kernel itself, Linux spares the caller and the namespace's init:
    the children die, the session goes on; the host is untouched."""
    km, kc, sid = fresh
    inside = run_ok(kc, cell("""
import os, signal, subprocess, time
kids = [subprocess.Popen(['/usr/bin/sleep', '300']) for _ in range(3)]
time.sleep(0.2)
os.kill(-1, signal.SIGKILL)
time.sleep(0.3)
result = {'kids': [k.poll() for k in kids],
          'left': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), 'me': os.getpid()}
"""))
    assert inside["kids"] == [-9, -9, -9], inside
    assert inside["left"] == sorted({1, inside["me"]}), inside
    assert run_ok(kc, cell("result = 6 * 7")) == 42
    assert all(p.poll() is None for p in host.sleepers)


# ================================================================ cross-session

def test_second_session_finds_nothing_of_the_first(box, fresh):
    """Session B looks for session A: its id, its inner key (read from the host), a
    file and a process tagged by A, A's ipc sockets at their host path. (Files in
    the shared-looking directories and listeners: test_containment.)"""
    sid_a = box["sid"]
    _, kc_b, sid_b = fresh
    with open(os.path.join(STATE_DIR, "sessions", sid_a, "ipc", "kernel.json")) as f:
        key_a = json.load(f)["key"]
    tag = f"xs-{secrets.token_hex(6)}"
    run_ok(box["kc"], cell(f"""
import subprocess
open('/tmp/{tag}', 'w').write('session A')
open('/data/output/{tag}', 'w').write('session A')
xs_sleeper = subprocess.Popen(['/usr/bin/sleep', '120', '{tag}'])
result = xs_sleeper.pid
"""))
    needles = [n[::-1] for n in (sid_a, key_a, tag)]  # reversed: the cell's own text holds no needle
    found = run_ok(kc_b, cell(f"""
import os, socket
needles = [n[::-1].encode() for n in {needles!r}]
found = []
def scan(path, data):
    found.extend(f'{{path}}: needle {{i}}' for i, n in enumerate(needles) if n in data)
for dirpath, dirs, files in os.walk('/'):
    if dirpath in ('/proc', '/sys', '/usr', '/dev'):
        dirs[:] = []
        continue
    for n in files:
        p = os.path.join(dirpath, n)
        try:
            with open(p, 'rb') as f:
                scan(p, f.read(1 << 20))
        except OSError:
            pass
        scan(p, p.encode())
for p in os.listdir('/proc'):
    if p.isdigit() or p == 'self':
        for what in ('cmdline', 'environ', 'mountinfo', 'cgroup'):
            try:
                scan(f'/proc/{{p}}/{{what}}', open(f'/proc/{{p}}/{{what}}', 'rb').read())
            except OSError:
                pass
        try:
            for fd in os.listdir(f'/proc/{{p}}/fd'):
                scan(f'/proc/{{p}}/fd/{{fd}}', os.readlink(f'/proc/{{p}}/fd/{{fd}}').encode())
        except OSError:
            pass
reach = {{}}
for k in range(1, 6):
    path = f'/run/cellblock/kernels/sessions/{{needles[0].decode()}}/ipc/k-{{k}}'
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        reach[path] = 'connected'
    except OSError as e:
        reach[path] = e.errno
    s.close()
result = {{'found': found, 'reach': reach}}
"""), timeout=120)
    assert found["found"] == [], f"session B found traces of session A: {found['found']}"
    assert set(found["reach"].values()) == {errno.ENOENT}, found["reach"]
    run_ok(box["kc"], cell("xs_sleeper.kill(); xs_sleeper.wait(); result = 0"))


# ================================================================ confused deputy

def test_ipc_socket_symlinks_do_not_redirect_the_server(fresh, host):
    """The kernel's ipc sockets live in a directory the sandbox can write, on the
    host: the server (root) connects to them by path. A kernel that replaces them
    with symlinks to a host socket and breaks its connections must not make the
    server connect there. The target is a listener in a root-only host directory
    the sandbox cannot reach itself."""
    km, kc, sid = fresh
    host.take_hits()
    target = host.unix_path
    inside = run_ok(kc, cell(f"""
import os
result = {{'before': sorted(os.listdir('/run/cellblock'))}}
for n in result['before']:
    if n.startswith('k-'):
        os.unlink('/run/cellblock/' + n)
        os.symlink({target!r}, '/run/cellblock/' + n)
result['links'] = sorted(n for n in os.listdir('/run/cellblock') if os.path.islink('/run/cellblock/' + n))
try:
    os.stat({target!r})
    result['reachable_inside'] = True
except OSError as e:
    result['reachable_inside'] = e.errno
"""))
    assert inside["links"] == [f"k-{i}" for i in range(1, 6)], inside
    assert inside["reachable_inside"] == errno.ENOENT, inside
    # Break the established connections (shutdown of the kernel's unix sockets); the
    # server's sockets then reconnect, by path, every 10 ms.
    kc.execute("""
import os, socket
for fd in range(3, 4096):
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        continue
    if s.family == socket.AF_UNIX:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    s.close()
""")
    time.sleep(3)
    hits = host.take_hits()
    assert hits["unix path"] == 0, \
        f"GAP: the server connected {hits['unix path']} time(s) to the host socket {target} " \
        "through symlinks the sandbox planted in its ipc directory (a root-only path the " \
        "sandbox cannot reach itself)"


# ================================================================ hostile kernel, server mode

@pytest.fixture(scope="module")
def serve(host):
    # test_images.py runs this suite again on a built image: extra serve
    # arguments (--image NAME --image-store DIR) come from the environment.
    srv = sh.start_server(json.loads(os.environ.get("CELLBLOCK_ATTACK_SERVE_ARGS", "[]")))
    yield srv
    problems = srv.shutdown()
    assert not problems, "\n".join(problems)


def _gather(kc, seconds, until=None):
    """Every message on shell, iopub and stdin for `seconds` (after `until`, a
    msg_id, went idle, if given), as (channel, message) pairs."""
    out = []
    idle_at = None if until else time.monotonic()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if idle_at is not None and time.monotonic() > idle_at + seconds:
            return out
        got = False
        for channel, get in (("shell", kc.get_shell_msg), ("iopub", kc.get_iopub_msg),
                             ("stdin", kc.get_stdin_msg)):
            try:
                msg = get(timeout=0.05)
            except queue.Empty:
                continue
            got = True
            out.append((channel, msg))
            if until and idle_at is None and channel == "iopub" and \
                    msg["parent_header"].get("msg_id") == until and msg["msg_type"] == "status" \
                    and msg["content"]["execution_state"] == "idle":
                idle_at = time.monotonic()
        if not got:
            time.sleep(0.01)
    raise AssertionError(f"no idle for {until} in 120 s: {[m['msg_type'] for _, m in out]}")


def _run_and_gather(kc, code, seconds=1.5):
    """Executes code; every message of every channel until its idle, plus `seconds`."""
    msg_id = kc.execute(code)
    return msg_id, _gather(kc, seconds, until=msg_id)


def _marked(messages, marker):
    """Messages carrying the marker (not the forging cell's own execute_input)."""
    return [(channel, m["msg_type"], m["parent_header"].get("msg_id"))
            for channel, m in messages
            if marker in json.dumps(m["content"]) and m["msg_type"] != "execute_input"]


def _replies_to(messages, msg_id):
    return [m for c, m in messages if c == "shell" and m["parent_header"].get("msg_id") == msg_id]


FORGE = """
from IPython import get_ipython
_k = get_ipython().kernel
def forge(channel, msg_type, content, msg_id, parent_type='execute_request'):
    '''Sends a message signed with the kernel's (inner) key, as ipykernel would.'''
    parent = {'msg_id': msg_id, 'msg_type': parent_type, 'session': 'forged', 'username': 'u',
              'date': '2020-01-01T00:00:00.000000Z', 'version': '5.3'}
    if channel == 'iopub':
        _k.session.send(_k.iopub_socket, msg_type, content, parent=parent)
    else:
        stream = _k.shell_stream if channel == 'shell' else _k.stdin_socket
        _k.session.send(stream, msg_type, content, parent=parent, ident=_k._parent_ident['shell'])
"""


@pytest.fixture
def two_sessions(serve):
    """Sessions A and B of one `cellblock serve`; closed afterwards."""
    opened = [serve.open_session() for _ in range(2)]
    yield [(sid, kc) for sid, kc, _ in opened]
    for sid, kc, _ in opened:
        kc.stop_channels()
        serve.call("session_close_request", {"session_id": sid})


def test_forged_iopub_for_foreign_parents_never_reaches_a_client(serve, two_sessions):
    """Session A's kernel publishes output, errors and an idle status under a random
    parent and under session B's requests (a finished one and one still running):
    neither A's client nor B's sees any of it, and B's running execution is not
    ended by the forged idle."""
    (_, ka), (_, kb) = two_sessions
    done_b, _ = sh.execute(kb, "b_value = 1")
    b_done = done_b["parent_header"]["msg_id"]
    b_running = kb.execute("import time; time.sleep(3); print('b finished')")
    marker = f"FORGED-{secrets.token_hex(4)}"
    targets = {"random": str(uuid.uuid4()), "B finished": b_done, "B running": b_running}
    rejected_before = serve.log().count("parent is not a request of this session")
    code = FORGE + f"""
for label, mid in {targets!r}.items():
    forge('iopub', 'stream', {{'name': 'stdout', 'text': '{marker} ' + label}}, mid)
    forge('iopub', 'display_data', {{'data': {{'text/plain': '{marker} ' + label}}, 'metadata': {{}}}}, mid)
    forge('iopub', 'execute_result', {{'data': {{'text/plain': '{marker}'}}, 'metadata': {{}},
                                       'execution_count': 1}}, mid)
    forge('iopub', 'error', {{'ename': '{marker}', 'evalue': label, 'traceback': []}}, mid)
    forge('iopub', 'status', {{'execution_state': 'idle', 'note': '{marker}'}}, mid)
print('forged')
"""
    _, a_msgs = _run_and_gather(ka, code)
    b_msgs = _gather(kb, 0.5, until=b_running)
    assert "forged" in "".join(m["content"].get("text", "") for c, m in a_msgs if c == "iopub")
    assert _marked(a_msgs, marker) == [], f"A's client got forged messages: {_marked(a_msgs, marker)}"
    assert _marked(b_msgs, marker) == [], f"B's client got A's forged messages: {_marked(b_msgs, marker)}"
    replies_b = _replies_to(b_msgs, b_running)
    assert len(replies_b) == 1 and replies_b[0]["content"]["status"] == "ok", replies_b
    b_out = "".join(m["content"].get("text", "") for c, m in b_msgs
                    if c == "iopub" and m["parent_header"].get("msg_id") == b_running)
    assert b_out == "b finished\n", b_out
    def rejected():
        return serve.log().count("parent is not a request of this session") - rejected_before
    wait_for(lambda: rejected() >= 15, timeout=5)
    assert rejected() == 15, f"{rejected()} rejections logged for 15 forged messages"


def test_forged_replies_for_requests_that_are_not_open_are_dropped(serve, two_sessions):
    """Replies and input requests the kernel makes up: for a random request, for its
    own finished request, for session B's running request. None reaches a client;
    and a second reply to the running request is never delivered (one reply each)."""
    (_, ka), (_, kb) = two_sessions
    done_a, _ = sh.execute(ka, "a_value = 1")
    a_done = done_a["parent_header"]["msg_id"]
    b_running = kb.execute("import time; time.sleep(3); 'b'")
    marker = f"FORGED-{secrets.token_hex(4)}"
    targets = {"random": str(uuid.uuid4()), "A finished": a_done, "B running": b_running}
    code = FORGE + f"""
import time
for label, mid in {targets!r}.items():
    forge('shell', 'execute_reply', {{'status': 'ok', 'execution_count': 9, 'user_expressions': {{}},
                                      'payload': [], 'note': '{marker} ' + label}}, mid)
    forge('shell', 'kernel_info_reply', {{'status': 'ok', 'note': '{marker}'}}, mid, 'kernel_info_request')
    forge('stdin', 'input_request', {{'prompt': '{marker} ' + label, 'password': False}}, mid)
# Two more replies to the request that is running: the client gets one reply in all.
for i in range(2):
    forge('shell', 'execute_reply', {{'status': 'ok', 'execution_count': 9, 'user_expressions': {{}},
                                      'payload': [], 'note': 'DUPLICATE-{marker}'}}, _k.get_parent()['header']['msg_id'])
time.sleep(0.3)
print('forged')
"""
    a_current, a_msgs = _run_and_gather(ka, code)
    b_msgs = _gather(kb, 0.5, until=b_running)
    forged_a = [m for m in _marked(a_msgs, marker) if m[:2] != ("shell", "execute_reply") or
                m[2] != a_current]
    assert forged_a == [], f"A's client got forged messages: {forged_a}"
    assert _marked(b_msgs, marker) == [], f"B's client got A's forged messages: {_marked(b_msgs, marker)}"
    replies = _replies_to(a_msgs, a_current)
    assert len(replies) == 1, f"{len(replies)} replies to one request: {[r['content'] for r in replies]}"
    replies_b = _replies_to(b_msgs, b_running)
    assert len(replies_b) == 1 and replies_b[0]["content"]["status"] == "ok", replies_b
    assert "forged" in "".join(m["content"].get("text", "") for c, m in a_msgs if c == "iopub")


def test_forged_iopub_under_a_finished_request_stays_within_the_output_budget(serve, two_sessions):
    """Output under a request that is no longer running (a background thread's, or
    a forger's) is not shaped by any execution: the proxy gives it one budget of
    output_bytes until the next execution starts (commit 4a945df). A kernel that
    publishes 4 MiB of each message type under its own finished request must get
    no more than that budget (plus a marker) to the client, whatever the type."""
    (sid, ka), _ = two_sessions
    cap = serve.info_of(sid)["limits"]["output_bytes"]
    done, _ = sh.execute(ka, "a = 1")
    finished = done["parent_header"]["msg_id"]
    code = FORGE + f"""
pad = 'P' * (256 << 10)
for i in range(16):   # 16 x 256 KiB = 4 MiB of each
    forge('iopub', 'stream', {{'name': 'stdout', 'text': pad}}, {finished!r})
    forge('iopub', 'display_data', {{'data': {{'text/plain': pad}}, 'metadata': {{}}}}, {finished!r})
    forge('iopub', 'execute_input', {{'code': pad, 'execution_count': 1}}, {finished!r})
    forge('iopub', 'status', {{'execution_state': 'busy', 'pad': pad}}, {finished!r})
    forge('iopub', 'clear_output', {{'wait': False, 'pad': pad}}, {finished!r})
print('forged')
"""
    current, msgs = _run_and_gather(ka, code, seconds=3)
    assert "forged" in "".join(m["content"].get("text", "") for c, m in msgs
                               if c == "iopub" and m["parent_header"].get("msg_id") == current)
    late = [m for c, m in msgs if c == "iopub" and m["parent_header"].get("msg_id") == finished]
    by_type = {}
    for m in late:
        count, size = by_type.get(m["msg_type"], (0, 0))
        by_type[m["msg_type"]] = (count + 1, size + len(json.dumps(m["content"])))
    total = sum(size for _, size in by_type.values())
    assert total <= cap + 1024, \
        f"GAP: {total} bytes of forged iopub under the finished request {finished} reached the " \
        f"client (output_bytes={cap}); (messages, bytes) by type: {by_type}"


FLOOD = """
import sys
chunk = 'x' * ((1 << 20) - 1) + '\\n'
for i in range(1024):          # 1 GiB, flushed as it goes, as a chatty loop would
    sys.stdout.write(chunk)
    sys.stdout.flush()
print('flood done', file=sys.stderr)
"""


def test_gigabyte_of_stdout_is_cut_at_the_cap_and_other_sessions_answer(serve, two_sessions):
    """Server mode: 1 GiB to stdout in flushed 1 MiB writes. The execution's output is
    cut at output_bytes; what the kernel still had queued when its execute_reply was
    released reaches the proxy after the execution and falls under the session's
    background budget (output_bytes again, commit 4a945df). So the client gets at
    most 2 x output_bytes plus two markers; another session answers meanwhile."""
    (sid_a, ka), (_, kb) = two_sessions
    cap = serve.info_of(sid_a)["limits"]["output_bytes"]
    flood_id = ka.execute(FLOOD)
    received, streams, idle, reply_a, b_seconds = 0, 0, False, None, None
    deadline = time.monotonic() + 180
    while not idle and received <= 2 * cap + 65536 and time.monotonic() < deadline:
        try:
            msg = ka.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != flood_id:
            continue
        if msg["msg_type"] == "stream":
            received += len(msg["content"]["text"])
            streams += 1
            if b_seconds is None:  # the flood runs: does session B still answer?
                t0 = time.monotonic()
                rep_b, io_b = sh.execute(kb, "6 * 7", timeout=60)
                b_seconds = time.monotonic() - t0
                assert [m["content"]["data"]["text/plain"] for m in io_b
                        if m["msg_type"] == "execute_result"] == ["42"], io_b
        idle = msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
    try:
        reply_a = ka.get_shell_msg(timeout=1)
    except queue.Empty:
        pass
    if not idle:
        serve.ok("session_close_request", {"session_id": sid_a})  # stop the flood
    assert b_seconds is not None and b_seconds < 10, f"session B took {b_seconds} s during the flood"
    meta = (reply_a or {}).get("metadata", {}).get("cellblock")
    assert received <= 2 * cap + 512, \
        f"GAP: the client received {received} bytes of stream output in {streams} messages " \
        f"for one execution with output_bytes={cap} (reply metadata: {meta})"
    assert idle, "the flood's execution never went idle"


def test_gigabyte_of_stdout_in_kernel_mode_is_cut_at_the_cap(fresh):
    """Kernel mode shapes output as server mode does (the same SessionGovernor):
    of 1 GiB of flushed stdout the client gets output_bytes (1 MiB) and one
    marker, the reply says what was dropped, the server's peak RSS stays
    bounded, and the kernel answers afterwards."""
    km, kc, sid = fresh
    msg_id = kc.execute(FLOOD, user_expressions={})
    texts, idle = [], False
    deadline = time.monotonic() + 200
    while not idle:
        assert time.monotonic() < deadline, f"no idle after {sum(map(len, texts))} bytes"
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            texts.append(msg["content"]["text"])
        idle = msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
    reply = kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(texts)
    marker = "\n[cellblock: output truncated at 1048576 bytes; the rest of this execution's " \
             "stream output is dropped]\n"
    assert text.count("[cellblock: output truncated") == 1 and text.endswith(marker), text[-300:]
    assert len(text) - len(marker) == 1 << 20, len(text)
    budget = reply["metadata"]["cellblock"]
    # stderr's "flood done\n" shares the execution's budget: it is dropped too.
    dropped = (1 << 30) + len("flood done\n") - (1 << 20)
    assert budget["output_truncated"] and budget["output_dropped_bytes"] == dropped, budget
    with open(f"/proc/{cellblock_pid(km)}/status") as f:
        hwm_kb = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
    assert hwm_kb < 1 << 20, f"the server's peak RSS was {hwm_kb} kB relaying the flood"
    assert run_ok(kc, cell("result = 6 * 7")) == 42
