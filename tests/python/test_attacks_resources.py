"""The attack suite, resources and signals: thread bombs, a million open files,
processes that ignore or block signals, kill(-1), and a gigabyte of stdout in
kernel mode.

HostWatch (attack_helpers.py) judges the host after every case: only what this
suite's own sessions could have changed, so that a busy shared host gives the
same verdict. A case that finds a gap FAILS and says what got through: the fix
belongs in the C++ code, never in a weaker assertion here. Traffic only ever
goes to 127.0.0.0/8, ::1 or unix sockets.
"""
import errno
import glob
import os
import platform
import secrets
import subprocess
import time

import pytest

from attack_helpers import FLOOD
from attack_helpers import box, fresh, host, host_unchanged, shared_session  # the fixtures
from conftest import KernelDied, run_cell, stream_text, wait_for
from test_containment import (PIDS_LIMIT, cell, cellblock_pid, proc_state, run_ok, sandbox_pids,
                              session_residue)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="raw syscall numbers and the i386 trampoline are x86-64's")


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


def test_a_wait_on_a_dead_kernel_fails_at_once_with_its_log(fresh):
    """A kernel killed by SIGSEGV (as an `int 0x80` on a kernel without IA32
    emulation does) takes its kernel-mode cellblock process down. The test that
    waits on it next must fail with KernelDied, the process's exit status and
    its log, not sit until its own timeout; and the process is reaped."""
    km, kc, sid = fresh
    reply, _ = run_cell(kc, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", timeout=60)
    assert reply["status"] == "error" and reply["ename"] == "KernelDied", reply
    assert "signal 11" in reply["evalue"], reply
    pid = km.provisioner.process.pid
    with pytest.raises(KernelDied) as died:
        run_cell(kc, "1 + 1", timeout=600)   # ctest's budget for the whole file
    assert f"process {pid} exited with 1" in str(died.value), died.value
    assert sid in str(died.value), f"the kernel's log is not in the message: {died.value}"
    assert proc_state(pid) is None, f"the kernel-mode cellblock process is left {proc_state(pid)}"


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
             "output is dropped]\n"
    assert text.count("[cellblock: output truncated") == 1 and text.endswith(marker), text[-300:]
    assert len(text) - len(marker) == 1 << 20, len(text)
    budget = reply["metadata"]["cellblock"]
    # stderr's "flood done\n" shares the execution's budget: it is dropped too.
    # The server counts what reaches it: when it is slower than the flood (under
    # ASan), the kernel's iopub PUB socket drops messages at its high-water mark
    # before the server sees them, so the count may be lower, never higher.
    produced = (1 << 30) + len("flood done\n") - (1 << 20)
    assert budget["output_truncated"], budget
    assert 0 < budget["output_dropped_bytes"] <= produced, (budget, produced)
    server = cellblock_pid(km)
    with open(f"/proc/{server}/status") as f:
        hwm_kb = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
    # Under ASan the allocator keeps freed blocks in quarantine (256 MB by
    # default) and a shadow of the heap, so the bound is looser there; the
    # plain build's pass holds the tight one.
    with open(f"/proc/{server}/maps") as f:
        sanitized = "libasan" in f.read()
    bound_kb = (1 << 20) + ((512 << 10) if sanitized else 0)
    assert hwm_kb < bound_kb, f"the server's peak RSS was {hwm_kb} kB relaying the flood"
    assert run_ok(kc, cell("result = 6 * 7")) == 42
