"""Kernel mode is governed like a `serve` session: limits from `kernelspec
install --limit` reach `cellblock kernel`, and its execution cap, execution
timeout, idle timeout, lifetime, output shaping and metadata.cellblock are
those of the server. An interrupt that the code ignores is escalated to a
kill after interrupt_grace_s, in kernel mode and in server mode, and the
frontend can start a fresh kernel.

Each test installs its own kernelspec (a real `cellblock kernelspec install`)
into a temporary prefix and starts it through jupyter_client."""
import json
import os
import subprocess
import tempfile
import time

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from server_helpers import (clients, collect_execution, drain, execute, server,  # noqa: F401
                            session_pids, stream_text, wait_for)

CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
IGNORES_SIGINT = ("import signal\n"
                  "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "while True: pass")
CELLBLOCK_METADATA = ("executions_used", "executions_left", "max_executions", "wall_ms", "cpu_ms",
                      "memory_peak_bytes", "output_bytes", "output_truncated",
                      "output_dropped_bytes", "timeout_s")


def install_kernelspec(prefix, *limits, name="cb-policy"):
    """`cellblock kernelspec install --prefix PREFIX --limit k=v ...`; returns kernel.json."""
    args = [CELLBLOCK_BIN, "kernelspec", "install", "--prefix", prefix, "--name", name]
    for item in limits:
        args += ["--limit", item] if "=" in item else [item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    path = os.path.join(prefix, "share", "jupyter", "kernels", name, "kernel.json")
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def governed_kernel():
    """Starts a kernel with the given limits: start(*"k=v", image=, env=) -> (spec, km, kc)."""
    started = []
    prefix = tempfile.mkdtemp(prefix="cellblock-kspec-")

    def start(*limits, image=None, env=None, stderr=None):
        spec = install_kernelspec(prefix, *limits, *(["--image", image] if image else []))
        ksm = KernelSpecManager(kernel_dirs=[os.path.join(prefix, "share", "jupyter", "kernels")])
        km = KernelManager(kernel_name="cb-policy", kernel_spec_manager=ksm)
        km.start_kernel(env=dict(os.environ, **(env or {})), **({"stderr": stderr} if stderr else {}))
        kc = km.client()
        kc.start_channels()
        started.append((km, kc))
        kc.wait_for_ready(timeout=60)
        return spec, km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def exit_code(km, timeout):
    """Waits for the kernel process (cellblock kernel) to exit; returns its code."""
    process = km.provisioner.process
    return process.wait(timeout=timeout)


def error_of(reply):
    c = reply["content"]
    assert c["status"] == "error", c
    return c["ename"], c["evalue"]


def assert_exits_1_and_restarts(km, kc):
    """A policy kill exits 1, as a memory kill does, so jupyter_client's
    restarter starts a new kernel; a restarted one answers."""
    assert exit_code(km, timeout=30) == 1
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    reply, iopub = execute(kc, "print(6 * 7)")
    assert reply["content"]["status"] == "ok" and stream_text(iopub) == "42\n"


def test_kernelspec_limits_reach_the_kernel_cap_and_metadata(governed_kernel):
    spec, km, kc = governed_kernel("max_executions=2", "exec_timeout_s=40")
    argv = spec["argv"]
    assert argv[1:4] == ["kernel", "-f", "{connection_file}"], argv
    assert sorted(zip(argv[4::2], argv[5::2])) == [("--limit", "exec_timeout_s=40"),
                                                   ("--limit", "max_executions=2")], argv
    for used in (1, 2):
        reply, iopub = execute(kc, f"print({used})")
        assert reply["content"]["status"] == "ok", reply["content"]
        cellblock = reply["metadata"]["cellblock"]
        assert set(CELLBLOCK_METADATA) <= set(cellblock), cellblock
        assert cellblock["executions_used"] == used and cellblock["executions_left"] == 2 - used
        assert cellblock["timeout_s"] == 40
        assert stream_text(iopub) == f"{used}\n"
    reply, iopub = execute(kc, "print('never runs')")
    ename, evalue = error_of(reply)
    assert ename == "ExecutionLimitExceeded", evalue
    assert evalue == "this session allows 2 executions; all 2 are used"
    assert stream_text(iopub) == ""
    assert km.is_alive()  # a refusal is not a kill


def test_the_images_limits_are_a_layer_under_the_kernelspecs(governed_kernel, tmp_path):
    """server defaults < the image's limits < --limit, as for a serve session."""
    source = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
    with open(os.path.join(source, "images", "host", "image.json")) as f:
        image = json.load(f)
    image["name"] = "limited"
    image["limits"].update({"max_executions": 1, "exec_timeout_s": 7})
    os.makedirs(tmp_path / "limited")
    with open(tmp_path / "limited" / "image.json", "w") as f:
        json.dump(image, f)
    _, km, kc = governed_kernel("exec_timeout_s=9", image="limited",
                                env={"CELLBLOCK_IMAGES_DIR": str(tmp_path)})
    reply, _ = execute(kc, "1")
    assert reply["metadata"]["cellblock"]["max_executions"] == 1  # the image's
    assert reply["metadata"]["cellblock"]["timeout_s"] == 9       # the kernelspec's, over the image's 7
    ename, _ = error_of(execute(kc, "2")[0])
    assert ename == "ExecutionLimitExceeded"


def test_kernelspec_install_refuses_a_bad_limit():
    prefix = tempfile.mkdtemp(prefix="cellblock-kspec-")
    for item, words in (("interrupt_grace_s=601", "above the server's maximum 600"),
                        ("no_such_limit=1", "unknown limit 'no_such_limit'"),
                        ("exec_timeout_s", "expected KEY=VALUE")):
        result = subprocess.run([CELLBLOCK_BIN, "kernelspec", "install", "--prefix", prefix,
                                 "--name", "bad", "--limit", item],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode != 0 and words in result.stderr, (item, result.stderr)
    assert not os.path.exists(os.path.join(prefix, "share", "jupyter", "kernels", "bad"))


def test_output_is_shaped_as_in_server_mode(governed_kernel):
    _, km, kc = governed_kernel("output_bytes=1000")
    reply, iopub = execute(kc, "print('x' * 5000)")
    assert reply["content"]["status"] == "ok"
    text = stream_text(iopub)
    assert text.startswith("x" * 1000) and "output truncated at 1000 bytes" in text, text[-200:]
    assert reply["metadata"]["cellblock"]["output_truncated"] is True
    assert reply["metadata"]["cellblock"]["output_dropped_bytes"] == 5001 - 1000


def test_execution_timeout_kills_code_that_ignores_sigint_and_the_frontend_restarts(
        governed_kernel):
    _, km, kc = governed_kernel("exec_timeout_s=2")
    t0 = time.monotonic()
    reply, iopub = execute(kc, IGNORES_SIGINT, timeout=60)
    took = time.monotonic() - t0
    ename, evalue = error_of(reply)
    assert ename == "ExecutionTimeout", evalue
    assert "timeout of 2 s" in evalue and "killed" in evalue, evalue
    assert [m["content"]["ename"] for m in iopub if m["msg_type"] == "error"] == ["ExecutionTimeout"]
    assert took >= 2, took
    assert_exits_1_and_restarts(km, kc)


def test_idle_timeout_ends_the_kernel(governed_kernel):
    _, km, kc = governed_kernel("idle_timeout_s=3")
    reply, _ = execute(kc, "1")
    assert reply["content"]["status"] == "ok"
    t0 = time.monotonic()
    assert exit_code(km, timeout=60) == 0  # the policy ended it, not a crash
    assert time.monotonic() - t0 >= 2, "closed before its idle timeout"


def test_hibernate_after_holds_in_kernel_mode(governed_kernel, tmp_path):
    """Idle past hibernate_after_s, `cellblock kernel` saves its session and
    lets the sandbox go; the frontend's next request wakes it in a new
    sandbox with its state and its prompt count."""
    # What a `cellblock kernel` killed while its session slept left behind
    # (no process has this pid): the next kernel removes it.
    orphan = "/run/cellblock/kernel-snapshots/999999999-1"
    os.makedirs(os.path.join(orphan, "s"), exist_ok=True)
    log_path = tmp_path / "kernel.log"
    with open(log_path, "w") as log:
        _, km, kc = governed_kernel("hibernate_after_s=2", stderr=log)
    assert not os.path.exists(orphan)
    reply, _ = execute(kc, "kept = [6, 7]")
    assert reply["content"]["status"] == "ok"
    count = reply["content"]["execution_count"]
    assert wait_for(lambda: "snapshot kept" in log_path.read_text(), timeout=120), \
        log_path.read_text()
    reply, iopub = execute(kc, "print(kept[0] * kept[1])", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert stream_text(iopub) == "42\n"
    assert reply["content"]["execution_count"] == count + 1
    assert reply["metadata"]["cellblock"]["resumed_ms"] > 0, reply["metadata"]
    assert "waking in a new sandbox" in log_path.read_text()
    assert km.is_alive()


def test_lifetime_ends_the_kernel_even_while_used(governed_kernel):
    _, km, kc = governed_kernel("lifetime_s=6", "idle_timeout_s=600")
    started = time.monotonic()
    replies = []
    while km.is_alive() and time.monotonic() - started < 60:
        kc.execute("1")
        try:
            replies.append(kc.get_shell_msg(timeout=2))
        except Exception:  # the kernel went away mid-request
            pass
        time.sleep(0.3)
    assert not km.is_alive(), "the kernel outlived its lifetime"
    assert exit_code(km, timeout=10) == 0
    assert any(r["content"]["status"] == "ok" for r in replies)


def test_ignored_interrupt_is_escalated_to_a_kill_and_the_frontend_restarts(governed_kernel):
    _, km, kc = governed_kernel("interrupt_grace_s=2", "exec_timeout_s=600")
    assert km.kernel_spec.interrupt_mode == "message"
    msg_id = kc.execute(IGNORES_SIGINT)
    time.sleep(1.5)  # the loop is running
    t0 = time.monotonic()
    km.interrupt_kernel()  # an interrupt_request on control, as a frontend sends it
    reply, iopub, _ = collect_execution(kc, msg_id, timeout=60)
    took = time.monotonic() - t0
    ename, evalue = error_of(reply)
    assert ename == "InterruptIgnored", evalue
    assert "within 2 s" in evalue and "interrupt_request" in evalue, evalue
    assert [m["content"]["ename"] for m in iopub if m["msg_type"] == "error"] == ["InterruptIgnored"]
    assert took >= 1.9, f"killed {took:.1f} s after the interrupt, before its 2 s grace"
    assert_exits_1_and_restarts(km, kc)


def test_an_honoured_interrupt_is_not_escalated(governed_kernel):
    _, km, kc = governed_kernel("interrupt_grace_s=1", "exec_timeout_s=600")
    msg_id = kc.execute("import time\nwhile True: time.sleep(0.01)")
    time.sleep(1.5)
    km.interrupt_kernel()
    reply, _, _ = collect_execution(kc, msg_id, timeout=30)
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    time.sleep(2)  # past the grace: nothing is killed
    assert km.is_alive()
    reply, iopub = execute(kc, "print('alive')")
    assert reply["content"]["status"] == "ok" and stream_text(iopub) == "alive\n"


def test_server_mode_escalates_an_ignored_interrupt(clients):  # noqa: F811
    server = clients
    sid, kc, _ = server.open_session(limits={"interrupt_grace_s": 2, "exec_timeout_s": 600})
    pids = session_pids(sid)
    msg = kc.session.msg("execute_request", dict(code=IGNORES_SIGINT, silent=False,
                                                 store_history=True, user_expressions={},
                                                 allow_stdin=False, stop_on_error=True))
    kc.shell_channel.send(msg)
    time.sleep(1.5)
    t0 = time.monotonic()
    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    reply, iopub, _ = collect_execution(kc, msg["header"]["msg_id"], timeout=60)
    took = time.monotonic() - t0
    ename, evalue = error_of(reply)
    assert ename == "InterruptIgnored", evalue
    assert took >= 1.9, took
    info = server.info_of(sid)
    assert info["state"] == "closed" and info["close_reason"] == "interrupt_ignored", info
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), timeout=30)
    reply, _ = execute(kc, "print(1)")
    ename, evalue = error_of(reply)
    assert ename == "SessionClosed" and "interrupt_ignored" in evalue, evalue
    history = server.ok("session_history_request", {"session_id": sid})["content"]
    assert history["executions"][-1]["ename"] == "InterruptIgnored", history["executions"]
    kinds = [e["kind"] for e in history["events"]]
    assert kinds.index("interrupted") < kinds.index("killed") < kinds.index("closed"), history["events"]
    drain(kc.get_control_msg)


def test_jupyter_clients_restarter_brings_a_killed_kernel_back(tmp_path):
    """What Notebook does: AsyncIOLoopKernelManager's restarter sees the
    `cellblock kernel` process exit after the timeout kill and starts a new one
    on the same ports; the same client then runs code again."""
    import asyncio
    from jupyter_client.ioloop import AsyncIOLoopKernelManager

    prefix = str(tmp_path)
    install_kernelspec(prefix, "exec_timeout_s=2")
    ksm = KernelSpecManager(kernel_dirs=[os.path.join(prefix, "share", "jupyter", "kernels")])

    async def scenario():
        km = AsyncIOLoopKernelManager(kernel_name="cb-policy", kernel_spec_manager=ksm)
        restarted = asyncio.Event()
        await km.start_kernel()
        km.add_restart_callback(restarted.set, "restart")  # needs the restarter start_kernel made
        # A kernel that dies in its first 10 s (stable_start_time) is restarted
        # on new ports; a notebook's kernel is older and keeps them, as here.
        km._restarter.random_ports_until_alive = False
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            msg_id = kc.execute(IGNORES_SIGINT)
            while True:
                reply = await kc.get_shell_msg(timeout=60)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            assert reply["content"]["ename"] == "ExecutionTimeout", reply["content"]
            await asyncio.wait_for(restarted.wait(), timeout=60)
            await kc.wait_for_ready(timeout=60)
            msg_id = kc.execute("print('restarted')")
            while True:
                reply = await kc.get_shell_msg(timeout=60)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            assert reply["content"]["status"] == "ok", reply["content"]
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())
