"""The attack suite, host escape: hostile code in a kernel-mode session tries to
reach the host (its root, the init's binary and memory, sysctls, devices,
namespaces, setuid binaries, masked /proc files, daemon sockets, the network),
another session, and the server through the ipc directory.

What is already proven elsewhere is not repeated here:
  test_containment.py  identity and caps seen from inside; a short list of
                       denied syscalls with valid arguments; /etc/shadow;
                       read-only directories; tmpfs caps; only `lo`; host
                       loopback listeners unreachable; sessions cannot see
                       each other's tmp files or listeners; environment
                       canaries; memory bomb; fork bomb; double-forked daemon.
  test_bad_input.py    hostile messages from the network on the outer channels.
  test_destroy.py      nothing is left after shutdown, SIGTERM, SIGKILL, kernel death.

HostWatch (attack_helpers.py) judges the host after every case: only what this
suite's own sessions could have changed, so that a busy shared host gives the
same verdict. A case that finds a gap FAILS and says what got through: the fix
belongs in the C++ code, never in a weaker assertion here. Traffic only ever
goes to 127.0.0.0/8, ::1 or unix sockets.
"""
import errno
import json
import os
import platform
import re
import secrets
import signal
import socket
import subprocess
import time

import pytest

from attack_helpers import BUILT_IMAGE, NR64, SYSCALL_HELPER, errname, gaps
from attack_helpers import box, fresh, host, host_unchanged, shared_session  # the fixtures
from conftest import STATE_DIR, start_kernel, wait_for
from test_containment import (SANDBOX_UID, cell, proc_state, run_ok, sandbox_pids, session_residue,
                              status_fields, stop_quietly)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="raw syscall numbers and the i386 trampoline are x86-64's")


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


# ================================================================ the watch itself

def test_host_watch_sees_what_an_escape_would_change(fresh, host):
    """HostWatch judges only what this suite's sessions could change; this case
    makes sure it still sees it. From the host, as an escaped sandbox would: a
    mount on the watch's own dir, a bind of the session's rootfs elsewhere, a
    cgroup made by a sandbox's host uid, a sandbox process moved out of its
    cgroup, a sentinel rewritten. Each must be reported; once undone, nothing."""
    km, kc, sid = fresh
    assert host.problems() == []
    with open(os.path.join(STATE_DIR, "sessions", sid, "bundle", "config.json")) as f:
        rootfs = json.load(f)["root"]["path"]
    kernel = max(sandbox_pids(sid, include_zombies=False))
    uid = int(status_fields(kernel)["Uid"][0])
    scratch = f"/run/cellblock-watch-{secrets.token_hex(4)}"
    on_watch_dir = os.path.join(host.dir, "mnt")
    cgroup = f"/sys/fs/cgroup/pids/cellblock-watch-{secrets.token_hex(4)}"
    with open(host.sentinels[0], "rb") as f:
        sentinel = f.read()
    os.makedirs(scratch)
    os.makedirs(on_watch_dir)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "watch", on_watch_dir], check=True)
        subprocess.run(["mount", "--bind", rootfs, scratch], check=True)
        os.mkdir(cgroup)
        os.chown(cgroup, uid, uid)
        with open("/sys/fs/cgroup/pids/cgroup.procs", "w") as f:
            f.write(str(kernel))
        with open(host.sentinels[0], "r+b") as f:
            f.write(b"escaped")
        seen = "\n".join(host.problems())
    finally:
        with open(host.sentinels[0], "wb") as f:
            f.write(sentinel)
        with open(f"/sys/fs/cgroup/pids/cellblock/cb-{sid}/cgroup.procs", "w") as f:
            f.write(str(kernel))
        os.rmdir(cgroup)
        subprocess.run(["umount", scratch])
        subprocess.run(["umount", on_watch_dir])
        os.rmdir(scratch)
        os.rmdir(on_watch_dir)
    for expected in (f"new host mount {on_watch_dir}", f"new host mount {scratch}",
                     f"binds {rootfs}", f"cgroup {cgroup}", f"process {kernel} of session {sid} left",
                     "pids:/", f"sentinel {host.sentinels[0]} changed"):
        assert expected in seen, f"HostWatch missed {expected!r}; it reported:\n{seen}"
    assert host.problems() == []
    assert run_ok(kc, cell("result = 6 * 7")) == 42
