"""CPU fairness on real cgroups: what is abusive (work left running with no
execution, a thread or fork storm) is demoted to a low weight and a small
quota that still guarantee progress, after seconds, and restored after
seconds of calm; a long computation or a burst of work is never demoted;
the history records one event per change, with why and for how long.

What is checked is the policy's effect on the session's own cgroups and
history, not timings: the latency it buys is measured by the benchmark
(bench/, figure 8).
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

import server_helpers as sh
from server_helpers import execute, server_factory, wait_for  # noqa: F401

import pytest


@pytest.fixture(scope="module")
def demand_dir():
    """Where this module's servers publish their CPU demand: a directory of
    their own, so that other servers on the host do not change the figures
    judged here (they still share the host's parent cgroup, see below)."""
    top = tempfile.mkdtemp(prefix="cb-cpu-demand-")
    yield os.path.join(top, "demand")
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def server(request, demand_dir):
    # --loud-cpus auto for every session holding the CPU: what it does is
    # checked beside what the rest does (the default keeps only those whose
    # memory grows apart: test_by_default_only_a_session_whose_memory_grows_...).
    srv = sh.start_server(["--cpu-demand-dir", demand_dir, "--loud-cpus", "auto",
                           "--loud-cpus-for", "holding"])
    yield srv
    problems = srv.shutdown()
    assert not problems, "\n".join(problems)


def cgroup_value(sid, name, parse=int):
    """A cgroup file of the session's own sandbox (cpu and cpuacct may be apart or joined)."""
    for path in glob.glob(f"/sys/fs/cgroup/*/cellblock/cb-{sid}/{name}"):
        with open(path) as f:
            return parse(f.read())
    return None


def cpu_shares(sid):
    return cgroup_value(sid, "cpu.shares")


def cpuset_cpus(sid):
    """The session's sandbox's cpuset.cpus, as a set of CPU numbers (None: no such file)."""
    return cgroup_value(sid, "cpuset.cpus", cpu_set)


def cpu_set(text):
    cpus = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def loud_and_all_cpus(server):
    """The CPUs the server keeps a session holding the CPU to (None: none), and
    every CPU its sandboxes' parent has."""
    loud = server.ok("server_info_request", {})["content"]["cpu"]["loud_cpus"]
    with open("/sys/fs/cgroup/cpuset/cellblock/cpuset.effective_cpus") as f:
        every = cpu_set(f.read())
    return (cpu_set(loud) if loud else None), every


def cpu_quota(sid):
    return cgroup_value(sid, "cpu.cfs_quota_us")


def cpu_idle(sid):
    return cgroup_value(sid, "cpu.idle")


def cpu_seconds(sid):
    return cgroup_value(sid, "cpuacct.usage") / 1e9


def values_of(tids, read):
    """read(tid) of each task, but those gone meanwhile."""
    values = set()
    for tid in tids:
        try:
            values.add(read(tid))
        except OSError:
            pass
    return values - {None}


def task_values(sid, read):
    """read(tid) of the threads in the sandbox's cpu cgroup, but those gone meanwhile."""
    return values_of([tid for tasks in glob.glob(f"/sys/fs/cgroup/cpu/cellblock/cb-{sid}/tasks")
                      for tid in open(tasks).read().split()], read)


def nice_of(tid):
    with open(f"/proc/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def nice_values(sid):
    """The nice values of the threads in the sandbox's cpu cgroup."""
    return task_values(sid, nice_of)


def slice_of(tid):
    """EEVDF's slice of a task in microseconds (/proc/<tid>/sched), or None."""
    with open(f"/proc/{tid}/sched") as f:
        for line in f:
            if line.startswith("se.slice "):
                return int(line.split(":")[1]) // 1000
    return None


def history(server, sid):  # noqa: F811
    return server.ok("session_history_request", {"session_id": sid})["content"]["events"]


def cpu_events(server, sid):  # noqa: F811
    return [e for e in history(server, sid) if e["kind"].startswith("cpu_")]


def need_cpu_controller(sid):
    if cpu_shares(sid) is None or cpu_quota(sid) is None:
        pytest.skip("no cgroup v1 cpu controller for the sandboxes on this host")


def run_until_reply(kc, msg_id, timeout=120):
    while True:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg


SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_a_long_computation_only_yields_and_bursts_change_nothing(server):  # noqa: F811
    """A 6 s computation, then pandas-import-like bursts (a second of CPU, a
    pause), next to a neighbour spinning: the computation is never demoted, it
    only yields a step of weight (its quota and cpu.idle untouched) and gets
    its weight back when it ends; the bursts change nothing. (The per-sample
    policy demoted such a cell within 300 ms.)"""
    sid, kc, _ = server.open_session()
    nid, neighbour, _ = server.open_session()
    need_cpu_controller(sid)
    assert (cpu_shares(sid), cpu_quota(sid)) == (1024, 100000)
    busy = neighbour.execute(SPIN.format(s=14))

    def run_sampling(code):
        seen = set()
        msg_id = kc.execute(code)
        while True:
            try:
                msg = kc.get_shell_msg(timeout=0.2)
            except Exception:  # queue.Empty: sample the cgroup meanwhile
                seen.add((cpu_shares(sid), cpu_quota(sid), cpu_idle(sid)))
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                break
        assert msg["content"]["status"] == "ok"
        return seen

    seen = run_sampling(SPIN.format(s=6))
    assert {(shares, quota) for shares, quota, _ in seen} <= {(1024, 100000), (128, 100000)}, seen
    assert {idle for _, _, idle in seen} <= {0, None}, seen
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=10), cpu_shares(sid)
    long_events = [e["kind"] for e in cpu_events(server, sid)]
    # (It yields only if it got 5% of a core over 2 s: a starved host may not give it that.)
    assert long_events in ([], ["cpu_yielding", "cpu_restored"]), cpu_events(server, sid)
    time.sleep(1)
    for _ in range(3):
        seen = run_sampling(SPIN.format(s=1))
        assert seen <= {(1024, 100000, 0), (1024, 100000, None)}, seen
        time.sleep(1)
    assert [e["kind"] for e in cpu_events(server, sid)] == long_events, cpu_events(server, sid)
    assert run_until_reply(neighbour, busy)["content"]["status"] == "ok"
    for s in (sid, nid):
        server.ok("session_close_request", {"session_id": s})


def test_the_server_and_interactive_sessions_have_the_short_slice_one_holding_the_cpu_the_default(server):  # noqa: F811,E501
    """serve's threads and an interactive session's tasks run with EEVDF's
    shortest slice (0.1 ms), so that a waking quiet session or relay preempts
    the noise instead of waiting out its slice; a session whose cell holds
    the CPU (yielding) gets the kernel's default back, and the short slice
    again when its cell ends."""
    default = slice_of(os.getpid())
    if default is None:
        pytest.skip("this kernel reports no EEVDF slice (/proc/<pid>/sched se.slice)")
    if default == 100:
        pytest.skip("this test runs with a custom slice: the default cannot be told apart")
    server_tids = os.listdir(f"/proc/{server.proc.pid}/task")
    assert values_of(server_tids, slice_of) == {100}
    sid, kc, _ = server.open_session()
    need_cpu_controller(sid)
    assert task_values(sid, slice_of) == {100}
    loud, every = loud_and_all_cpus(server)
    if len(every) >= 2:  # --loud-cpus auto: all but the lowest
        assert loud == every - {min(every)}, (loud, every)
    assert cpuset_cpus(sid) == every
    # A thread started in a cell inherits the slice of its process.
    reply, _ = execute(kc, "import threading, time\n"
                           "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()")
    assert reply["content"]["status"] == "ok"
    assert task_values(sid, slice_of) == {100}
    busy = kc.execute(SPIN.format(s=8))
    yielded = wait_for(lambda: cpu_shares(sid) == 128, timeout=7)
    if yielded:
        assert wait_for(lambda: task_values(sid, slice_of) == {default}, timeout=2), \
            task_values(sid, slice_of)
        # And it runs on the loud CPUs only, off the one kept for the others.
        assert wait_for(lambda: cpuset_cpus(sid) == (loud or every), timeout=2), cpuset_cpus(sid)
    assert run_until_reply(kc, busy)["content"]["status"] == "ok"
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=10), cpu_shares(sid)
    assert wait_for(lambda: task_values(sid, slice_of) == {100}, timeout=2), \
        task_values(sid, slice_of)
    assert wait_for(lambda: cpuset_cpus(sid) == every, timeout=2), cpuset_cpus(sid)
    # (It yields only if it got 5% of a core over 2 s: a starved host may not
    # give it that, or only after the 7 s waited for above.)
    kinds = [e["kind"] for e in cpu_events(server, sid)]
    assert kinds in ([], ["cpu_yielding", "cpu_restored"]), cpu_events(server, sid)
    assert not yielded or kinds, cpu_events(server, sid)
    server.ok("session_close_request", {"session_id": sid})


BACKGROUND_SPIN = """
import threading
state = {"n": 0, "stop": False}
def _spin():
    while not state["stop"]:
        state["n"] += 1
threading.Thread(target=_spin, daemon=True).start()
"""


def counter(kc):
    reply, msgs = execute(kc, "print(state['n'])")
    assert reply["content"]["status"] == "ok"
    return int("".join(m["content"].get("text", "") for m in msgs
                       if m["msg_type"] == "stream").strip())


def test_work_left_in_the_background_is_demoted_still_progresses_and_is_restored(server):  # noqa: F811,E501
    sid, kc, _ = server.open_session()
    need_cpu_controller(sid)
    reply, _ = execute(kc, BACKGROUND_SPIN)
    assert reply["content"]["status"] == "ok"
    # The cell has ended; the thread it left spins: demoted after seconds.
    assert wait_for(lambda: cpu_shares(sid) < 1024, timeout=30), cpu_shares(sid)
    events = cpu_events(server, sid)
    assert [e["kind"] for e in events] == ["cpu_demoted"], events
    assert "no execution" in events[0]["detail"], events[0]
    # A guaranteed share, never cgroup cpu.idle (which gives nothing while
    # anything else is runnable).
    assert cpu_shares(sid) == 64 and cpu_quota(sid) == 5000, (cpu_shares(sid), cpu_quota(sid))
    assert cpu_idle(sid) in (0, None)
    loud, every = loud_and_all_cpus(server)
    assert cpuset_cpus(sid) == (loud or every), cpuset_cpus(sid)

    # It still progresses, with two neighbours spinning on this 2-core budget.
    others = [server.open_session() for _ in range(2)]
    runs = [(okc, okc.execute(SPIN.format(s=5))) for _, okc, _ in others]
    time.sleep(1)
    n0, c0 = counter(kc), cpu_seconds(sid)
    time.sleep(3)
    n1, c1 = counter(kc), cpu_seconds(sid)
    assert n1 > n0, f"the demoted thread made no progress: counter {n0} -> {n1}"
    assert c1 - c0 > 0.01, f"the demoted sandbox got {c1 - c0:.3f} s of CPU in 3 s"
    # CFS enforces a quota at its tick and slice granularity: on a loaded
    # host a 0.05-core cap was seen to let through 0.087 core (0.26 s in 3 s).
    # Uncapped, the spinning thread would take most of a core (2-3 s).
    assert c1 - c0 < 3 * 0.05 * 2 + 0.1, f"the quota cap did not hold: {c1 - c0:.2f} s in 3 s"
    for okc, msg_id in runs:
        assert run_until_reply(okc, msg_id)["content"]["status"] == "ok"
    assert cpu_shares(sid) == 64, "demoted while the work goes on: no flapping"

    # The work stops: restored after seconds of calm, once, saying for how long.
    execute(kc, "state['stop'] = True")
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=30), cpu_shares(sid)
    assert cpu_quota(sid) == 100000
    assert wait_for(lambda: cpuset_cpus(sid) == every, timeout=2), cpuset_cpus(sid)
    events = cpu_events(server, sid)
    assert [e["kind"] for e in events] == ["cpu_demoted", "cpu_restored"], events
    assert "demoted for" in events[1]["detail"], events[1]
    for osid, _, _ in others:
        kinds = {e["kind"] for e in cpu_events(server, osid)}
        assert kinds <= {"cpu_yielding", "cpu_restored"}, "a 5 s computation is not penalised"
        server.ok("session_close_request", {"session_id": osid})
    server.ok("session_close_request", {"session_id": sid})


THREAD_STORM = """
import threading, time
for _ in range(200):
    threading.Thread(target=time.sleep, args=(8,), daemon=True).start()
"""


def test_a_thread_storm_is_demoted_then_restored_once_it_is_gone(server):  # noqa: F811
    sid, kc, _ = server.open_session()
    need_cpu_controller(sid)
    reply, _ = execute(kc, THREAD_STORM)
    assert reply["content"]["status"] == "ok"
    assert wait_for(lambda: cpu_shares(sid) == 64, timeout=20), cpu_shares(sid)
    events = cpu_events(server, sid)
    assert [e["kind"] for e in events] == ["cpu_demoted"], events
    assert "storm" in events[0]["detail"], events[0]
    # The threads end after 8 s; 5 s of calm later the weight comes back.
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=40), cpu_shares(sid)
    assert [e["kind"] for e in cpu_events(server, sid)] == ["cpu_demoted", "cpu_restored"]
    reply, _ = execute(kc, "1+1")
    assert reply["content"]["status"] == "ok"
    server.ok("session_close_request", {"session_id": sid})


# Processes appearing a few a second, as ten fork bombs slowing each other's
# forks grow: never 32 in one sample nor 128 in all, for seconds. Ten a
# second unhindered, so that a loaded host's slower spawns still give the
# rule's 4 a second.
CREEP = """
import subprocess, time
children = []
for _ in range(32):
    children.append(subprocess.Popen(['sleep', '120']))
    time.sleep(0.08)
"""


def test_processes_creeping_up_a_few_a_second_are_a_storm_capped_at_a_hundredth_of_a_core(server):  # noqa: F811,E501
    sid, kc, _ = server.open_session()
    need_cpu_controller(sid)
    msg_id = kc.execute(CREEP)
    # Tighter than background work's 0.05: a storm's forks cost its
    # neighbours kernel work that no weight governs.
    assert wait_for(lambda: cpu_quota(sid) == 1000, timeout=30), cpu_quota(sid)
    assert cpu_shares(sid) == 64
    assert run_until_reply(kc, msg_id)["content"]["status"] == "ok"
    events = cpu_events(server, sid)
    assert events and events[0]["kind"] == "cpu_demoted", events
    assert "storm" in events[0]["detail"] and "rising in" in events[0]["detail"], events[0]
    # The creeping stops (at the cap, the last spawns come slowly): calm for
    # 5 s, then restored, with the session's own quota.
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=40), cpu_shares(sid)
    assert cpu_quota(sid) == 100000
    assert [e["kind"] for e in cpu_events(server, sid)] == ["cpu_demoted", "cpu_restored"]
    reply, _ = execute(kc, "for c in children: c.kill(); c.wait()", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    server.ok("session_close_request", {"session_id": sid})


def parent_shares():
    """cpu.shares of the sandboxes' common parent cgroup, or None."""
    for path in glob.glob("/sys/fs/cgroup/cpu*/cellblock/cpu.shares"):
        with open(path) as f:
            return int(f.read())
    return None


def other_servers(*ours):
    """Other `cellblock serve` processes on the host: they write the shared parent too."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if pid not in ours and len(argv) > 1 and argv[0].endswith(b"cellblock") and argv[1] == b"serve":
            found.append(pid)
    return found


def stepping(sessions, stop):
    """Short executions back to back in each session, on a thread each."""
    def steps(kc):
        while not stop.is_set():
            reply, _ = execute(kc, "sum(range(200000))")
            assert reply["content"]["status"] == "ok"
    threads = [threading.Thread(target=steps, args=(kc,)) for _, kc, _ in sessions]
    for t in threads:
        t.start()
    return threads


def test_the_sandboxes_weigh_on_the_host_what_their_interactive_sessions_weigh(server):  # noqa: F811,E501
    """Three sessions stepping, one idle: the sandboxes' parent cgroup weighs
    three processes' worth, not one (at one, a hundred busy sessions lost 35%
    of their throughput to preemption by the server and the client: bench
    figure 4); while another session computes for seconds, or once they are
    done, it is one process's worth again."""
    busy = [server.open_session() for _ in range(3)]
    busy_idle = server.open_session()
    idle_sid = busy_idle[0]
    need_cpu_controller(idle_sid)

    def cpu_info():
        cpu = server.ok("server_info_request", {})["content"]["cpu"]
        return {k: cpu[k] for k in ("interactive_sessions", "hogging_sessions",
                                    "sandboxes_weight")}

    # Short executions back to back, on a thread per session as an agent would.
    stop = threading.Event()
    threads = stepping(busy, stop)
    try:
        assert wait_for(lambda: cpu_info() == {"interactive_sessions": 3, "hogging_sessions": 0,
                                               "sandboxes_weight": 3 * 1024},
                        timeout=10), cpu_info()
        if not other_servers(server.proc.pid):
            assert wait_for(lambda: parent_shares() == 3 * 1024, timeout=2), parent_shares()
        # A fourth session computes for seconds: the parent's weight would go
        # to it, not to the three stepping, so it is one process's again.
        idle_kc = busy_idle[1]
        spin = idle_kc.execute(SPIN.format(s=4))
        assert wait_for(lambda: cpu_info() == {"interactive_sessions": 3, "hogging_sessions": 1,
                                               "sandboxes_weight": 1024},
                        timeout=6), cpu_info()
        if not other_servers(server.proc.pid):
            assert parent_shares() == 1024
        assert run_until_reply(idle_kc, spin)["content"]["status"] == "ok"
        assert wait_for(lambda: cpu_info()["sandboxes_weight"] == 3 * 1024, timeout=6), cpu_info()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert wait_for(lambda: cpu_info() == {"interactive_sessions": 0, "hogging_sessions": 0,
                                           "sandboxes_weight": 1024}, timeout=10), cpu_info()
    if not other_servers(server.proc.pid):
        assert parent_shares() == 1024

    # A long computation is not interactive after a second: it adds nothing.
    # (Waited for, not slept on: on a busy host the kernel may start the
    # computation late, and the policy counts from its start.)
    kc = busy[0][1]
    msg_id = kc.execute(SPIN.format(s=8))
    assert wait_for(lambda: cpu_info() == {"interactive_sessions": 0, "hogging_sessions": 1,
                                           "sandboxes_weight": 1024}, timeout=6), cpu_info()
    assert run_until_reply(kc, msg_id)["content"]["status"] == "ok"
    for sid in [b[0] for b in busy[1:]]:
        assert cpu_events(server, sid) == [], "short steps change no session's weight"
    for sid in (busy[0][0], idle_sid):  # a computation of seconds yields a step, no more
        kinds = {e["kind"] for e in cpu_events(server, sid)}
        assert kinds <= {"cpu_yielding", "cpu_restored"}, cpu_events(server, sid)
    for sid in [b[0] for b in busy] + [idle_sid]:
        server.ok("session_close_request", {"session_id": sid})


def servers_shares():
    """cpu.shares of the servers' cgroup, or None."""
    for path in glob.glob("/sys/fs/cgroup/cpu*/cellblock-servers/cpu.shares"):
        with open(path) as f:
            return int(f.read())
    return None


def cpu_cgroup_of(pid):
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(",") or controllers == "":
                return path
    return None


def host_spinners(n):
    """Processes of the host spinning outside cellblock, each in a session of
    its own (the scheduler's autogroups weigh each as one process)."""
    return [subprocess.Popen(["/usr/bin/python3", "-c", "while True: pass"],
                             start_new_session=True) for _ in range(n)]


def test_long_computations_beside_host_spinners_weigh_a_process_each(server):  # noqa: F811
    """Two sessions computing for seconds beside two processes spinning on the
    host weigh two processes against it, each as much as a host process (one
    for all of them let two host spinners take 0.65 of a core each while a
    pandas cell got 0.2: bench figure 16); the server, which relays every
    session's messages, weighs what the sandboxes do. Once they are done,
    one process again. (Whatever else the host runs only adds to the
    contention the spinners make: the verdict cannot change.)"""
    sessions = [server.open_session() for _ in range(2)]
    need_cpu_controller(sessions[0][0])
    assert cpu_cgroup_of(server.proc.pid) == "/cellblock-servers"

    def cpu_info():
        cpu = server.ok("server_info_request", {})["content"]["cpu"]
        return cpu["hogging_sessions"], cpu["sandboxes_weight"], cpu["host_contended"]

    spinners = host_spinners(2)
    try:
        runs = [(kc, kc.execute(SPIN.format(s=8))) for _, kc, _ in sessions]
        assert wait_for(lambda: cpu_info() == (2, 2 * 1024, True), timeout=8), cpu_info()
        contention = server.ok("server_info_request", {})["content"]["cpu"]["host_contention"]
        assert contention.startswith("they contend: the host's processes used"), contention
        if not other_servers(server.proc.pid):
            assert wait_for(lambda: (parent_shares(), servers_shares()) == (2048, 2048),
                            timeout=2), (parent_shares(), servers_shares())
        for kc, msg_id in runs:
            assert run_until_reply(kc, msg_id)["content"]["status"] == "ok"
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert wait_for(lambda: cpu_info() == (0, 1024, False), timeout=10), cpu_info()
    if not other_servers(server.proc.pid):
        assert (parent_shares(), servers_shares()) == (1024, 1024)
    for sid, _, _ in sessions:
        kinds = {e["kind"] for e in cpu_events(server, sid)}
        assert kinds <= {"cpu_yielding", "cpu_restored"}, cpu_events(server, sid)
        server.ok("session_close_request", {"session_id": sid})


CONTENTION = re.compile(r"the host's processes used ([0-9.]+) of a core, the sandboxes "
                        r"([0-9.]+), over ([0-9.]+) s")


def test_the_hogs_weigh_a_process_each_only_while_the_host_contends(server):  # noqa: F811
    """Without host spinners of its own, whether the host's processes contend
    depends on what else this machine runs, so what is checked is that the
    weight follows the server's verdict and the verdict its own figures:
    contended (the host used at least 0.75 of what the sandboxes did, and a
    quarter of a core), each of the two computations weighs a process;
    else both together weigh one, so that a process of the host, a client
    stepping another session, is not kept waiting behind them (bench figure
    6). The rule itself is host_contention_test's."""
    sessions = [server.open_session() for _ in range(2)]
    need_cpu_controller(sessions[0][0])

    def cpu_info():
        return server.ok("server_info_request", {})["content"]["cpu"]

    runs = [(kc, kc.execute(SPIN.format(s=6))) for _, kc, _ in sessions]
    assert wait_for(lambda: cpu_info()["hogging_sessions"] == 2 and
                    CONTENTION.search(cpu_info()["host_contention"]), timeout=8), cpu_info()
    seen = set()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        cpu = cpu_info()
        if cpu["hogging_sessions"] != 2:
            break
        hogs = cpu["host"]["hogging_sessions"]
        assert cpu["sandboxes_weight"] == (hogs if cpu["host_contended"] else 1) * 1024, cpu
        figures = CONTENTION.search(cpu["host_contention"])
        if figures and not cpu["host_contention"].startswith("checking"):
            host, sandboxes = float(figures.group(1)), float(figures.group(2))
            says = cpu["host_contention"].startswith("they contend")
            # Rounded to hundredths in the text: the verdict is judged on the
            # exact figures, so only a margin past the rounding is checked.
            if abs(host - 0.75 * sandboxes) > 0.02 and abs(host - 0.25) > 0.01:
                assert says == (host >= 0.75 * sandboxes and host >= 0.25), cpu
            assert says == cpu["host_contended"], cpu
        seen.add(cpu["host_contended"])
        time.sleep(0.1)
    assert seen, "the sessions stopped holding the CPU before anything was checked"
    for kc, msg_id in runs:
        assert run_until_reply(kc, msg_id)["content"]["status"] == "ok"
    for sid, _, _ in sessions:
        server.ok("session_close_request", {"session_id": sid})


def test_with_cpu_idle_a_long_computation_is_an_idle_group_until_it_ends(demand_dir):
    """serve --cpu-idle: a computation that yields becomes an idle cgroup
    (cpu.idle 1, its history saying so) with its quota untouched, and its
    weight and cpu.idle 0 come back when it ends; the sandboxes' parent is
    idle while it holds the CPU exactly when the server has judged a whole
    window in which the host's processes did not contend (never while one is
    gathered), and not once nothing holds the CPU."""
    srv = sh.start_server(["--cpu-idle", "--cpu-demand-dir", demand_dir + "-idle"])
    try:
        sid, kc, _ = srv.open_session()
        need_cpu_controller(sid)
        if cpu_idle(sid) is None:
            pytest.skip("no cpu.idle on this kernel (Linux 5.15 and later)")

        def cpu_info():
            return srv.ok("server_info_request", {})["content"]["cpu"]

        # It yields once it has had 5% of a core over 2 s: a busy host may be slow to give it.
        msg_id = kc.execute(SPIN.format(s=12))
        assert wait_for(lambda: cpu_idle(sid) == 1, timeout=20), \
            (cpu_idle(sid), cpu_events(srv, sid))
        yielding = [e for e in cpu_events(srv, sid) if e["kind"] == "cpu_yielding"]
        assert yielding and "an idle cgroup" in yielding[0]["detail"], cpu_events(srv, sid)
        assert cpu_quota(sid) == 100000
        # Sampled until the computation ends. On a busy host the session can
        # stop holding the CPU for a while (an idle parent gives the host's
        # processes the CPU first), so every sample is judged as it comes.
        seen = set()
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, ("the computation did not end", cpu_info())
            cpu = cpu_info()
            verdict = cpu["host_contention"]
            if cpu["hogging_sessions"] == 1 and verdict.startswith("they"):
                # A whole window judged: idle exactly when the host was calm.
                assert cpu["sandboxes_idle"] == verdict.startswith("they do not contend"), cpu
                seen.add(cpu["sandboxes_idle"])
            elif not verdict.startswith("they do not contend"):
                # Gathering a window, counted, or nothing holds the CPU: never idle.
                assert cpu["sandboxes_idle"] is False, cpu
            try:
                msg = kc.get_shell_msg(timeout=0.1)
            except Exception:  # queue.Empty: still computing
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                break
        assert msg["content"]["status"] == "ok", msg["content"]
        assert seen, "no whole window was judged while the session held the CPU"
        assert wait_for(lambda: (cpu_idle(sid), cpu_shares(sid)) == (0, 1024), timeout=10), \
            (cpu_idle(sid), cpu_shares(sid), cpu_events(srv, sid))
        assert wait_for(lambda: cpu_info()["sandboxes_idle"] is False, timeout=10), cpu_info()
        srv.ok("session_close_request", {"session_id": sid})
    finally:
        problems = srv.shutdown()
    assert not problems, "\n".join(problems)


def test_the_weight_counts_every_servers_sessions_on_the_host(server, demand_dir):  # noqa: E501
    """Two servers on one host share the sandboxes' parent cgroup: its weight
    follows the sessions of both (each publishes its own under the demand
    dir), not whichever wrote last; when one stops, the other's figure is
    what is left."""
    other = sh.start_server(["--cpu-demand-dir", demand_dir])
    stop = threading.Event()
    threads = []
    try:
        ours = [server.open_session() for _ in range(2)]
        theirs = [other.open_session()]
        need_cpu_controller(ours[0][0])

        def host(srv):
            cpu = srv.ok("server_info_request", {})["content"]["cpu"]
            return cpu["host"], cpu["sandboxes_weight"]

        threads = stepping(ours, stop) + stepping(theirs, stop)
        both = ({"interactive_sessions": 3, "hogging_sessions": 0, "servers": 2}, 3 * 1024)
        assert wait_for(lambda: host(server) == both and host(other) == both, timeout=10), \
            (host(server), host(other))
        assert len(os.listdir(demand_dir)) == 2
        if not other_servers(server.proc.pid, other.proc.pid):
            assert wait_for(lambda: parent_shares() == 3 * 1024, timeout=2), parent_shares()
        stop.set()
        for t in threads:
            t.join()
        threads = []
        problems = other.shutdown()
        assert not problems, "\n".join(problems)
        other = None
        assert os.listdir(demand_dir) and len(os.listdir(demand_dir)) == 1
        assert wait_for(lambda: host(server) == ({"interactive_sessions": 0,
                                                  "hogging_sessions": 0, "servers": 1}, 1024),
                        timeout=10), host(server)
        for sid, _, _ in ours:
            server.ok("session_close_request", {"session_id": sid})
    finally:
        stop.set()
        for t in threads:
            t.join()
        if other is not None:
            other.shutdown()


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
    def pooled():
        # The warm sandboxes the pool holds, as it lists them: not a refill
        # still being forked (its cgroup exists, at the low weight, before its
        # processes do), nor the zygote the pool's sessions come from.
        warm = server.ok("session_list_request", {})["content"]["warm_sandboxes"]
        return [w["container_id"][3:] for w in warm if cpu_shares(w["container_id"][3:]) is not None]

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


def test_loud_cpus_that_are_no_list_or_not_the_servers_are_refused_at_start():
    for value, words in (("4096", "CPU 4096 is not one this server may run on"),
                         ("1,", "is not a list of CPUs"),
                         ("3-1", "a range runs upwards")):
        run = sh.serve_once("--loud-cpus", value)
        assert run.returncode != 0, (value, run.stdout, run.stderr)
        assert "--loud-cpus: " in run.stderr and words in run.stderr, (value, run.stderr)


def test_a_sandbox_kept_off_a_cpu_is_widened_by_a_next_start_keeping_no_cpu_apart(
        server_factory, demand_dir):  # noqa: F811
    srv = server_factory(["--cpu-demand-dir", demand_dir, "--loud-cpus", "auto",
                          "--loud-cpus-for", "holding", "--adopt-grace", "120",
                          "--pool", "host=0"])
    loud, every = loud_and_all_cpus(srv)
    if not loud:
        pytest.skip("--loud-cpus auto keeps nothing apart on one CPU")
    sid, kc, _ = srv.open_session()
    need_cpu_controller(sid)
    assert execute(kc, BACKGROUND_SPIN)[0]["content"]["status"] == "ok"
    # Demoted while it spins: on the loud CPUs only.
    assert wait_for(lambda: cpuset_cpus(sid) == loud, timeout=30), cpuset_cpus(sid)
    # A crash; the next start keeps no CPU apart and adopts the sandbox,
    # still spinning: it must not stay off the CPU kept free before.
    srv.kill9()
    srv.args = ["--cpu-demand-dir", demand_dir, "--loud-cpus", "all", "--adopt-grace", "120",
                "--pool", "host=0"]
    srv.start()
    assert f"session {sid}: adopted" in srv.log(), srv.log()[-3000:]
    assert srv.ok("server_info_request", {})["content"]["cpu"]["loud_cpus"] in ("", None)
    assert wait_for(lambda: cpuset_cpus(sid) == every, timeout=10), cpuset_cpus(sid)
    assert counter(kc) > 0  # the same kernel, its thread still counting
    execute(kc, "state['stop'] = True")
    srv.ok("session_close_request", {"session_id": sid})


# Grows 16 MiB at a time (every page new, so zeroed by the kernel: a
# memory bomb's pace per second of CPU) with a tenth of a second's sleep
# between, to 480 MiB over ~4.5 s, then spins with its memory steady.
GROW_THEN_SPIN = """
import time
x = []
while len(x) < 30:
    x.append(b'\\x01' * (16 << 20))
    time.sleep(0.1)
t = time.time()
while time.time() - t < {s}: pass
len(x)
"""


def test_by_default_sessions_holding_the_cpu_are_kept_off_a_cpu_while_a_memory_bomb_is(
        server_factory, demand_dir):  # noqa: F811
    """The default (--loud-cpus auto, --loud-cpus-for growing): cells that
    only spin yield their weight and stay on every CPU; once one session's
    memory grows while it holds the CPU (a memory bomb's page zeroing slows
    what shares its CPU, beyond any weight), it and every other session
    holding the CPU are kept to the loud CPUs (the bomb alone apart would
    leave the free CPU to the spinners), and all are back on every CPU once
    its memory has stayed put for seconds, its cell still running."""
    srv = server_factory(["--cpu-demand-dir", demand_dir, "--pool", "host=0"])
    cpu = srv.ok("server_info_request", {})["content"]["cpu"]
    assert cpu["loud_cpus_for"] == "growing", cpu
    loud, every = loud_and_all_cpus(srv)
    if len(every) < 2:
        assert loud is None, cpu
        pytest.skip("--loud-cpus auto keeps nothing apart on one CPU")
    assert loud == every - {min(every)}, (loud, every)

    sid, kc, _ = srv.open_session()
    spinner, skc, _ = srv.open_session()
    need_cpu_controller(sid)
    spin = kc.execute(SPIN.format(s=6))
    if wait_for(lambda: cpu_shares(sid) == 128, timeout=6):
        for _ in range(4):  # yielding, and still on every CPU
            assert cpuset_cpus(sid) == every, cpuset_cpus(sid)
            time.sleep(0.5)
    assert run_until_reply(kc, spin)["content"]["status"] == "ok"
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=10), cpu_shares(sid)
    events = cpu_events(srv, sid)
    assert not any("memory" in e["kind"] or "memory grows" in e["detail"] for e in events), events

    # A neighbour holds the CPU throughout, on every CPU until the bomb.
    long_spin = skc.execute(SPIN.format(s=24))  # under the 30 s execution timeout
    assert wait_for(lambda: cpu_shares(spinner) == 128, timeout=15), cpu_shares(spinner)
    assert cpuset_cpus(spinner) == every, cpuset_cpus(spinner)

    grow = kc.execute(GROW_THEN_SPIN.format(s=12))
    assert wait_for(lambda: cpuset_cpus(sid) == loud, timeout=20), (cpuset_cpus(sid),
                                                                   cpu_events(srv, sid))
    assert wait_for(lambda: cpuset_cpus(spinner) == loud, timeout=2), cpuset_cpus(spinner)
    # Its memory stays put while it spins on: every CPU again, still yielding.
    assert wait_for(lambda: cpuset_cpus(sid) == every, timeout=20), (cpuset_cpus(sid),
                                                                    cpu_events(srv, sid))
    assert wait_for(lambda: cpuset_cpus(spinner) == every, timeout=2), cpuset_cpus(spinner)
    assert cpu_shares(sid) < 1024
    reply = run_until_reply(kc, grow)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert wait_for(lambda: cpu_shares(sid) == 1024, timeout=10), cpu_shares(sid)
    assert cpuset_cpus(sid) == every
    events = cpu_events(srv, sid)[len(events):]
    kinds = [e["kind"] for e in events]
    growing = [e for e in events if "its memory grows" in e["detail"]]
    assert growing and growing[0]["kind"] in ("cpu_yielding", "cpu_memory_growing"), events
    assert "cpu_memory_steady" in kinds and kinds[-1] == "cpu_restored", events
    assert not any("memory" in e["kind"] for e in cpu_events(srv, spinner))
    assert run_until_reply(skc, long_spin)["content"]["status"] == "ok"
    assert f"session {spinner}: kept to CPUs" in srv.log(), srv.log()[-3000:]
    srv.ok("session_close_request", {"session_id": sid})
    srv.ok("session_close_request", {"session_id": spinner})
