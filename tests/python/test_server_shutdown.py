"""A stopping `cellblock serve`: it does not wait out a kernel that is slow to
start, it answers every request in flight (ServerShuttingDown), and its
state dir checks are the chosen backend's.

A stopping `cellblock serve` does not wait out a kernel that is slow to start.

The pool's workers probe each new kernel for up to 60 s. A server told to stop
while a probe waits used to hold its shutdown for the rest of that minute (seen
on a busy host: "did not exit within 60 s of SIGTERM"). Now the probe is
abandoned at once. The slow kernel here is an image whose kernel never binds
its sockets: only the abandonment can end its probe before 60 s.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

import server_helpers as sh

HERE = os.path.dirname(os.path.abspath(__file__))
HOST_IMAGE = os.path.join(HERE, "..", "..", "images", "host", "image.json")


def slow_image_dir():
    """An images dir holding `slowstart`: the host image with a kernel that only sleeps."""
    with open(HOST_IMAGE) as f:
        image = json.load(f)
    image["name"] = "slowstart"
    image["kernel_argv"] = ["/usr/bin/python3", "-c", "import time; time.sleep(600)"]
    image["zygote"] = False  # a kernel of its own: booted, not forked
    directory = tempfile.mkdtemp(prefix="cb-slowstart-images-")
    os.makedirs(os.path.join(directory, "slowstart"))
    with open(os.path.join(directory, "slowstart", "image.json"), "w") as f:
        json.dump(image, f)
    return directory


def test_sigterm_abandons_a_kernel_start_still_being_probed(monkeypatch):
    images = slow_image_dir()
    monkeypatch.setenv("CELLBLOCK_IMAGES_DIR", images)
    srv = sh.start_server(["--pool", "slowstart=1", "--pool", "host=0"])
    passed = False
    try:
        # The pool's sandbox is up and its probe is waiting for the kernel's sockets.
        box = sh.wait_for(lambda: [d for d in sh.sessions_on_disk(srv.state_dir)
                                   if sh.session_pids(d)], timeout=60, interval=0.2)
        assert box, f"the pool never started its slowstart sandbox:\n{srv.log()[-3000:]}"
        started = time.monotonic()
        # Exiting at all before the probe's own 60 s deadline proves the abandonment;
        # the bound given here only keeps a hung server from hanging the suite.
        srv.terminate(timeout=120)
        took = time.monotonic() - started
        log = srv.log()
        assert "its start was abandoned (the server is stopping)" in log, log[-3000:]
        assert "did not create its sockets in time" not in log, log[-3000:]
        print(f"serve exited {took:.1f} s after SIGTERM")
        assert sh.state_dir_residue(srv.state_dir) == {}, sh.state_dir_residue(srv.state_dir)
        passed = True
    finally:
        if srv.proc.poll() is None:
            srv.kill9()
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(srv.state_dir, ignore_errors=True)
        # The server's log is kept only when the test failed (it was left in /run before).
        if passed and os.path.exists(srv.log_path):
            os.unlink(srv.log_path)


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT])
def test_every_request_in_flight_at_a_shutdown_is_answered_naming_it(signo, monkeypatch):
    """A stopping server owes an answer to everything in flight: the running
    execution, the one queued behind it, and a create still waiting for its
    sandbox each get ServerShuttingDown naming the signal, never silence
    (SIGHUP used to end the server with the request unanswered; it now hands
    the sessions to the next start: test_restarts.py)."""
    images = slow_image_dir()
    monkeypatch.setenv("CELLBLOCK_IMAGES_DIR", images)
    srv = sh.start_server(["--pool", "host=1", "--pool", "slowstart=0"])
    name = signal.Signals(signo).name
    try:
        sid, kc, _ = srv.open_session()
        running = kc.execute("import time; time.sleep(60)")
        queued = kc.execute("print('never')")
        # The kernel has the first one: its busy status came back.
        def busy():
            msg = kc.get_iopub_msg(timeout=10)
            return (msg["parent_header"].get("msg_id") == running and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "busy")
        assert sh.wait_for(busy, timeout=30, interval=0), "the execution never started"
        waiting = srv.send("session_create_request", {"image": "slowstart"})
        time.sleep(1.0)  # the create is queued behind the slow kernel's start
        srv.proc.send_signal(signo)
        replies = {}
        deadline = time.monotonic() + 60
        while len(replies) < 2 and time.monotonic() < deadline:
            try:
                msg = kc.get_shell_msg(timeout=1)
            except Exception:
                continue
            replies[msg["parent_header"].get("msg_id")] = msg["content"]
        for msg_id in (running, queued):
            content = replies.get(msg_id)
            assert content is not None, f"no reply to {msg_id} after {name}: {replies}"
            assert content["status"] == "error" and content["ename"] == "ServerShuttingDown", content
            assert f"the server is shutting down ({name})" in content["evalue"], content
        create = srv.receive(waiting, timeout=30)
        assert create is not None, f"no session_create_reply after {name}"
        assert create["content"]["ename"] == "ServerShuttingDown", create["content"]
        assert name in create["content"]["evalue"], create["content"]
        assert srv.terminate(timeout=60) == 0
        assert sh.state_dir_residue(srv.state_dir, {sid}) == {}, sh.state_dir_residue(srv.state_dir)
    finally:
        srv.close_clients()
        if srv.proc.poll() is None:
            srv.kill9()
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(srv.state_dir, ignore_errors=True)
        if os.path.exists(srv.log_path):
            os.unlink(srv.log_path)


def serve_refusal(args, parent_mode=0o700):
    """`cellblock serve` with its state dir under a parent of `parent_mode`:
    its exit status and what it printed (it must not start)."""
    parent = tempfile.mkdtemp(prefix="cb-closed-parent-", dir="/run")
    os.chmod(parent, parent_mode)
    try:
        result = subprocess.run([sh.CELLBLOCK_BIN, "serve", "--state-dir",
                                 os.path.join(parent, "state"), *args],
                                capture_output=True, text=True, timeout=60)
        return result.returncode, result.stdout + result.stderr, parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_runc_refuses_a_state_dir_its_sandboxes_cannot_reach_naming_the_mode_in_octal():
    code, out, parent = serve_refusal([])
    assert code != 0, out
    assert f"{parent} (mode 0700) is not searchable by the sandboxes' mapped users" in out, out


def test_swarm_does_not_apply_runcs_state_dir_check():
    # No engine answers here: the refusal must be the engine's, not runc's
    # concern about a parent only root can search.
    code, out, _ = serve_refusal(["--backend", "swarm", "--swarm-docker-host",
                                  "unix:///run/cellblock-test-no-engine.sock"])
    assert code != 0, out
    assert "not searchable" not in out, out
    assert "no-engine.sock" in out, out
