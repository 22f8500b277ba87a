"""Every sandbox runs as a host id range of its own, leased from a pool that
every cellblock process on the host shares (/run/cellblock-ids/<index>.lock,
flock'ed by the owner for the sandbox's lifetime).

The kernel keeps several quotas per host uid whatever the user namespace
(session keyrings, inotify instances, RLIMIT_NPROC, mqueue bytes); with one
range for all sandboxes one session could exhaust what every other needed.
Judged from the host: /proc/<pid>/status of the sessions' own processes,
the lease files of their own ranges, and the registry.
"""
import ctypes
import errno
import fcntl
import glob
import os
import re
import subprocess
import sys
import textwrap


import server_helpers as sh
from server_helpers import server_factory  # noqa: F401

LEASE_DIR = "/run/cellblock-ids"
POOL_FIRST_ID = (1 << 30) + 65536
SANDBOX_UID = 1000


def status_ids(pid):
    """(uids, gids) of a process: real, effective, saved, filesystem."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = [int(x) for x in value.split()] if key in ("Uid", "Gid") else None
    return fields["Uid"], fields["Gid"]


def host_ids_of(srv, sid):
    ids = srv.info_of(sid)["host_ids"]
    return ids["base"], ids["count"]


def pids_in_range(base, count):
    """Host processes with any uid or gid in [base, base + count)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/status"):
        try:
            uids, gids = status_ids(int(path.split("/")[2]))
        except (OSError, KeyError, ValueError):
            continue
        if any(base <= i < base + count for i in uids + gids):
            found.append(int(path.split("/")[2]))
    return found


def lease_path(base, count):
    return os.path.join(LEASE_DIR, f"{(base - POOL_FIRST_ID) // count}.lock")


def lease_held(path):
    """Whether some process holds the lease's flock (probed without keeping it)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def lease_holder(path):
    with open(path) as f:
        return f.read().strip()


def run(kc, code, timeout=60):
    reply, iopub = sh.execute(kc, textwrap.dedent(code), timeout=timeout)
    assert reply["content"]["status"] == "ok", reply["content"]
    return sh.stream_text(iopub)


def range_released(state_dir, sid, base, count):
    """Why session `sid` still holds its range, or None once it has let it go.

    Ranges come from one pool shared by every cellblock process on the host: on
    a busy host another server's sandbox may lease the range as soon as this
    one releases it. The allocator hands a range on only when no process runs
    as it and its last holder's session dir is gone, so a range that names
    another holder was let go by this session; its processes are not ours.
    """
    path = lease_path(base, count)
    ours = os.path.join(state_dir, "sessions", sid)
    if lease_holder(path) != ours:
        return None
    pids = pids_in_range(base, count)
    if pids:
        return f"processes still run as the range of session {sid}: {pids}"
    if lease_held(path):
        return f"{path} is still locked after session {sid} ended"
    if os.path.exists(ours):
        return f"the lease's holder {ours} (session {sid}'s dir) still exists"
    return None


def assert_range_free(state_dir, sid, base, count, timeout=15):
    """Nothing of the session runs as its ids, and its lease is free for the next sandbox."""
    sh.wait_for(lambda: range_released(state_dir, sid, base, count) is None, timeout=timeout)
    why = range_released(state_dir, sid, base, count)
    assert why is None, why


def test_two_sessions_run_as_different_host_ids(server_factory):  # noqa: F811
    srv = server_factory(["--pool", "host=0"])
    ranges = {}
    for _ in range(2):
        sid, kc, _reply = srv.open_session()
        assert run(kc, "import os; print(os.getuid(), os.getgid())").split() == ["1000", "1000"]
        base, count = host_ids_of(srv, sid)
        assert base >= POOL_FIRST_ID and count == 65536, (base, count)
        pids = sh.session_pids(sid)
        assert len(pids) >= 2, f"expected the shim and the kernel of {sid}, saw {pids}"
        for pid in pids:
            uids, gids = status_ids(pid)
            assert uids == [base + SANDBOX_UID] * 4, (sid, pid, uids)
            assert gids == [base + SANDBOX_UID] * 4, (sid, pid, gids)
            with open(f"/proc/{pid}/uid_map") as f:
                assert f.read().split() == ["0", str(base), str(count)]
        path = lease_path(base, count)
        assert lease_held(path), f"{path}: session {sid}'s lease is not held"
        assert lease_holder(path) == os.path.join(srv.state_dir, "sessions", sid)
        ranges[sid] = (base, count)
    (a, (base_a, count_a)), (b, (base_b, _)) = ranges.items()
    assert abs(base_a - base_b) >= count_a, f"sessions {a} and {b} share ids: {ranges}"

    # Closed: the range is free again and nothing runs as it.
    srv.ok("session_close_request", {"session_id": a})
    sh.assert_session_gone(srv.state_dir, a)
    assert_range_free(srv.state_dir, a, base_a, count_a)
    # The registry keeps which range the session had.
    assert host_ids_of(srv, a) == (base_a, count_a)


def test_a_range_is_freed_after_a_server_kill_and_restart(server_factory):  # noqa: F811
    # Sandboxes that end with their server (no --adopt-grace): reaped, not adopted.
    srv = server_factory(["--pool", "host=0", "--adopt-grace", "0"])
    sid, kc, _reply = srv.open_session()
    run(kc, "print(1)")
    base, count = host_ids_of(srv, sid)
    path = lease_path(base, count)
    srv.close_clients()
    srv.kill9()
    # The dead server's lock is gone with it, but its sandbox's session dir
    # (the lease's holder) stays until a reaper runs: no one may take the range.
    assert not lease_held(path)
    assert os.path.isdir(lease_holder(path)), "the session dir went before any reaper ran"
    # A leftover the reaper cannot find in the sandbox's cgroup or pid namespace:
    # a host process running as the session's host ids. The registry's range finds it.
    leftover = subprocess.Popen(["/usr/bin/sleep", "600"], cwd="/", stdin=subprocess.DEVNULL,
                                user=base + SANDBOX_UID, group=base + SANDBOX_UID,
                                extra_groups=[])
    try:
        srv.start()
        assert leftover.wait(timeout=15) == -9, "the leftover in the session's range survived"
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
    # (the sandbox's own shim and kernel may still be ending: they count too)
    assert re.search(rf"session {sid}: killed \d+ leftover process\(es\) running as its host "
                     rf"ids {base}\.\.", srv.log()), srv.log()
    sh.assert_session_gone(srv.state_dir, sid)
    assert_range_free(srv.state_dir, sid, base, count)
    info = srv.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"] == "server_restart", info
    assert (info["host_ids"]["base"], info["host_ids"]["count"]) == (base, count)


# Runs as the host uid of one sandbox's container root, the owner runc gives
# the container's session keyring: adds keys to a fresh session keyring until
# the kernel's per-uid quota (kernel.keys.maxkeys) says EDQUOT, then holds them.
KEY_EXHAUSTER = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_add_key, SYS_keyctl = 248, 250
KEYCTL_JOIN_SESSION_KEYRING, KEY_SPEC_SESSION_KEYRING = 1, -3
if libc.syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
    sys.exit("join: %d" % ctypes.get_errno())
added = 0
while True:
    key = libc.syscall(SYS_add_key, b"user", b"k%d" % added, b"x", 1, KEY_SPEC_SESSION_KEYRING)
    if key < 0:
        print(added, ctypes.get_errno(), flush=True)
        break
    added += 1
sys.stdin.read()
"""


def test_a_keyring_quota_exhausted_in_one_range_leaves_others_alone(server_factory):  # noqa: F811
    srv = server_factory(["--pool", "host=0"])
    sid_a, kc_a, _ = srv.open_session()
    # Sandboxed code cannot touch keyrings at all (seccomp) ...
    out = run(kc_a, """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        r = libc.syscall(248, b"user", b"k", b"x", 1, -3)
        print(r, ctypes.get_errno())
    """)
    assert out.split() == ["-1", str(errno.EPERM)], out
    # ... but the keyring runc makes for every container is charged to its
    # root's host uid: exhaust that uid's quota from the host, as a busy host
    # of sandboxes sharing one uid did.
    base_a, _ = host_ids_of(srv, sid_a)
    hog = subprocess.Popen([sys.executable, "-c", KEY_EXHAUSTER], cwd="/",
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           user=base_a, group=base_a, extra_groups=[])
    try:
        added, err = (int(x) for x in hog.stdout.readline().split())
        assert err == errno.EDQUOT, f"the key hog stopped after {added} keys with errno {err}"
        # Another session starts (runc makes its keyring) and works.
        sid_b, kc_b, _ = srv.open_session()
        assert run(kc_b, "print(6 * 7)").strip() == "42"
        assert host_ids_of(srv, sid_b)[0] != base_a
        assert run(kc_a, "print('still here')").strip() == "still here"
    finally:
        hog.stdin.close()
        hog.wait(timeout=30)


INOTIFY_HOG = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
print(len(held), ctypes.get_errno())
"""

INOTIFY_ONE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.inotify_init1(0) >= 0, ctypes.get_errno())
"""


# Host id ranges do not separate inotify: the kernel charges a sandbox's
# inotify instances (like other ucounts) at the host level to the user that
# created its user namespace (root, who runs runc), and runc 1.1 refuses the
# per-namespace cap (linux.sysctl user.max_inotify_instances: "not in a
# separate kernel namespace"). So the seccomp profile denies inotify_init and
# inotify_init1: no session can spend the instances that other sessions and
# root's own daemons share.
def test_inotify_is_refused_so_no_session_spends_roots_instances(server_factory):  # noqa: F811
    libc = ctypes.CDLL(None, use_errno=True)
    srv = server_factory(["--pool", "host=0"])
    sid_a, kc_a, _ = srv.open_session()
    count, err = (int(x) for x in run(kc_a, INOTIFY_HOG).split())
    assert (count, err) == (0, errno.EPERM), (count, err)
    assert run(kc_a, INOTIFY_ONE).split() == ["False", str(errno.EPERM)]
    # Root on the host still makes one (nothing of its pool was spent).
    fd = libc.inotify_init1(0)
    assert fd >= 0, ctypes.get_errno()
    os.close(fd)
    # Another session starts and works.
    sid_b, kc_b, _ = srv.open_session()
    assert run(kc_b, "print(6 * 7)").strip() == "42"
