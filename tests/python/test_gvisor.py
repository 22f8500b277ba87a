"""The gVisor tier: the core of the containment and conformance checks, on runsc.

Two ways in, as a user would take them:
- kernel mode through a second kernelspec (`cellblock-gvisor`, installed by
  this module into a temporary prefix) whose argv passes `--image host-gvisor`
  (images/host-gvisor/image.json: the host image with "runtime": "runsc");
- server mode, with `{"runtime": "runsc"}` in a session_create_request for the
  runc `host` image (a cold start, the pool holds runc sandboxes) and with
  `{"image": "host-gvisor"}`.

The host is checked directly: runsc's state files under STATE/runtime, the
session dir, mounts, cgroups, and the runsc-sandbox / runsc-gofer processes
of the session (gVisor's Sentry and gofer run on the host; the sandbox's own
processes do not appear there at all). Network traffic stays on 127.0.0.1.
"""
import errno
import glob
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest
from jupyter_client.manager import KernelManager

from conftest import STATE_DIR, run_cell, stream_text, wait_for
from server_helpers import (collect_execution, execute, server_factory,  # noqa: F401
                            session_of_process, shim_log)

CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
KERNEL_NAME = "cellblock-gvisor"
MEMORY_LIMIT_MB = 1024  # images/host-gvisor/image.json
RESULT_MARK = "@@result@@ "

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None,
                                reason="runsc (Debian package runsc) is not installed")


# ---------------------------------------------------------------- helpers

def value_of(iopub):
    results = [m["content"]["data"]["text/plain"] for m in iopub if m["msg_type"] == "execute_result"]
    assert len(results) == 1, [m["msg_type"] for m in iopub]
    return results[0]


def cell(body):
    return f"import json as _json\n{body}\nprint({RESULT_MARK!r} + _json.dumps(result))\n"


def run_ok(kc, code, timeout=120):
    reply, outputs = run_cell(kc, code, timeout=timeout)
    out = stream_text(outputs)
    assert reply["status"] == "ok", (reply, out, stream_text(outputs, "stderr"))
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the cell printed no result line: {out!r}"
    return json.loads(lines[-1][len(RESULT_MARK):])


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def runsc_processes(sid):
    """{pid: (argv0, state)} of the runsc-sandbox / runsc-gofer processes of session `sid`."""
    cid = f"cb-{sid}".encode()
    found = {}
    for path in glob.glob("/proc/[0-9]*"):
        pid = int(path.rsplit("/", 1)[1])
        argv = cmdline(pid)
        if not argv or not argv[0].startswith(b"runsc"):
            continue
        if any(cid in arg or f"/{sid}/".encode() in arg for arg in argv):
            st = proc_state(pid)
            found[pid] = (argv[0].decode(), st[0] if st else None)
    return found


def zombie_children(parent_pid):
    out = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if rest[0] == "Z" and int(rest[1]) == parent_pid:
            out.append(int(path.split("/")[2]))
    return out


def session_residue(state_dir, sid):
    """What of session `sid` (a runsc sandbox) the host still holds."""
    residue = {}
    state = glob.glob(os.path.join(state_dir, "runtime", f"cb-{sid}*"))
    if state:
        residue["runsc state"] = state
    session_dir = os.path.join(state_dir, "sessions", sid)
    if os.path.lexists(session_dir):
        residue["session dir"] = session_dir
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if sid in line.split()[4]]
    if mounts:
        residue["mounts"] = mounts
    cgroups = glob.glob(f"/sys/fs/cgroup/*/cellblock/cb-{sid}") + \
        glob.glob(f"/sys/fs/cgroup/cellblock/cb-{sid}")
    if cgroups:
        residue["cgroups"] = cgroups
    marker = f"/cellblock/cb-{sid}"
    in_cgroup = []
    for path in glob.glob("/proc/[0-9]*/cgroup"):
        try:
            with open(path) as f:
                if marker in f.read():
                    in_cgroup.append(int(path.split("/")[2]))
        except OSError:
            pass
    if in_cgroup:
        residue["processes in its cgroup"] = in_cgroup
    procs = runsc_processes(sid)
    if procs:
        residue["runsc processes"] = procs
    return residue


def assert_present(state_dir, sid):
    """The session really has what is checked for absence later."""
    r = session_residue(state_dir, sid)
    for kind in ("runsc state", "session dir", "mounts", "cgroups", "processes in its cgroup",
                 "runsc processes"):
        assert kind in r, f"session {sid} has no {kind} while open ({r})"
    kinds = sorted({argv0 for argv0, _ in r["runsc processes"].values()})
    assert kinds == ["runsc-gofer", "runsc-sandbox"], r["runsc processes"]
    with open(os.path.join(state_dir, "sessions", sid, "runtime")) as f:
        assert f.read().strip() == "runsc"
    return r


def assert_gone(state_dir, sid, timeout=20):
    wait_for(lambda: not session_residue(state_dir, sid), timeout=timeout, interval=0.2)
    left = session_residue(state_dir, sid)
    assert left == {}, f"session {sid} left on the host: {left}"


def session_id_of(km, timeout=10):
    return session_of_process(km.provisioner.process.pid, os.path.join(STATE_DIR, "sessions"),
                              timeout)


GVISOR_FACTS = cell("""
import os, platform
result = {'release': platform.release(), 'version': open('/proc/version').read().strip(),
          'init': open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode(),
          'uid': os.getuid(),
          'environ': sorted(k for k in os.environ if k.startswith('CELLBLOCK')),
          'lifeline_socket': os.path.exists('/run/cellblock/lifeline.sock')}
""")


def assert_on_gvisor(facts):
    # gVisor's Sentry answers uname itself; it is not the host's kernel.
    assert facts["release"] != os.uname().release, facts
    assert "gVisor" in facts["version"] or facts["release"] == "4.4.0", facts
    assert facts["init"] == "/opt/cellblock/cellblock-shim", facts
    assert facts["uid"] == 1000, facts
    # The lifeline socket was unlinked once the shim connected; its env var was stripped.
    assert facts["lifeline_socket"] is False, facts
    assert facts["environ"] == [], facts


# ---------------------------------------------------------------- kernel mode

@pytest.fixture(scope="module")
def gvisor_kernelspec():
    """A second kernelspec, cellblock-gvisor, passing --image host-gvisor, on JUPYTER_PATH."""
    prefix = tempfile.mkdtemp(prefix="cellblock-gvisor-spec-")
    subprocess.run([CELLBLOCK_BIN, "kernelspec", "install", "--prefix", prefix, "--name", KERNEL_NAME,
                    "--limit", "exec_timeout_s=600",  # cells of minutes under gVisor on a busy host
                    "--kernel-arg=--image", "--kernel-arg=host-gvisor"], check=True, timeout=30)
    with open(os.path.join(prefix, "share", "jupyter", "kernels", KERNEL_NAME, "kernel.json")) as f:
        spec = json.load(f)
    assert spec["argv"][-2:] == ["--image", "host-gvisor"], spec
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [os.path.join(prefix, "share", "jupyter")] + ([old] if old else []))
    yield KERNEL_NAME
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old
    shutil.rmtree(prefix, ignore_errors=True)


def start_gvisor_kernel(timeout=120):
    km = KernelManager(kernel_name=KERNEL_NAME)
    started = time.monotonic()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=timeout)
    return km, kc, time.monotonic() - started


def stop(km, kc):
    try:
        kc.stop_channels()
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=False)


@pytest.fixture(scope="module")
def box(gvisor_kernelspec):
    km, kc, ready_s = start_gvisor_kernel()
    sid = session_id_of(km)
    print(f"runsc kernel ready in {ready_s:.2f} s")
    yield {"km": km, "kc": kc, "sid": sid}
    stop(km, kc)


def test_kernelspec_session_runs_on_gvisor(box):
    present = assert_present(STATE_DIR, box["sid"])
    # The cellblock process of this kernel is the parent (subreaper) of both.
    parents = {int(proc_state(pid)[1]) for pid in present["runsc processes"]}
    assert parents == {box["km"].provisioner.process.pid}, present["runsc processes"]
    assert_on_gvisor(run_ok(box["kc"], GVISOR_FACTS))


def test_executes_and_keeps_state_across_cells(box):
    kc = box["kc"]
    reply, outputs = run_cell(kc, "1+1")
    assert reply["status"] == "ok", reply
    results = [m["content"]["data"]["text/plain"] for m in outputs if m["msg_type"] == "execute_result"]
    assert results == ["2"], outputs
    run_cell(kc, "gv_state = [n * n for n in range(10)]")
    reply, outputs = run_cell(kc, "print(sum(gv_state))")
    assert reply["status"] == "ok" and stream_text(outputs) == "285\n", (reply, outputs)
    reply, outputs = run_cell(kc, "1/0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError", reply
    assert [m["content"]["ename"] for m in outputs if m["msg_type"] == "error"] == ["ZeroDivisionError"]


def test_matplotlib_figure_is_a_png_display(box):
    reply, outputs = run_cell(box["kc"], """
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(2, 2))
ax.plot([0, 1, 2], [2, 0, 1])
plt.show()
""", timeout=120)
    assert reply["status"] == "ok", reply
    displays = [m["content"] for m in outputs if m["msg_type"] == "display_data"]
    assert len(displays) == 1, [m["msg_type"] for m in outputs]
    import base64
    png = base64.b64decode(displays[0]["data"]["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 500, png[:16]
    assert "text/plain" in displays[0]["data"]


def test_interrupt_reaches_the_kernel(box):
    """Under runsc the init pid is the Sentry: the interrupt travels on the lifeline."""
    km, kc = box["km"], box["kc"]
    msg_id = kc.execute("import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
                        "    print('interrupted')\n    raise\n")
    time.sleep(1.5)
    started = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=30)
    assert time.monotonic() - started < 10
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    reply, outputs = run_cell(kc, "1+1")  # the kernel survives it
    assert reply["status"] == "ok", reply


# (name, x86-64 number, arguments): refused by the bundle's seccomp profile,
# which runsc --oci-seccomp has the Sentry enforce (gVisor answers EPERM for
# every refusal: it ignores errnoRet).
DENIED_SYSCALLS = [
    ("ptrace(PTRACE_ATTACH, 1)", 101, (16, 1, 0, 0)),
    ("unshare(CLONE_NEWUSER)", 272, (0x10000000,)),  # gVisor would allow it without the profile
    ("mount(tmpfs)", 165, ("none", "/tmp", "tmpfs", 0, 0)),
    ("keyctl(GET_KEYRING_ID)", 250, (0, -3, 0)),
    ("bpf(MAP_CREATE)", 321, (0, 0, 0)),
    ("socket(AF_VSOCK)", 41, (40, 1, 0)),
    ("clone(CLONE_NEWUSER)", 56, (0x10000000 | 17, 0, 0, 0, 0)),
]


def test_dangerous_syscalls_are_refused(box):
    inside = run_ok(box["kc"], cell(f"""
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
result = {{}}
for name, nr, args in {DENIED_SYSCALLS!r}:
    cargs = [ctypes.c_char_p(a.encode()) if isinstance(a, str) else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *cargs)
    if rc == 0 and name.startswith('clone'):
        os._exit(0)  # the child, had it been allowed
    result[name] = 'succeeded' if rc >= 0 else ctypes.get_errno()
# What the profile must still let through: threads and fork.
t = threading.Thread(target=lambda: None); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
result['fork'] = os.waitpid(pid, 0)[1] >> 8
"""))
    assert inside.pop("fork") == 7, inside
    for name, outcome in inside.items():
        assert outcome in (errno.EPERM, errno.EACCES, errno.ENOSYS), f"{name}: {outcome}"


def test_host_shadow_is_unreadable(box):
    before = hashlib.sha256(open("/etc/shadow", "rb").read()).hexdigest()
    inside = run_ok(box["kc"], cell("""
result = {}
for path in ['/etc/shadow', '/etc/gshadow', '/proc/1/root/etc/shadow', '/usr/../etc/shadow']:
    try:
        result[path] = {'read': len(open(path, 'rb').read())}
    except OSError as e:
        result[path] = {'errno': e.errno}
    try:
        open(path, 'ab').write(b'x')
        result[path]['appended'] = True
    except OSError as e:
        pass
"""))
    for path, outcome in inside.items():
        assert "read" not in outcome and "appended" not in outcome, (path, outcome)
        assert outcome["errno"] in (errno.ENOENT, errno.EACCES, errno.EPERM), (path, outcome)
    assert hashlib.sha256(open("/etc/shadow", "rb").read()).hexdigest() == before


def test_root_usr_and_etc_refuse_writes(box):
    sentinel = f"cellblock-gvisor-{secrets.token_hex(6)}"
    inside = run_ok(box["kc"], cell(f"""
import os
result = {{}}
for d in ['/', '/usr', '/usr/lib', '/etc', '/opt/cellblock', '/data/input']:
    r = result[d] = {{}}
    path = os.path.join(d, {sentinel!r})
    try:
        open(path, 'x').write('escaped'); r['file'] = 'created'
    except OSError as e:
        r['file'] = e.errno
    try:
        os.mkdir(path + '.d'); r['mkdir'] = 'created'
    except OSError as e:
        r['mkdir'] = e.errno
for f in ['/etc/passwd', '/usr/bin/python3']:
    try:
        open(f, 'r+b', buffering=0).write(b'#'); result[f] = 'written'
    except OSError as e:
        result[f] = e.errno
"""))
    refused = (errno.EROFS, errno.EACCES, errno.EPERM)
    for where, r in inside.items():
        if isinstance(r, dict):
            assert r["file"] in refused and r["mkdir"] in refused, (where, r)
        else:
            assert r in refused, (where, r)
    for host_dir in ("/", "/usr", "/usr/lib", "/etc"):
        assert not [n for n in os.listdir(host_dir) if sentinel in n], host_dir


def test_network_is_loopback_only(box):
    inside = run_ok(box["kc"], cell("""
import os, socket
result = {'dev': sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]),
          'if_nameindex': [n for _, n in socket.if_nameindex()],
          'sys_class_net': sorted(os.listdir('/sys/class/net')),
          'routes': open('/proc/net/route').read().splitlines()[1:],
          'ipv6_route_devs': sorted({l.split()[-1] for l in open('/proc/net/ipv6_route') if l.strip()})}
"""))
    assert inside["dev"] == ["lo"], inside
    assert inside["if_nameindex"] == ["lo"], inside
    assert inside["sys_class_net"] == ["lo"], inside
    assert inside["routes"] == [], inside
    assert inside["ipv6_route_devs"] in ([], ["lo"]), inside


def test_host_loopback_listener_is_unreachable(box):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        inside = run_ok(box["kc"], cell(f"""
import socket
result = {{}}
for name, port in [('listener', {port}), ('cellblock_shell', {box['km'].shell_port})]:
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect(('127.0.0.1', port)); result[name] = 'connected'
    except OSError as e:
        result[name] = e.errno
    s.close()
"""))
        time.sleep(0.3)
        accepted = 0
        while True:
            try:
                listener.accept()[0].close()
                accepted += 1
            except BlockingIOError:
                break
    finally:
        listener.close()
    assert inside == {"listener": errno.ECONNREFUSED, "cellblock_shell": errno.ECONNREFUSED}, inside
    assert accepted == 0


MEMORY_BOMB = """
chunks = []
for i in range(64):                       # 64 x 64 MB = 4 GB, far past the limit
    chunks.append(b'\\x5a' * (64 << 20))
print('allocated', len(chunks) * 64, 'MB without being stopped')
"""


def test_memory_limit_holds(gvisor_kernelspec):
    """The host's memory cgroup holds gVisor's Sentry, which holds all the sandbox's memory."""
    km, kc, _ = start_gvisor_kernel()
    sid = session_id_of(km)
    try:
        limit_file = f"/sys/fs/cgroup/memory/cellblock/cb-{sid}/memory.limit_in_bytes"
        if not os.path.exists(limit_file):
            limit_file = f"/sys/fs/cgroup/cellblock/cb-{sid}/memory.max"
        with open(limit_file) as f:
            assert int(f.read()) == MEMORY_LIMIT_MB << 20
        started = time.monotonic()
        reply, outputs = run_cell(kc, MEMORY_BOMB, timeout=120)
        assert "without being stopped" not in stream_text(outputs)
        assert reply["status"] == "error", reply
        assert reply["ename"] == "MemoryLimitExceeded", reply
        assert f"{MEMORY_LIMIT_MB} MB" in reply["evalue"], reply
        assert time.monotonic() - started < 90
        proc = km.provisioner.process
        assert wait_for(lambda: proc.poll() is not None, timeout=20), "cellblock did not exit"
        assert_gone(STATE_DIR, sid)
    finally:
        try:
            stop(km, kc)
        except Exception:
            pass


def test_closing_leaves_nothing_on_the_host(gvisor_kernelspec):
    km, kc, _ = start_gvisor_kernel()
    sid = session_id_of(km)
    present = assert_present(STATE_DIR, sid)
    run_ok(kc, cell("""
import subprocess
# A process of its own that ignores SIGTERM, to prove the close kills it.
child = subprocess.Popen(['/bin/sh', '-c', 'trap "" TERM HUP INT; while :; do sleep 1; done'])
result = child.pid
"""))
    stop(km, kc)
    assert_gone(STATE_DIR, sid)
    for pid in present["runsc processes"]:
        st = proc_state(pid)
        assert st is None, f"runsc process {pid} is left: {st}"


# ---------------------------------------------------------------- server mode

def create(srv, content, timeout=120):
    reply = srv.call("session_create_request", content, timeout=timeout)["content"]
    if reply.get("status") == "ok":
        srv.session_ids.add(reply["session_id"])
    return reply


def test_server_session_on_runsc_by_request_and_by_image(server_factory):
    srv = server_factory(["--pool", "host=1"])
    assert wait_for(lambda: srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 1,
                    timeout=90)
    info = srv.ok("server_info_request", {})["content"]
    assert "host-gvisor" in info["images"], info["images"]

    # Refused before anything starts.
    bad = create(srv, {"runtime": "docker"})
    assert bad["status"] == "error" and bad["ename"] == "UnknownRuntime", bad
    bad = create(srv, {"runtime": 7})
    assert bad["status"] == "error" and bad["ename"] == "UnknownRuntime", bad
    if shutil.which("crun") is None:
        bad = create(srv, {"runtime": "crun"})
        assert bad["status"] == "error" and bad["ename"] == "UnknownRuntime", bad
        assert "not installed" in bad["evalue"], bad

    # The runc pool cannot serve a runsc request: a cold start on runsc.
    started = time.monotonic()
    by_request = create(srv, {"runtime": "runsc"})
    cold_s = time.monotonic() - started
    assert by_request["status"] == "ok", by_request
    assert by_request["warm"] is False and by_request["runtime"] == "runsc", by_request
    assert srv.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] == 1
    by_image = create(srv, {"image": "host-gvisor"})
    assert by_image["status"] == "ok" and by_image["runtime"] == "runsc", by_image
    runc_session = create(srv, {})
    assert runc_session["status"] == "ok" and runc_session["runtime"] == "runc", runc_session
    print(f"server-mode runsc cold start: {cold_s:.2f} s")

    present = {}
    for reply in (by_request, by_image):
        sid = reply["session_id"]
        present[sid] = assert_present(srv.state_dir, sid)
        kc = srv.connect(reply["connection"], ready_timeout=60)
        assert_on_gvisor(run_ok(kc, GVISOR_FACTS))
        msg_reply, iopub = execute(kc, "1+1")
        assert msg_reply["content"]["status"] == "ok" and value_of(iopub) == "2"
        execute(kc, "kept = 41")
        msg_reply, iopub = execute(kc, "kept + 1")
        assert value_of(iopub) == "42"
        # cellblock's execute-reply metadata is read from the runsc sandbox's cgroup too.
        assert msg_reply["metadata"]["cellblock"]["memory_peak_bytes"] > 0, msg_reply["metadata"]
    history = srv.ok("session_history_request", {"session_id": by_request["session_id"]})["content"]
    assert any(e["kind"] == "created" and e["detail"].endswith("on runsc") for e in history["events"]), \
        history["events"]

    for sid in present:
        srv.ok("session_close_request", {"session_id": sid})
    for sid in present:
        assert_gone(srv.state_dir, sid)
        for pid in present[sid]["runsc processes"]:
            assert proc_state(pid) is None, f"runsc process {pid} of {sid} is left: {proc_state(pid)}"
    # The server reaped the Sentry and the gofer of each (it is their subreaper).
    assert wait_for(lambda: not zombie_children(srv.proc.pid), timeout=10), zombie_children(srv.proc.pid)
    srv.ok("session_close_request", {"session_id": runc_session["session_id"]})


# ---------------------------------------------------------------- a crash of the server

# The kernel's attack on the adoption (as test_adoption.py's IMPOSTOR for
# runc): a listener of its own at the path the waiting shim connects to, and
# a caller that connects to the next server's listener there first, showing
# a key it guessed. Under runsc the server cannot tell the shim by its pid
# (the connection comes through the gofer), only by the key the first server
# gave it.
IMPOSTOR = r"""
import os, socket, threading, time
PATH = "/run/cellblock/lifeline.sock"
caught, posed = [], []
def listen():
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(PATH)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        caught.append(conn.recv(100))
        conn.close()
def connect():
    mine = os.stat(PATH).st_ino
    while True:
        try:
            if os.stat(PATH).st_ino != mine:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(PATH)
                c.sendall(b"adopt " + b"0" * 32 + b"\n")
                posed.append(c)
        except OSError:
            pass
        time.sleep(0.005)
threading.Thread(target=listen, daemon=True).start()
time.sleep(0.5)
threading.Thread(target=connect, daemon=True).start()
"""

# What became of each connection the impostor made: "foreign" (the test's
# listener answered), "closed" (accepted, then closed: refused), "reset" or
# "open" (never accepted). A dict of counts, as JSON.
CLASSIFY_POSED = r"""
import collections, json
outcomes = collections.Counter()
for c in posed:
    c.setblocking(False)
    try:
        got = c.recv(16)
        outcomes["foreign" if got.startswith(b"foreign") else "closed" if not got else "other"] += 1
    except ConnectionResetError:
        outcomes["reset"] += 1
    except BlockingIOError:
        outcomes["open"] += 1
json.dumps(outcomes)
"""


def test_a_killed_servers_gvisor_session_is_adopted_by_its_shims_key(server_factory, tmp_path):
    """kill -9 of the server: the runsc sandbox waits --adopt-grace for the
    next start, which takes it back with its variables; its shim refuses the
    kernel's listener and the server a connection without the shim's key.
    A second crash is adopted the same way; closing it leaves nothing."""
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "120",
                          "--pool", "host=0"])
    reply = create(srv, {"image": "host-gvisor"})
    assert reply["status"] == "ok" and reply["runtime"] == "runsc", reply
    sid = reply["session_id"]
    kc = srv.connect(reply["connection"], ready_timeout=60)
    assert execute(kc, IMPOSTOR + "\nkept = 41")[0]["content"]["status"] == "ok"
    present = assert_present(srv.state_dir, sid)
    sentry_and_gofer = sorted(present["runsc processes"])

    srv.kill9()
    assert wait_for(lambda: "waits 120000 ms" in shim_log(srv, sid), timeout=30), \
        shim_log(srv, sid)[-1000:]
    # The kernel's own listener is the first the waiting shim finds: refused.
    assert wait_for(lambda: "a lifeline socket the sandbox made was refused"
                    in shim_log(srv, sid), timeout=30), shim_log(srv, sid)[-1000:]
    assert sorted(runsc_processes(sid)) == sentry_and_gofer
    # A host listener that is neither the sandbox's nor the server's (say
    # another of the host's sockets linked there): the shim's key goes to
    # it, but it does not answer as the server, so the shim waits on.
    path = os.path.join(srv.state_dir, "sessions", sid, "ipc", "lifeline.sock")
    os.unlink(path)  # the kernel's listener
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.bind(path)
    os.chmod(path, 0o666)
    foreign.listen(64)
    held, stop = [], threading.Event()

    def hold():
        foreign.settimeout(0.1)
        while not stop.is_set():
            try:
                conn = foreign.accept()[0]
                conn.sendall(b"foreign\n")  # how the kernel's caller tells it from the server
                held.append(conn)
            except OSError:
                pass
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert wait_for(lambda: "did not answer as the server was refused" in shim_log(srv, sid),
                        timeout=30), shim_log(srv, sid)[-1000:]
        assert "adopted by a restarted server" not in shim_log(srv, sid)
    finally:
        stop.set()
        holder.join()
        for c in held:
            c.close()
        foreign.close()
        os.unlink(path)
    srv.start()
    log = srv.log()
    assert f"session {sid}: adopted" in log, log[-3000:]
    assert "adopted by a restarted server" in shim_log(srv, sid)
    msg_reply, iopub = execute(kc, "kept + 1")
    assert msg_reply["content"]["status"] == "ok" and value_of(iopub) == "42", msg_reply
    # Whatever the kernel's caller reached, the server did not take it: each
    # of its connections the server accepted (the peer closed it, neither
    # the test's listener nor one the server's listener closed on unaccepted)
    # is in the log as refused.
    msg_reply, iopub = execute(kc, CLASSIFY_POSED)
    outcomes = json.loads(value_of(iopub).strip("'"))
    print(f"the kernel's caller's connections: {outcomes}")
    if outcomes.get("closed"):
        assert "a connection refused (" in log, log[-3000:]
    assert sorted(runsc_processes(sid)) == sentry_and_gofer

    # A second crash: the adopting server recorded the key again.
    srv.kill9()
    srv.start()
    assert srv.log().count(f"session {sid}: adopted") == 2, srv.log()[-3000:]
    msg_reply, iopub = execute(kc, "kept * 2")
    assert value_of(iopub) == "82", msg_reply
    # Interrupts go over the adopted lifeline (the Sentry cannot be signalled for the kernel).
    msg_id = kc.execute("import time\nfor _ in range(600): time.sleep(0.1)")
    time.sleep(1)
    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    interrupted, _, _ = collect_execution(kc, msg_id, timeout=60)
    assert interrupted["content"].get("ename") == "KeyboardInterrupt", interrupted["content"]

    # A planned restart (SIGHUP) leaves it running too, where it used to hibernate.
    srv.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: srv.log().count(f"session {sid}: adopted") == 3, timeout=120), \
        srv.log()[-3000:]
    msg_reply, iopub = execute(kc, "kept - 1")
    assert value_of(iopub) == "40", msg_reply
    kinds = [e["kind"] for e in srv.ok("session_history_request",
                                       {"session_id": sid})["content"]["events"]]
    assert "handed_over" in kinds and "hibernated" not in kinds, kinds
    assert sorted(runsc_processes(sid)) == sentry_and_gofer

    srv.ok("session_close_request", {"session_id": sid}, timeout=60)
    assert_gone(srv.state_dir, sid)
    for pid in sentry_and_gofer:
        assert proc_state(pid) is None, f"runsc process {pid} is left: {proc_state(pid)}"


def test_a_gvisor_sandbox_no_server_adopts_ends_itself_after_its_grace(server_factory, tmp_path):
    srv = server_factory(["--key-file", str(tmp_path / "server.key"), "--adopt-grace", "2",
                          "--pool", "host=0"])
    reply = create(srv, {"image": "host-gvisor"})
    assert reply["status"] == "ok", reply
    sid = reply["session_id"]
    kc = srv.connect(reply["connection"], ready_timeout=60)
    assert execute(kc, "z = 1")[0]["content"]["status"] == "ok"
    assert_present(srv.state_dir, sid)
    srv.close_clients()
    srv.kill9()
    # Its shim ends it at the grace; the keeper reaps what is left on the host.
    assert_gone(srv.state_dir, sid, timeout=60)
    assert "no server adopted the sandbox within its grace" in shim_log(srv, sid) or \
        f"reaped the sandbox of session {sid}" in srv.log(), srv.log()[-3000:]
    srv.start()
    info = srv.ok("session_info_request", {"session_id": sid})["content"]
    assert info["state"] == "closed" and info["close_reason"] == "server_restart", info
