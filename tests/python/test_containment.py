"""Containment: what code in a cellblock sandbox cannot do, checked from the host.

Every case runs as a cell in a real sandboxed session (runc, ipykernel) and,
where the host can see the effect, the host is inspected directly: its files,
/proc, cgroups, a TCP listener of its own. Nothing here asks cellblock what it
did. Network traffic stays on this machine (127.0.0.1, ::1, abstract unix
sockets).
"""
import errno
import glob
import hashlib
import json
import os
import secrets
import socket
import time

import pytest

from conftest import STATE_DIR, run_cell, start_kernel, stop_kernel, stream_text, wait_for
from server_helpers import proc_state, session_of_process, session_pids

# The host image's limits (images/host/image.json) and the sandbox's id map
# (container 0 → its own leased host range, all above 1073741824; the sandbox
# user is 1000 inside).
MEMORY_LIMIT_MB = 1024
PIDS_LIMIT = 256
DISK_MB = 256
SHM_MB = 64
OUTPUT_MB = 256
IPC_MB = 4
HOST_ID_BASE = 1073741824
SANDBOX_UID = 1000

RESULT_MARK = "@@result@@ "


# ---------------------------------------------------------------- helpers

def cellblock_pid(km):
    return km.provisioner.process.pid


def session_id_of(km, timeout=10):
    """The session id of a kernel, from the lock file its cellblock process holds."""
    return session_of_process(cellblock_pid(km), os.path.join(STATE_DIR, "sessions"), timeout)


def sandbox_pids(sid, include_zombies=True):
    """Host pids of the processes in the session's cgroup, read from /proc on the host."""
    return session_pids(sid, include_zombies=include_zombies)


def host_uid_of_sandbox_user(pid):
    """The host uid that SANDBOX_UID inside maps to, for the sandbox process `pid`
    (from its /proc/<pid>/uid_map): the one place the tests derive a sandbox's host ids."""
    with open(f"/proc/{pid}/uid_map") as f:
        for line in f:
            inside, outside, count = (int(x) for x in line.split())
            if inside <= SANDBOX_UID < inside + count:
                return outside + SANDBOX_UID - inside
    raise AssertionError(f"process {pid} does not map the sandbox user {SANDBOX_UID}")


def status_fields(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return fields


def session_residue(sid):
    """What of session `sid` is left on the host, checked from the host."""
    residue = {}
    runtime_state = os.path.join(STATE_DIR, "runtime", f"cb-{sid}")
    if os.path.exists(runtime_state):
        residue["runc state"] = runtime_state
    session_dir = os.path.join(STATE_DIR, "sessions", sid)
    if os.path.exists(session_dir):
        residue["session dir"] = session_dir
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if session_dir in line.split()[4]]
    if mounts:
        residue["mounts"] = mounts
    cgroups = glob.glob(f"/sys/fs/cgroup/*/cellblock/cb-{sid}") + \
        glob.glob(f"/sys/fs/cgroup/cellblock/cb-{sid}")
    if cgroups:
        residue["cgroups"] = cgroups
    pids = sandbox_pids(sid)
    if pids:
        residue["processes"] = {pid: proc_state(pid) for pid in pids}
    return residue


def run_ok(kc, code, timeout=120):
    """Runs a cell that must succeed; returns the JSON it printed after RESULT_MARK."""
    reply, outputs = run_cell(kc, code, timeout=timeout)
    out = stream_text(outputs)
    assert reply["status"] == "ok", (reply, out, stream_text(outputs, "stderr"))
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the cell printed no result line: {out!r}"
    return json.loads(lines[-1][len(RESULT_MARK):])


def cell(body):
    """Wraps a cell body so that its `result` is printed as one JSON line."""
    return f"import json as _json\n{body}\nprint({RESULT_MARK!r} + _json.dumps(result))\n"


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stop_quietly(km, kc):
    try:
        stop_kernel(km, kc)
    except Exception:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


# ---------------------------------------------------------------- fixtures

CANARY_NAMES = ("CELLBLOCK_TEST_CANARY", "SERVER_TEST_CANARY")


@pytest.fixture(scope="module")
def box():
    """One sandboxed session shared by the read-only cases, with canaries in the server's env."""
    canaries = {name: f"canary-{secrets.token_hex(12)}" for name in CANARY_NAMES}
    km, kc = start_kernel(extra_env=canaries)
    sid = session_id_of(km)
    yield {"km": km, "kc": kc, "sid": sid, "canaries": canaries}
    stop_quietly(km, kc)
    assert wait_for(lambda: not session_residue(sid), timeout=10), session_residue(sid)


@pytest.fixture
def fresh():
    """A session of its own, for cases that wreck or end it."""
    km, kc = start_kernel()
    sid = session_id_of(km)
    yield km, kc, sid
    stop_quietly(km, kc)


# ---------------------------------------------------------------- identity

def test_runs_as_unprivileged_user_inside_and_outside(box):
    inside = run_ok(box["kc"], cell("""
import os
status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
result = {'uid': os.getuid(), 'euid': os.geteuid(), 'gid': os.getgid(),
          'groups': os.getgroups(),
          'cap_eff': status['CapEff'].strip(), 'cap_prm': status['CapPrm'].strip(),
          'cap_bnd': status['CapBnd'].strip(), 'no_new_privs': status['NoNewPrivs'].strip(),
          'seccomp': status['Seccomp'].strip()}
"""))
    assert inside["uid"] == inside["euid"] == inside["gid"] == SANDBOX_UID, inside
    assert inside["cap_eff"] == inside["cap_prm"] == inside["cap_bnd"] == "0" * 16, inside
    assert inside["no_new_privs"] == "1", inside
    assert inside["seccomp"] == "2", inside  # a seccomp filter is installed

    pids = sandbox_pids(box["sid"], include_zombies=False)
    assert len(pids) >= 2, f"expected the shim and the kernel in the session's cgroup, saw {pids}"
    # Each sandbox leases its own host range above HOST_ID_BASE: read its user's host id.
    host_id = int(status_fields(pids[0])["Uid"][0])
    assert host_id >= HOST_ID_BASE + SANDBOX_UID, host_id
    for pid in pids:
        st = status_fields(pid)
        uids = [int(x) for x in st["Uid"]]
        gids = [int(x) for x in st["Gid"]]
        assert uids == [host_id] * 4, (pid, st["Uid"])
        assert gids == [host_id] * 4, (pid, st["Gid"])
        assert st["CapEff"] == ["0" * 16], (pid, st["CapEff"])
        with open(f"/proc/{pid}/uid_map") as f:
            uid_map = f.read().split()
        # container 0 starts at the high base: no id inside maps to a low host id
        assert uid_map[0] == "0" and int(uid_map[1]) == host_id - SANDBOX_UID, (pid, uid_map)


def test_sees_only_its_own_processes_and_devices(box):
    inside = run_ok(box["kc"], cell("""
import os
procs = {}
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            procs[p] = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[0].decode()
        except OSError:
            pass
result = {'procs': procs, 'dev': sorted(os.listdir('/dev'))}
try:
    os.mknod('/tmp/sda', 0o600 | 0o060000, os.makedev(8, 0))
    result['mknod'] = 'created'
except OSError as e:
    result['mknod'] = e.errno
"""))
    procs = inside["procs"]
    assert procs.get("1") == "/opt/cellblock/cellblock-shim", procs
    assert len(procs) <= 4, f"the sandbox sees processes that are not its own: {procs}"
    host_pids = set(sandbox_pids(box["sid"], include_zombies=False))
    assert len(procs) == len(host_pids), (procs, host_pids)
    # Nothing but the usual character devices: no disk, no /dev/mem, no kmsg.
    assert set(inside["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "pts",
                                  "shm", "mqueue", "ptmx", "fd", "stdin", "stdout", "stderr",
                                  "core", "console"}, inside["dev"]
    assert inside["mknod"] in (errno.EPERM, errno.EACCES), inside


# (name, x86-64 number, arguments) of calls a sandboxed process must not make.
DENIED_SYSCALLS = [
    ("ptrace(PTRACE_ATTACH, 1)", 101, (16, 1, 0, 0)),
    ("unshare(CLONE_NEWUSER)", 272, (0x10000000,)),
    ("unshare(CLONE_NEWNET)", 272, (0x40000000,)),
    ("mount(tmpfs)", 165, ("none", "/tmp", "tmpfs", 0, 0)),
    ("setns(0, 0)", 308, (0, 0)),
    ("keyctl(GET_KEYRING_ID)", 250, (0, -3, 0)),
    ("bpf(MAP_CREATE)", 321, (0, 0, 0)),
    ("perf_event_open", 298, (0, 0, -1, -1, 0)),
    ("io_uring_setup", 425, (1, 0)),
    ("process_vm_readv", 310, (1, 0, 0, 0, 0, 0)),
    ("socket(AF_VSOCK)", 41, (40, 1, 0)),
    ("socket(AF_PACKET)", 41, (17, 3, 0)),
    ("chroot(/tmp)", 161, ("/tmp",)),
]


def test_dangerous_syscalls_are_denied(box):
    inside = run_ok(box["kc"], cell(f"""
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
result = {{'machine': platform.machine()}}
for name, nr, args in {DENIED_SYSCALLS!r}:
    cargs = [ctypes.c_char_p(a.encode()) if isinstance(a, str) else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *cargs)
    result[name] = 'succeeded' if rc >= 0 else ctypes.get_errno()
"""))
    if inside.pop("machine") != "x86_64":
        pytest.skip("syscall numbers here are x86-64's")
    for name, outcome in inside.items():
        assert outcome in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EAFNOSUPPORT), \
            f"{name}: {outcome} (expected it to be refused)"


# ---------------------------------------------------------------- files

def test_host_shadow_is_unreadable_and_untouched(box):
    assert os.path.exists("/etc/shadow"), "the host has no /etc/shadow: the case proves nothing"
    before = (file_digest("/etc/shadow"), os.stat("/etc/shadow").st_mtime_ns)
    inside = run_ok(box["kc"], cell("""
result = {}
for path in ['/etc/shadow', '/etc/gshadow', '/proc/1/root/etc/shadow',
             '/proc/self/root/etc/shadow', '/usr/../etc/shadow']:
    try:
        with open(path, 'rb') as f:
            result[path] = {'read': len(f.read())}
    except OSError as e:
        result[path] = {'errno': e.errno}
    try:
        with open(path, 'ab') as f:
            f.write(b'sandbox:x:0:0::/:/bin/sh\\n')
        result[path]['appended'] = True
    except OSError as e:
        result[path]['append_errno'] = e.errno
"""))
    for path, outcome in inside.items():
        assert "read" not in outcome, f"{path} was readable in the sandbox: {outcome}"
        assert outcome["errno"] in (errno.ENOENT, errno.EACCES, errno.EPERM), (path, outcome)
        assert "appended" not in outcome, f"{path} was writable in the sandbox: {outcome}"
    after = (file_digest("/etc/shadow"), os.stat("/etc/shadow").st_mtime_ns)
    assert after == before, "the host's /etc/shadow changed"


# Directories that exist in the sandbox and must refuse writes.
READ_ONLY_DIRS = ["/", "/usr", "/usr/lib", "/usr/bin", "/etc", "/etc/alternatives",
                  "/etc/python3.11", "/opt/cellblock", "/data/input", "/usr/local"]
# Existing files that must refuse being opened for writing.
READ_ONLY_FILES = ["/etc/passwd", "/etc/hosts", "/usr/bin/python3", "/etc/ld.so.cache",
                   "/opt/cellblock/cellblock-shim", "/proc/sys/kernel/hostname",
                   "/sys/kernel/mm/transparent_hugepage/enabled"]


def host_paths_of(sid, sandbox_dir):
    """Where a sandbox directory lives on the host, from the session's OCI bundle.

    The rootfs path is always included (it is the mount point); a bind mount
    adds its host source. tmpfs and kernel filesystems have no host files.
    """
    bundle = os.path.join(STATE_DIR, "sessions", sid, "bundle")
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    root = config["root"]["path"]
    if not os.path.isabs(root):
        root = os.path.join(bundle, root)
    paths = [os.path.normpath(root + "/" + sandbox_dir)]
    best = None
    for mount in config["mounts"]:
        dest = mount["destination"].rstrip("/") or "/"
        if sandbox_dir == dest or sandbox_dir.startswith(dest + "/"):
            if best is None or len(dest) > len(best["destination"]):
                best = dict(mount, destination=dest)
    if best is not None and best["type"] == "bind":
        paths.append(os.path.normpath(best["source"] + "/" + sandbox_dir[len(best["destination"]):]))
    elif best is not None:
        paths = []  # a tmpfs or kernel fs over it: nothing of it is on the host's disk
    return [p for p in paths if os.path.isdir(p)]


def test_read_only_dirs_refuse_writes(box):
    sid = box["sid"]
    sentinel = f"cellblock-sentinel-{secrets.token_hex(8)}"
    inside = run_ok(box["kc"], cell(f"""
import os
sentinel = {sentinel!r}
result = {{}}
for d in {READ_ONLY_DIRS!r}:
    r = result[d] = {{'isdir': os.path.isdir(d)}}
    path = os.path.join(d, sentinel)
    try:
        with open(path, 'x') as f:
            f.write('escaped')
        r['file'] = 'created'
    except OSError as e:
        r['file'] = e.errno
    try:
        os.mkdir(path + '.d')
        r['mkdir'] = 'created'
    except OSError as e:
        r['mkdir'] = e.errno
    try:
        os.symlink('/tmp', path + '.l')
        r['symlink'] = 'created'
    except OSError as e:
        r['symlink'] = e.errno
    r['visible'] = sorted(n for n in os.listdir(d) if sentinel in n) if r['isdir'] else []
for path in {READ_ONLY_FILES!r}:
    r = result[path] = {{'exists': os.path.exists(path)}}
    try:
        with open(path, 'r+b', buffering=0) as f:
            f.write(b'#')
        r['write'] = 'written'
    except OSError as e:
        r['write'] = e.errno
"""))
    refused = (errno.EROFS, errno.EACCES, errno.EPERM)
    for path in READ_ONLY_FILES:
        r = inside.pop(path)
        assert r["exists"], f"{path} does not exist in the sandbox: the case proves nothing"
        assert r["write"] in refused, f"write to {path}: {r['write']} (expected EROFS/EACCES/EPERM)"
    for d, r in inside.items():
        assert r["isdir"], f"{d} does not exist in the sandbox: the case proves nothing"
        for op in ("file", "mkdir", "symlink"):
            assert r[op] in refused, f"{op} in {d}: {r[op]} (expected EROFS/EACCES/EPERM)"
        assert r["visible"] == [], (d, r)

    host_dirs = {d: host_paths_of(sid, d) for d in READ_ONLY_DIRS}
    for d in ("/", "/usr", "/etc", "/opt/cellblock", "/data/input"):
        assert host_dirs[d], f"no host path found for the sandbox's {d}: the check proves nothing"
    for host_dir in sorted({p for paths in host_dirs.values() for p in paths} | {"/", "/usr", "/etc"}):
        leaked = [n for n in os.listdir(host_dir) if sentinel in n]
        assert leaked == [], f"sentinel files appeared on the host in {host_dir}: {leaked}"
    # The host's /tmp is not the sandbox's /tmp either.
    assert not glob.glob(f"/tmp/*{sentinel}*")


@pytest.mark.parametrize("where,cap_mb", [("/tmp", DISK_MB),
                                          ("/home/sandbox", DISK_MB),
                                          ("/dev/shm", SHM_MB),
                                          ("/data/output", OUTPUT_MB),
                                          ("/run/cellblock", IPC_MB)])
def test_writable_tmpfs_is_capped(box, where, cap_mb):
    inside = run_ok(box["kc"], cell(f"""
import os
st = os.statvfs({where!r})
size_mb = st.f_blocks * st.f_frsize / 2**20
path = os.path.join({where!r}, 'fill-' + os.urandom(4).hex())
chunk = b'\\xa5' * (min(16, {cap_mb} // 4) << 20)
written, err = 0, None
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
try:
    while written < (2 * {cap_mb} + 64) << 20:
        try:
            n = os.write(fd, chunk)
        except OSError as e:
            err = e.errno
            break
        written += n
        if n < len(chunk):  # a short write means the fs is full; the next one fails
            continue
finally:
    os.close(fd)
    os.unlink(path)
result = {{'size_mb': size_mb, 'written_mb': written / 2**20, 'errno': err,
           'free_after_mb': os.statvfs({where!r}).f_bfree * st.f_frsize / 2**20}}
"""), timeout=120)
    assert inside["errno"] == errno.ENOSPC, inside
    assert abs(inside["size_mb"] - cap_mb) <= 1, inside
    slack = min(16, cap_mb // 4)
    assert cap_mb - slack <= inside["written_mb"] <= cap_mb, inside
    assert inside["free_after_mb"] >= cap_mb - slack, "space was not given back after unlink"
    # The session survived the full disk.
    assert run_ok(box["kc"], cell("result = 1 + 1")) == 2


# ---------------------------------------------------------------- network

def _host_listener(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(address)
    s.listen(16)
    s.setblocking(False)
    return s


def _accepted(listener):
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_network_has_only_loopback(box):
    inside = run_ok(box["kc"], cell("""
import os, socket
dev = open('/proc/net/dev').read().splitlines()[2:]
route = open('/proc/net/route').read().splitlines()
ipv6 = [l.split() for l in open('/proc/net/ipv6_route').read().splitlines() if l.strip()]
result = {'dev': sorted(l.split(':')[0].strip() for l in dev),
          'if_nameindex': [name for _, name in socket.if_nameindex()],
          'sys_class_net': sorted(os.listdir('/sys/class/net')),
          'route_entries': route[1:],
          'ipv6_route_devs': sorted({l[-1] for l in ipv6}),
          'resolv_conf': os.path.exists('/etc/resolv.conf'),
          'hostname': socket.gethostname()}
"""))
    assert inside["dev"] == ["lo"], inside
    assert inside["if_nameindex"] == ["lo"], inside
    assert inside["sys_class_net"] == ["lo"], inside
    assert inside["route_entries"] == [], inside
    assert inside["ipv6_route_devs"] in ([], ["lo"]), inside
    assert inside["resolv_conf"] is False, inside
    assert inside["hostname"] == "sandbox", inside


def test_cannot_reach_host_loopback_listeners(box):
    km = box["km"]
    listeners = {"tcp4": _host_listener(socket.AF_INET, ("127.0.0.1", 0))}
    try:
        listeners["tcp6"] = _host_listener(socket.AF_INET6, ("::1", 0))
    except OSError:
        pass  # no IPv6 on the host's lo
    abstract = f"\0cellblock-test-{secrets.token_hex(8)}"
    listeners["abstract"] = _host_listener(socket.AF_UNIX, abstract)
    targets = {name: list(s.getsockname())[:2] for name, s in listeners.items() if name != "abstract"}
    # The client side of this very session listens on the host's 127.0.0.1 too.
    targets["cellblock_shell"] = ["127.0.0.1", km.shell_port]
    try:
        inside = run_ok(box["kc"], cell(f"""
import socket
result = {{}}
for name, (host, port) in {targets!r}.items():
    fam = socket.AF_INET6 if ':' in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host, port))
        result[name] = 'connected'
    except OSError as e:
        result[name] = e.errno if e.errno is not None else repr(e)
    finally:
        s.close()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({abstract!r})
    result['abstract'] = 'connected'
except OSError as e:
    result['abstract'] = e.errno
"""), timeout=60)
        time.sleep(0.3)
        accepted = {name: _accepted(s) for name, s in listeners.items()}
    finally:
        for s in listeners.values():
            s.close()
    assert set(inside) == set(targets) | {"abstract"}, inside
    for name, outcome in inside.items():
        assert outcome == errno.ECONNREFUSED, f"{name}: {outcome} (expected ECONNREFUSED)"
    assert accepted == {name: 0 for name in listeners}, accepted


def test_sessions_cannot_see_or_reach_each_other(box, fresh):
    kc_a = box["kc"]
    _, kc_b, sid_b = fresh
    tag = f"xs-{secrets.token_hex(6)}"
    a = run_ok(kc_a, cell(f"""
import os, socket
for d in ['/tmp', '/dev/shm', os.path.expanduser('~'), '/data/output', '/run/cellblock']:
    open(os.path.join(d, {tag!r}), 'w').write('session A')
xs_tcp = socket.socket(); xs_tcp.bind(('127.0.0.1', 0)); xs_tcp.listen(4); xs_tcp.setblocking(False)
xs_unix = socket.socket(socket.AF_UNIX); xs_unix.bind('\\0' + {tag!r}); xs_unix.listen(4)
xs_unix.setblocking(False)
result = {{'port': xs_tcp.getsockname()[1]}}
"""))
    b = run_ok(kc_b, cell(f"""
import os, socket
result = {{'files': [d for d in ['/tmp', '/dev/shm', os.path.expanduser('~'), '/data/output',
                                 '/run/cellblock'] if os.path.exists(os.path.join(d, {tag!r}))]}}
procs = [p for p in os.listdir('/proc') if p.isdigit()]
result['procs'] = len(procs)
s = socket.socket(); s.settimeout(3)
try:
    s.connect(('127.0.0.1', {{a_port}})); result['tcp'] = 'connected'
except OSError as e:
    result['tcp'] = e.errno
s = socket.socket(socket.AF_UNIX)
try:
    s.connect('\\0' + {tag!r}); result['unix'] = 'connected'
except OSError as e:
    result['unix'] = e.errno
""").replace("{a_port}", str(a["port"])))
    accepted = run_ok(kc_a, cell("""
result = 0
for s in (xs_tcp, xs_unix):
    try:
        while True:
            s.accept()[0].close(); result += 1
    except BlockingIOError:
        pass
    s.close()
"""))
    assert b["files"] == [], f"session B sees session A's files in {b['files']}"
    assert b["procs"] <= 4, b
    assert b["tcp"] == errno.ECONNREFUSED, b
    assert b["unix"] == errno.ECONNREFUSED, b
    assert accepted == 0, "session A's listeners accepted connections"


# ---------------------------------------------------------------- environment

def test_server_environment_does_not_leak(box):
    km, sid, canaries = box["km"], box["sid"], box["canaries"]
    # The canaries really are in the server's environment.
    with open(f"/proc/{cellblock_pid(km)}/environ", "rb") as f:
        server_env = f.read()
    for value in canaries.values():
        assert value.encode() in server_env, "the canary never reached the server"
    outer_key = km.session.key.decode()
    assert outer_key

    secrets_ = sorted(canaries.values()) + [outer_key]
    # Sent reversed, so that the cell's own source (kept in IPython's history
    # in the sandbox's home) does not hold the very strings searched for.
    reversed_ = [value[::-1] for value in secrets_]
    inside = run_ok(box["kc"], cell(f"""
import os
needles = [n[::-1].encode() for n in {reversed_!r}]
names = {list(CANARY_NAMES)!r}
found, read_ok = [], {{}}
for p in sorted(os.listdir('/proc')):
    if not p.isdigit():
        continue
    for what in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{{p}}/{{what}}', 'rb').read()
        except OSError as e:
            read_ok[f'{{p}}/{{what}}'] = e.errno
            continue
        read_ok[f'{{p}}/{{what}}'] = len(data)
        found += [f'{{p}}/{{what}}: {{i}}' for i, n in enumerate(needles) if n in data]
# The files a kernel can see of its own connection.
for d in ['/run/cellblock', os.path.expanduser('~')]:
    for dirpath, _, files in os.walk(d):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                data = open(path, 'rb').read(1 << 20)
            except OSError:
                continue
            found += [f'{{path}}: {{i}}' for i, n in enumerate(needles) if n in data]
result = {{'found': found, 'read': read_ok,
           'environ_names': [k for k in os.environ if k in names or k.startswith('CELLBLOCK')],
           'environ_values': [k for k, v in os.environ.items() if any(n.decode() in v for n in needles)],
           'kernel_pid': os.getpid()}}
"""))
    assert inside["found"] == [], f"server secrets visible in the sandbox: {inside['found']}"
    assert inside["environ_names"] == [] and inside["environ_values"] == [], inside
    # The scan read the environment of PID 1 (the shim) and of the kernel itself.
    read = inside["read"]
    for pid in (1, inside["kernel_pid"]):
        for what in ("environ", "cmdline"):
            assert isinstance(read.get(f"{pid}/{what}"), int) and read[f"{pid}/{what}"] > 0, \
                (pid, what, read.get(f"{pid}/{what}"))
    # From the host too: no process of the sandbox carries a canary.
    for pid in sandbox_pids(sid, include_zombies=False):
        for what in ("environ", "cmdline"):
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
            for value in secrets_:
                assert value.encode() not in data, f"host pid {pid} {what} holds a server secret"


# ---------------------------------------------------------------- resource limits

MEMORY_BOMB = """
chunks = []
for i in range(64):                       # 64 × 64 MB = 4 GB, far past the limit
    chunks.append(b'\\x5a' * (64 << 20))  # bytes * n writes every page
print('allocated', len(chunks) * 64, 'MB without being stopped')
"""


def test_memory_bomb_is_stopped_with_a_clear_error(fresh):
    km, kc, sid = fresh
    limit_files = glob.glob(f"/sys/fs/cgroup/memory/cellblock/cb-{sid}/memory.limit_in_bytes") + \
        glob.glob(f"/sys/fs/cgroup/cellblock/cb-{sid}/memory.max")
    assert limit_files, f"no memory cgroup for session {sid}"
    with open(limit_files[0]) as f:
        assert int(f.read()) == MEMORY_LIMIT_MB << 20
    started = time.monotonic()
    reply, outputs = run_cell(kc, MEMORY_BOMB, timeout=120)
    elapsed = time.monotonic() - started
    out = stream_text(outputs)
    assert "without being stopped" not in out, out
    assert reply["status"] == "error", reply
    assert reply["ename"] == "MemoryLimitExceeded", reply
    assert f"{MEMORY_LIMIT_MB} MB" in reply["evalue"], reply
    errors = [m["content"] for m in outputs if m["msg_type"] == "error"]
    assert [e["ename"] for e in errors] == ["MemoryLimitExceeded"], errors
    assert elapsed < 60, f"the memory bomb took {elapsed:.0f} s to be stopped"
    # The session ended with the kernel: the server exits and leaves nothing behind.
    proc = km.provisioner.process
    assert wait_for(lambda: proc.poll() is not None, timeout=15), "cellblock did not exit"
    assert wait_for(lambda: not session_residue(sid), timeout=10), session_residue(sid)


FORK_BOMB = """
import errno, os
children, err = [], None
for i in range(4 * {limit}):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        try:
            os.execv('/usr/bin/sleep', ['sleep', '300'])
        finally:
            os._exit(0)
    children.append(pid)
result = {{'forked': len(children), 'errno': err, 'children': children}}
"""

REAP_CHILDREN = """
import os, signal
killed = 0
for pid in {children!r}:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    killed += 1
import subprocess
result = {{'killed': killed, 'true': subprocess.run(['/usr/bin/true']).returncode}}
"""


def test_fork_bomb_is_stopped_by_pids_limit(fresh):
    km, kc, sid = fresh
    pids_cgroup = f"/sys/fs/cgroup/pids/cellblock/cb-{sid}"
    if not os.path.isdir(pids_cgroup):
        pids_cgroup = f"/sys/fs/cgroup/cellblock/cb-{sid}"
    with open(os.path.join(pids_cgroup, "pids.max")) as f:
        assert f.read().strip() == str(PIDS_LIMIT)

    bomb = run_ok(kc, cell(FORK_BOMB.format(limit=PIDS_LIMIT)), timeout=120)
    try:
        assert bomb["errno"] == errno.EAGAIN, bomb
        assert 100 < bomb["forked"] < PIDS_LIMIT, bomb
        # From the host, while the children are alive: the cgroup is at its cap.
        with open(os.path.join(pids_cgroup, "pids.current")) as f:
            current = int(f.read())
        assert current <= PIDS_LIMIT, current
        assert len(sandbox_pids(sid)) <= PIDS_LIMIT
        with open(os.path.join(pids_cgroup, "pids.events")) as f:
            events = dict(line.split() for line in f)
        assert int(events["max"]) >= 1, events
    finally:
        reaped = run_ok(kc, cell(REAP_CHILDREN.format(children=bomb["children"])), timeout=120)
    assert reaped == {"killed": bomb["forked"], "true": 0}, reaped
    # The kernel stays usable, and its host-side process count is back to normal.
    assert run_ok(kc, cell("result = 1 + 1")) == 2
    assert len(sandbox_pids(sid, include_zombies=False)) < 10


DAEMON = r"""
import os, sys, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.setsid()
    grandchild = os.fork()
    if grandchild == 0:
        os.close(r)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        code = '''
import os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
path = sys.argv[1]
while True:
    with open(path + '.tmp', 'w') as f:
        f.write(str(time.time()))
    os.replace(path + '.tmp', path)
    time.sleep(0.1)
'''
        os.execv(sys.executable, [sys.executable, '-c', code, '/tmp/heartbeat-{tag}'])
    os._exit(0)
os.close(w)
os.waitpid(child, 0)
pid = int(os.read(r, 64))
os.close(r)
for _ in range(100):
    if os.path.exists('/tmp/heartbeat-{tag}'):
        break
    time.sleep(0.05)
result = {{'pid': pid, 'ppid': int(open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()[1]),
           'beating': os.path.exists('/tmp/heartbeat-{tag}')}}
"""


def _host_pid_of(sid, ns_pid):
    for pid in sandbox_pids(sid, include_zombies=False):
        nspid = status_fields(pid).get("NSpid", [])
        if nspid and int(nspid[-1]) == ns_pid:
            return pid
    return None


def _heartbeat(host_pid, tag):
    try:
        with open(f"/proc/{host_pid}/root/tmp/heartbeat-{tag}") as f:
            return float(f.read() or 0)
    except (OSError, ValueError):
        return None


def test_double_forked_daemon_dies_with_the_session(fresh):
    km, kc, sid = fresh
    tag = secrets.token_hex(6)
    daemon = run_ok(kc, cell(DAEMON.format(tag=tag)))
    assert daemon["beating"], daemon
    assert daemon["ppid"] == 1, f"the daemon was not re-parented to the sandbox's init: {daemon}"
    host_pid = _host_pid_of(sid, daemon["pid"])
    assert host_pid, f"daemon (sandbox pid {daemon['pid']}) not found in cgroup of {sid}"
    with open(f"/proc/{host_pid}/cmdline", "rb") as f:
        assert f"heartbeat-{tag}".encode() in f.read()
    first = _heartbeat(host_pid, tag)
    assert first is not None
    assert wait_for(lambda: (_heartbeat(host_pid, tag) or 0) > first, timeout=5), \
        "the daemon's heartbeat is not advancing"
    with open(f"/proc/{host_pid}/stat") as f:  # its start time tells pid reuse apart
        start_ticks = f.read().rsplit(")", 1)[1].split()[19]

    kc.stop_channels()
    km.shutdown_kernel(now=False)

    def daemon_alive():
        try:
            with open(f"/proc/{host_pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return False
        return rest[19] == start_ticks and rest[0] != "Z"

    assert not daemon_alive(), "the daemon outlived the session's shutdown"
    assert wait_for(lambda: not session_residue(sid), timeout=10), session_residue(sid)
