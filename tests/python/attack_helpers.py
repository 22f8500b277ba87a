"""Shared code of the attack suite (test_attacks_*.py): syscall tables, the
fixtures, and HostWatch, which judges the host after every case.

Each test_attacks_*.py file is one ctest entry of a few minutes; together they
are the attack suite. test_images_attacks_*.py run each file again on a built
image (CELLBLOCK_ATTACK_IMAGE, CELLBLOCK_ATTACK_SERVE_ARGS).

What HostWatch judges, and why only that
----------------------------------------
The suite runs on a shared host: CI's machine runs other cellblock servers,
Docker containers start and stop, packages get installed, users get added. A
check of host-wide state (every mount, every cgroup, /etc/passwd's bytes) fails
on that churn and says nothing about cellblock. So every check below is about
what this suite's own sessions could have changed, or is attributable to them,
while still catching what a sandbox escape would do:

- Files the suite planted (sentinels in a root-only 0700 dir): any change.
- Host files a sandbox sees or targets (/etc/passwd, shadow, group, hosts,
  hostname, resolv.conf, the host's python, su, mount, libc): a change of the
  content of the inode the watch holds open since the start. A write through
  an escaped fd, a writable bind mount or /proc/<pid>/exe modifies the file in
  place; package managers and shadow-utils (useradd, passwd) write a new file
  and rename it over (a new inode), which is ignored unless the file at the
  path is owned by one of the ids the suite's sandboxes map to (a sandbox
  process creates files as those ids). The fd is held so that the old inode's
  number cannot be reused by the replacement (ext4 reuses freed numbers at
  once, and a comparison of inode numbers alone then sees an in-place write).
- Mounts, in the host's mount namespace (this process's and PID 1's), new or
  vanished, reported when attributable:
    * the mount point is in a host system tree (/, /etc, /usr, /proc, /sys,
      /dev, /boot, /root, /home, ...), where no container runtime or other
      server mounts anything at run time, or in the suite's own watch dir;
    * the mounted filesystem is one of the suite's live sandboxes' own (same
      device number as a tmpfs, proc, mqueue... of the sandbox's mount
      namespace, which no one else can hold while the sandbox lives) and the
      mount point lies outside that session's own directory;
    * it binds a path of the suite's own sessions (their session dirs, the
      bundles' rootfs) somewhere outside them.
  Mounts of other servers' state dirs, Docker's overlays and netns files
  under /var/lib and /run are none of these and are not judged.
- Cgroups: a cgroup directory owned by an id one of the suite's sandboxes maps
  (cgroupfs gives a new cgroup its creator's fsuid: runc, Docker and cellblock
  create theirs as root), anywhere in the hierarchy but inside the sandboxes'
  own cb-* cgroups; and the v1 roots' release_agent (the cgroup escape of
  CVE-2022-0492).
- Processes: the suite's own sleepers (one as root, one as each host uid its
  sessions' sandbox user maps to) stay alive; every process in one of the
  suite's sandboxes' pid or user namespaces stays in that session's
  cellblock/cb-<id> cgroup on every hierarchy (a process that left it escaped
  its limits).
- The suite's own listeners (TCP, UDP, abstract and pathname unix) see no hit.
- Host-global values nothing on a CI host changes at run time: hostname,
  core_pattern, modprobe, domainname, dmesg_restrict, overcommit_memory.

What a sandbox could do that stays unattributable (a fresh tmpfs mounted
under /mnt, an unprivileged cgroup created as root) would need host root
outside the sandbox's namespaces; the process check above catches a sandbox
process that got out of its cgroup, and test_containment / test_posture check
the sandbox's ids, capabilities and namespaces from the host directly.
"""
import errno
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile

import pytest

import server_helpers as sh
from conftest import STATE_DIR, kernel_death, start_kernel, wait_for
from test_containment import (cell, host_uid_of_sandbox_user, proc_state, run_ok,
                              sandbox_pids, session_id_of, session_residue, stop_quietly)

# Set by test_images_attacks_*.py, which run the suite on a built image.
BUILT_IMAGE = os.environ.get("CELLBLOCK_ATTACK_IMAGE", "")
BLOCKED = (errno.EPERM, errno.ENOSYS)   # what the seccomp policy answers with

# ---------------------------------------------------------------- syscall tables

def syscall_numbers(header):
    """{name: number} from a kernel header's __NR_ defines."""
    numbers = {}
    with open(header) as f:
        for line in f:
            m = re.match(r"#define __NR_(\w+)\s+(\d+)", line)
            if m:
                numbers[m.group(1)] = int(m.group(2))
    return numbers


NR64 = syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
NR32 = syscall_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_32.h")

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


# 1 GiB of stdout in flushed 1 MiB writes, for the output cases of both modes.
FLOOD = """
import sys
chunk = 'x' * ((1 << 20) - 1) + '\\n'
for i in range(1024):          # 1 GiB, flushed as it goes, as a chatty loop would
    sys.stdout.write(chunk)
    sys.stdout.flush()
print('flood done', file=sys.stderr)
"""


# ---------------------------------------------------------------- the host, watched

# Trees of the host where nothing mounts at run time (container runtimes and
# other servers mount under /run, /var/lib, /tmp, /mnt or their own dirs).
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot",
                "/root", "/home", "/opt", "/srv", "/proc", "/sys", "/dev")


PF_EXITING = 0x4   # /proc/<pid>/stat flags: the process is in exit()


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


def _under(path, tops):
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)


def _mountinfo(path):
    """{(mount point, device, root in its fs, fs type, source)} of one mountinfo file."""
    rows = set()
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                rows.add((fields[4], fields[2], fields[3], fields[sep + 1], fields[sep + 2]))
    except OSError:
        pass
    return rows


def _host_mounts():
    """The host namespace's mounts, as this process and PID 1 see them."""
    return _mountinfo("/proc/self/mountinfo") | _mountinfo("/proc/1/mountinfo")


def _readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def _fd_sha256(fd):
    h = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        h.update(block)
        offset += len(block)
    return h.hexdigest()


class HostWatch:
    """The host as this suite's sessions could change it; problems() lists what
    they did change (see the module docstring for what is judged and why)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="cellblock-attack-", dir="/var/tmp")  # 0700, root
        self.sentinels = []
        for name in ("sentinel-a", "sentinel-b"):
            path = os.path.join(self.dir, name)
            with open(path, "wb") as f:
                f.write(secrets.token_bytes(4096))
            self.sentinels.append(path)
        self.sentinel_digests = {p: _sha256(p) for p in self.sentinels}
        # Host files a sandbox could target. (Not cellblock's own build output: other
        # work rebuilds it at any time; the cases that target it check the refusal.)
        # Each is held open: its inode cannot be freed and its number reused (a
        # file replaced by rename is then a different inode for sure), and what is
        # read through the fd is what an in-place write would have changed.
        self.files = {}
        for path in ("/etc/shadow", "/etc/passwd", "/etc/group", "/etc/hosts", "/etc/hostname",
                     "/etc/resolv.conf", "/usr/bin/python3.11", "/usr/bin/su", "/usr/bin/mount",
                     "/usr/lib/x86_64-linux-gnu/libc.so.6"):
            if os.path.isfile(path):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.files[path] = (fd, _fd_sha256(fd))
        self.values = {p: self._read(p) for p in (
            "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe",
            "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname",
            "/proc/sys/kernel/dmesg_restrict", "/proc/sys/vm/overcommit_memory",
            *sorted(glob.glob("/sys/fs/cgroup/*/release_agent")))}
        self.hostname = socket.gethostname()
        # Sleepers: one as root, then one as each host uid a session's sandbox user maps to.
        self.sleepers = []
        self.sleeper_ticks = {}
        self._sleep_as(0)
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
        # The suite's own sessions: kernel-mode ids, and the servers whose sessions count.
        self.kernel_sessions = set()
        self.servers = []
        self.namespaces = {}   # "pid:[N]" / "user:[N]" -> (live session id, a pid in it)
        self.id_ranges = set()  # (first, count) of host ids the sessions map
        self.ended = set()      # sessions with nothing left on the host
        self.rootfs = set()     # the sessions' bundle roots

    # -- what is ours
    def watch_session(self, sid):
        """A kernel-mode session of this suite (call it while the session runs)."""
        self.kernel_sessions.add(sid)
        self._learn(sid)

    def watch_server(self, srv):
        """A `cellblock serve` of this suite: its sessions are ours."""
        self.servers.append(srv)

    def _sessions(self):
        """{session id: (its session dir, every dir of the host that is its own)}
        for every session of the suite."""
        out = {sid: (os.path.join(STATE_DIR, "sessions", sid),
                     [os.path.join(STATE_DIR, "sessions", sid),
                      os.path.join(STATE_DIR, "runtime", f"cb-{sid}")])
               for sid in self.kernel_sessions}
        for srv in self.servers:
            for sid in srv.session_ids:
                out[sid] = (os.path.join(srv.state_dir, "sessions", sid), [srv.state_dir])
        return out

    def _live(self, sessions):
        """{session id: host pids} of the suite's sessions that still have processes."""
        live = {}
        for sid in sessions:
            if sid in self.ended:
                continue
            pids = sandbox_pids(sid, include_zombies=False)
            if pids:
                live[sid] = pids
            elif not os.path.exists(sessions[sid][0]):
                self.ended.add(sid)   # session ids are never reused
        return live

    def _learn(self, sid, pids=None):
        """Records the namespaces and id maps of a live session's processes, and
        starts a sleeper as the host uid of its sandbox user."""
        for pid in sandbox_pids(sid, include_zombies=False) if pids is None else pids:
            for ns in ("pid", "user"):
                link = _readlink(f"/proc/{pid}/ns/{ns}")
                if link:
                    self.namespaces.setdefault(link, (sid, pid))  # the lowest: the init
            try:
                with open(f"/proc/{pid}/uid_map") as f:
                    maps = [line.split() for line in f]
                with open(f"/proc/{pid}/gid_map") as f:
                    maps += [line.split() for line in f]
                self.id_ranges |= {(int(outside), int(count)) for _, outside, count in maps}
                uid = host_uid_of_sandbox_user(pid)
            except (OSError, AssertionError, ValueError):
                continue
            if uid not in {s.uid for s in self.sleepers}:
                self._sleep_as(uid)

    def _sleep_as(self, uid):
        p = subprocess.Popen(["/usr/bin/sleep", "3600"], stdin=subprocess.DEVNULL,
                             user=uid, group=uid, extra_groups=[])
        p.uid = uid
        self.sleepers.append(p)
        self.sleeper_ticks[p.pid] = wait_for(lambda: _start_ticks(p.pid))

    def _sandbox_id(self, value):
        return any(first <= value < first + count for first, count in self.id_ranges)

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

    # -- the judgement
    def problems(self):
        sessions = self._sessions()
        live = self._live(sessions)
        # Namespace numbers are reused once freed: only the live sessions' count.
        self.namespaces = {}
        for sid, pids in live.items():
            self._learn(sid, pids)
        return (self._file_problems() + self._value_problems() + self._process_problems() +
                self._listener_problems() + self._mount_problems(sessions, live) +
                self._cgroup_problems())

    def _file_problems(self):
        out = []
        for path, digest in self.sentinel_digests.items():
            try:
                now = _sha256(path)
            except OSError as e:
                now = f"unreadable: {e}"
            if now != digest:
                out.append(f"sentinel {path} changed (sha256 {digest[:12]} -> {now[:12]})")
        for path, (fd, digest) in self.files.items():
            now = _fd_sha256(fd)
            if now != digest:
                out.append(f"host file {path} was written in place "
                           f"(sha256 {digest[:12]} -> {now[:12]})")
            try:
                st = os.stat(path)
            except OSError as e:
                out.append(f"host file {path} is gone or unreadable: {e}")
                continue
            if self._sandbox_id(st.st_uid) or self._sandbox_id(st.st_gid):
                out.append(f"host file {path} is now owned by a sandbox's host ids "
                           f"{st.st_uid}:{st.st_gid}")
        return out

    def _value_problems(self):
        out = [f"host {path} changed: {value!r} -> {self._read(path)!r}"
               for path, value in self.values.items() if self._read(path) != value]
        if socket.gethostname() != self.hostname:
            out.append(f"host hostname changed to {socket.gethostname()!r}")
        return out

    def _process_problems(self):
        out = []
        for p in self.sleepers:
            if p.poll() is not None or _start_ticks(p.pid) != self.sleeper_ticks[p.pid]:
                out.append(f"host sleeper {p.pid} (uid {p.uid}, started by this suite) died: "
                           f"{p.returncode}")
        for path in glob.glob("/proc/[0-9]*"):
            links = {_readlink(f"{path}/ns/{ns}") for ns in ("pid", "user")} & set(self.namespaces)
            if not links:
                continue
            try:
                with open(f"{path}/cgroup") as f:
                    lines = [line.rstrip("\n").split(":", 2) for line in f]
                with open(f"{path}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] in ("Z", "X") or int(stat[6]) & PF_EXITING:
                continue   # a dying process reads "/" on the v1 hierarchies, and can do nothing
            for link in links:
                sid, witness = self.namespaces[link]
                # (A cgroup removed under a dying process reads "PATH (deleted)".)
                outside = [f"{ctl or 'unified'}:{cg}" for _, ctl, cg in lines
                           if not _under(cg.removesuffix(" (deleted)"), [f"/cellblock/cb-{sid}"])]
                # A session that ended since it was seen frees its namespaces, whose
                # numbers the next sandbox may get: count only a namespace that the
                # session's own process still holds.
                held = proc_state(witness) not in (None, "Z") and \
                    link in {_readlink(f"/proc/{witness}/ns/{ns}") for ns in ("pid", "user")}
                if outside and held:
                    out.append(f"process {path[6:]} of session {sid} left its cgroup: {outside}")
        return out

    def _listener_problems(self):
        hits = {name: n for name, n in self.collect_hits().items() if n}
        return [f"host listeners were reached: {hits}"] if hits else []

    def _mount_problems(self, sessions, live):
        now = _host_mounts()
        own_dirs = [d for _, dirs in sessions.values() for d in dirs]
        for session_dir, _ in sessions.values():
            try:
                with open(os.path.join(session_dir, "bundle", "config.json")) as f:
                    self.rootfs.add(json.load(f)["root"]["path"])
            except (OSError, ValueError, KeyError):
                pass
        rootfs = sorted(self.rootfs)
        # The devices of the live sandboxes' own (anonymous) filesystems: no one else
        # can hold these numbers while the sandbox lives.
        sandbox_devices = {}
        for sid, pids in live.items():
            for _, dev, _, _, _ in _mountinfo(f"/proc/{pids[0]}/mountinfo"):
                if dev.startswith("0:"):
                    sandbox_devices.setdefault(dev, (sid, sessions[sid][1]))
        host_devices_before = {dev for _, dev, _, _, _ in self.mounts}
        fs_tops = {dev: point for point, dev, root, _, _ in now | self.mounts if root == "/"}
        out = []
        for mount in sorted(now - self.mounts):
            point, dev, root, fstype, source = mount
            reasons = []
            if point == "/" or _under(point, SYSTEM_TREES + (self.dir,)):
                reasons.append("on a host system path")
            if dev in sandbox_devices and dev not in host_devices_before:
                sid, dirs = sandbox_devices[dev]
                if not _under(point, dirs):
                    reasons.append(f"a filesystem of session {sid}'s sandbox")
            origin = os.path.normpath(fs_tops.get(dev, "/") + "/" + root)
            if _under(origin, own_dirs + rootfs) and not _under(point, own_dirs):
                reasons.append(f"binds {origin}, a path of this suite's sessions")
            if reasons:
                out.append(f"new host mount {point} ({fstype} {source} dev {dev}): " +
                           "; ".join(reasons))
        for point, dev, root, fstype, source in sorted(self.mounts - now):
            if point == "/" or _under(point, SYSTEM_TREES + (self.dir,)):
                out.append(f"host mount {point} ({fstype} {source}) vanished")
        return out

    def _cgroup_problems(self):
        if not self.id_ranges:
            return []
        out = []
        for top in glob.glob("/sys/fs/cgroup/*/"):
            for dirpath, dirs, _ in os.walk(top):
                # Inside the sandboxes' own cgroups a sub-cgroup is the sandbox's business.
                dirs[:] = [d for d in dirs if not (d.startswith("cb-") and
                                                   os.path.basename(dirpath) == "cellblock")]
                try:
                    st = os.stat(dirpath)
                except OSError:
                    continue
                if self._sandbox_id(st.st_uid) or self._sandbox_id(st.st_gid):
                    out.append(f"cgroup {dirpath} was made by a sandbox (owner {st.st_uid}:{st.st_gid})")
        return out

    def close(self):
        for p in self.sleepers:
            p.kill()
            p.wait(timeout=10)
        for s in self.listeners.values():
            s.close()
        self.udp.close()
        for fd, _ in self.files.values():
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)



# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def host():
    watch = HostWatch()
    yield watch
    problems = watch.problems()
    watch.close()
    assert problems == [], problems


@pytest.fixture(autouse=True)
def host_unchanged(host):
    """After every case: nothing of the host changed that the suite's sessions could change."""
    yield
    problems = host.problems()
    assert problems == [], "the host changed during this case:\n" + "\n".join(problems)


class SharedSession:
    """One kernel-mode session shared by the cases that leave it usable."""

    def __init__(self, host):
        self.host = host
        self.start()

    def start(self):
        self.km, self.kc = start_kernel()
        self.sid = session_id_of(self.km)
        self.host.watch_session(self.sid)
        assert run_ok(self.kc, cell(SYSCALL_HELPER + "\nresult = sc(39)")) > 0  # getpid: helpers work

    def stop(self):
        stop_quietly(self.km, self.kc)
        assert wait_for(lambda: not session_residue(self.sid), timeout=15), session_residue(self.sid)

    def death(self):
        return kernel_death(self.km)

    def as_dict(self):
        return {"km": self.km, "kc": self.kc, "sid": self.sid}


@pytest.fixture(scope="module")
def shared_session(host):
    shared = SharedSession(host)
    yield shared
    shared.stop()


@pytest.fixture
def box(shared_session):
    """The shared session. A case that kills it fails at its teardown, with the
    kernel's log, and the next case gets a new one: one death is one failure,
    never a file of cases waiting on a dead kernel."""
    if shared_session.death():
        shared_session.stop()
        shared_session.start()
    yield shared_session.as_dict()
    death = shared_session.death()
    if death:
        shared_session.stop()
        shared_session.start()
        pytest.fail(f"this case killed the shared session {shared_session.sid}: {death}")


@pytest.fixture
def fresh(host):
    """A session of its own, for cases that wreck or end it; checked gone afterwards."""
    km, kc = start_kernel()
    sid = session_id_of(km)
    host.watch_session(sid)
    yield km, kc, sid
    problems = host.problems()   # while what is left of the session still runs
    stop_quietly(km, kc)
    assert problems == [], "the host changed during this case:\n" + "\n".join(problems)
    assert wait_for(lambda: not session_residue(sid), timeout=15), session_residue(sid)


@pytest.fixture(scope="module")
def serve(host):
    # test_images_attacks_*.py run this suite again on a built image: extra serve
    # arguments (--image NAME --image-store DIR) come from the environment.
    srv = sh.start_server(json.loads(os.environ.get("CELLBLOCK_ATTACK_SERVE_ARGS", "[]")))
    host.watch_server(srv)
    yield srv
    problems = srv.shutdown()
    assert not problems, "\n".join(problems)


def gaps(outcomes, allowed=BLOCKED):
    """The entries of {label: rc} whose result is not a refusal by the policy."""
    return {label: (errno.errorcode.get(-rc, rc) if isinstance(rc, int) and rc < 0 else rc)
            for label, rc in outcomes.items() if not (isinstance(rc, int) and -rc in allowed)}


def errname(value):
    return errno.errorcode.get(value, value) if isinstance(value, int) else value
