"""CPU fairness: a session that burns CPU without pause gets a low CPU weight
(cgroup cpu.shares, and cpu.idle where the kernel has it) while a quiet session keeps the default, and the weight
comes back once the loud one calms down. The history records both changes.

What is checked is the policy's effect on the host's cgroups, not timings:
the latency gain it buys is measured by the benchmark (bench/, figure 6).
"""
import glob
import os

from server_helpers import execute, server, wait_for  # noqa: F401


def cpu_shares(sid):
    files = glob.glob(f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}/cpu.shares") + \
        glob.glob(f"/sys/fs/cgroup/cpu,cpuacct/cellblock/cb-{sid}/cpu.shares")
    if not files:
        return None
    with open(files[0]) as f:
        return int(f.read())


def cpu_idle(sid):
    path = f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}/cpu.idle"
    return int(open(path).read()) if os.path.exists(path) else None


def nice_values(sid):
    """The nice values of the threads in the sandbox's cpu cgroup."""
    values = set()
    for tasks in glob.glob(f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}/tasks"):
        for tid in open(tasks).read().split():
            try:
                with open(f"/proc/{tid}/stat") as f:
                    values.add(int(f.read().rsplit(")", 1)[1].split()[16]))
            except OSError:
                pass
    return values


def events(server, sid):  # noqa: F811
    history = server.ok("session_history_request", {"session_id": sid})["content"]
    return [e["kind"] for e in history["events"]]


def test_a_spinning_session_is_demoted_and_restored(server):  # noqa: F811
    loud_sid, loud, _ = server.open_session()
    quiet_sid, quiet, _ = server.open_session()
    if cpu_shares(loud_sid) is None:
        import pytest
        pytest.skip("no cgroup v1 cpu controller for the sandboxes on this host")
    assert cpu_shares(loud_sid) == 1024 and cpu_shares(quiet_sid) == 1024

    # A spin of ~4 s in the loud session; the quiet one runs short cells meanwhile.
    spin = loud.execute("import time\nt = time.time()\nwhile time.time() - t < 4: pass\n'spun'")
    assert wait_for(lambda: cpu_shares(loud_sid) < 1024, timeout=30), \
        f"loud session's cpu.shares stayed {cpu_shares(loud_sid)}"
    assert wait_for(lambda: cpu_idle(loud_sid) in (1, None), timeout=5)
    for i in range(3):
        reply, _ = execute(quiet, f"{i} + 1")
        assert reply["content"]["status"] == "ok"
    assert cpu_shares(quiet_sid) == 1024, "the quiet session must keep the default weight"
    assert cpu_idle(quiet_sid) in (0, None)

    # The spin still completes (demotion is a weight, not a stop).
    while True:
        msg = loud.get_shell_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == spin:
            break
    assert msg["content"]["status"] == "ok"
    assert wait_for(lambda: cpu_shares(loud_sid) == 1024, timeout=30), \
        f"loud session's cpu.shares stayed {cpu_shares(loud_sid)} after it calmed down"
    assert wait_for(lambda: cpu_idle(loud_sid) in (0, None), timeout=5)
    assert wait_for(lambda: events(server, loud_sid)[-2:] == ["cpu_demoted", "cpu_restored"],
                    timeout=10), events(server, loud_sid)
    assert "cpu_demoted" not in events(server, quiet_sid)
    for sid in (loud_sid, quiet_sid):
        server.ok("session_close_request", {"session_id": sid})


def test_shares_are_writable_only_by_the_server(server):  # noqa: F811
    """The sandbox cannot raise its own weight back: the cgroup is not its to write."""
    sid, kc, _ = server.open_session()
    if cpu_shares(sid) is None:
        import pytest
        pytest.skip("no cgroup v1 cpu controller for the sandboxes on this host")
    code = ("import glob\nout = []\n"
            "for p in glob.glob('/sys/fs/cgroup/**/cpu.shares', recursive=True) + ['/sys/fs/cgroup/cpu.shares']:\n"
            "    try:\n        open(p, 'w').write('262144'); out.append('wrote ' + p)\n"
            "    except OSError as e:\n        out.append(type(e).__name__)\n"
            "print(out)")
    reply, msgs = execute(kc, code)
    text = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
    assert "wrote" not in text, text
    assert cpu_shares(sid) == 1024
    assert os.path.exists(f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}")
    server.ok("session_close_request", {"session_id": sid})


def test_pool_refills_boot_at_a_low_weight_and_sessions_get_the_default(server):  # noqa: F811
    """Warm sandboxes waiting in the pool were started at a low CPU weight (a
    refill must not slow the sessions in use); the one a session takes is
    given the default weight back."""
    from server_helpers import sessions_on_disk

    def pooled():
        return [sid for sid in sessions_on_disk(server.state_dir)
                if sid not in server.session_ids and cpu_shares(sid) is not None]

    assert wait_for(lambda: len(pooled()) >= 1, timeout=120), "the pool never refilled"
    waiting = pooled()
    assert all(cpu_shares(sid) == 64 for sid in waiting), {s: cpu_shares(s) for s in waiting}
    assert all(nice_values(sid) == {19} for sid in waiting), \
        {s: nice_values(s) for s in waiting}
    sid, kc, _ = server.open_session()
    assert cpu_shares(sid) == 1024
    assert nice_values(sid) == {0}
    reply, _ = execute(kc, "1+1")
    assert reply["content"]["status"] == "ok"
    server.ok("session_close_request", {"session_id": sid})
