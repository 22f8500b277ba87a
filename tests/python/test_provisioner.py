"""cellblock-provisioner: frontends take their kernels from a running `cellblock serve`.

The Python client is installed with pip into a temporary directory, as a user
would install it, so jupyter_client finds the provisioner through the entry
point pyproject.toml declares. `cellblock kernelspec install --provisioner`
writes the kernelspec. Then jupyter_client's KernelManager, nbclient,
`jupyter nbconvert --execute`, `jupyter console` and the Notebook (in headless
Chromium) run code through it unchanged, and each kernel is a session of the
server: in its registry, under its policy, closed when the frontend is done.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from server_helpers import collect_execution, execute, start_server, stream_text, wait_for

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CLIENT_DIR = os.path.join(SOURCE_DIR, "clients", "python")
CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
KERNEL = "cellblock-served"
IGNORES_SIGINT = ("import signal\n"
                  "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "while True: pass")


class Provisioned:
    """A server, the client installed with pip, and a provisioner kernelspec."""

    def __init__(self, root):
        # Its own server key: a test restarts the server (SIGHUP).
        self.server = start_server(["--key-file", os.path.join(root, "server.key")])
        source = os.path.join(root, "src")
        shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                           "*.egg-info"))
        self.site = os.path.join(root, "site")
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                              "--no-build-isolation", "--no-index", "--target", self.site, source],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        prefix = os.path.join(root, "prefix")
        self.server_file = os.path.join(self.server.state_dir, "server.json")
        out = subprocess.run([CELLBLOCK_BIN, "kernelspec", "install", "--provisioner", "--prefix",
                              prefix, "--name", KERNEL, "--server-file", self.server_file,
                              "--limit", "interrupt_grace_s=2", "--limit", "exec_timeout_s=120"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        self.kernels_dir = os.path.join(prefix, "share", "jupyter", "kernels")
        with open(os.path.join(self.kernels_dir, KERNEL, "kernel.json")) as f:
            self.spec = json.load(f)
        self.env = dict(os.environ)
        self.env["JUPYTER_PATH"] = os.pathsep.join(
            [os.path.join(prefix, "share", "jupyter"), os.environ.get("JUPYTER_PATH", "")])
        self.env["PYTHONPATH"] = self.site

    def sessions(self, open_only=False):
        return self.server.ok("session_list_request", {"open_only": open_only})["content"]["sessions"]

    def session_of(self, kernel_id):
        """The server's session whose registry metadata names this kernel."""
        found = []
        for s in self.sessions():
            info = self.server.info_of(s["session_id"])
            if info.get("metadata", {}).get("kernel_id") == kernel_id:
                found.append(info)
        return found

    def kernel_manager(self):
        return KernelManager(kernel_name=KERNEL,
                             kernel_spec_manager=KernelSpecManager(kernel_dirs=[self.kernels_dir]))


@pytest.fixture(scope="module")
def provisioned():
    root = tempfile.mkdtemp(prefix="cellblock-provisioner-")
    p = Provisioned(root)
    # In this process too, jupyter_client finds the provisioner through the installed entry point.
    sys.path.insert(0, p.site)
    yield p
    sys.path.remove(p.site)
    p.server.close_clients()
    problems = p.server.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    assert not problems, "\n".join(problems)


def test_the_kernelspec_names_the_provisioner_and_its_server(provisioned):
    meta = provisioned.spec["metadata"]["kernel_provisioner"]
    assert meta["provisioner_name"] == "cellblock-provisioner"
    assert meta["config"] == {"server_file": provisioned.server_file,
                              "limits": {"exec_timeout_s": 120, "interrupt_grace_s": 2}}
    assert provisioned.spec["interrupt_mode"] == "message"
    from jupyter_client.provisioning import KernelProvisionerFactory
    entries = KernelProvisionerFactory.instance().get_provisioner_entries()
    assert entries.get("cellblock-provisioner") == "cellblock.provisioner:CellblockProvisioner", entries


def pool_ready(server):
    return server.ok("server_info_request", {})["content"]["pool"]["host"]["ready"] >= 1


def test_kernel_manager_start_interrupt_restart_shutdown(provisioned):
    assert wait_for(lambda: pool_ready(provisioned.server), timeout=120), "the pool never filled"
    km = provisioned.kernel_manager()
    started = time.monotonic()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        print(f"kernel ready through the provisioner in {1000 * (time.monotonic() - started):.0f} ms")
        assert type(km.provisioner).__name__ == "CellblockProvisioner"
        assert km.provisioner.started_warm, "a kernel from a server with a full pool was not warm"
        [session] = provisioned.session_of(km.kernel_id)
        assert session["state"] != "closed" and session["limits"]["interrupt_grace_s"] == 2

        reply, iopub = execute(kc, "print(6 * 7)")
        assert reply["content"]["status"] == "ok" and stream_text(iopub) == "42\n"
        assert reply["metadata"]["cellblock"]["timeout_s"] == 120  # the kernelspec's limit

        # Interrupt by message, through the server.
        msg_id = kc.execute("import time\nwhile True: time.sleep(0.01)")
        time.sleep(1)
        km.interrupt_kernel()
        reply, _, _ = collect_execution(kc, msg_id, timeout=30)
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        # A frontend that signals instead (signal_kernel): the provisioner sends the message.
        msg_id = kc.execute("import time\nwhile True: time.sleep(0.01)")
        time.sleep(1)
        km.signal_kernel(signal.SIGINT)
        reply, _, _ = collect_execution(kc, msg_id, timeout=30)
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]

        # Restart: the session is closed and another one takes its place, on
        # the new session's ports, so the client reconnects (as Notebook does).
        km.restart_kernel(now=False)
        kc.stop_channels()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        sessions = provisioned.session_of(km.kernel_id)
        assert len(sessions) == 2, sessions
        old = next(s for s in sessions if s["session_id"] == session["session_id"])
        assert old["state"] == "closed", old
        reply, iopub = execute(kc, "print('fresh', 'x' in dir())")
        assert stream_text(iopub) == "fresh False\n"

        # The server's audit has the executions.
        history = provisioned.server.ok("session_history_request",
                                        {"session_id": session["session_id"]})["content"]
        assert [e["code"] for e in history["executions"]][0] == "print(6 * 7)"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert all(s["state"] == "closed" for s in provisioned.session_of(km.kernel_id))


def test_an_ignored_interrupt_kills_and_a_restart_gets_a_new_session(provisioned):
    km = provisioned.kernel_manager()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        msg_id = kc.execute(IGNORES_SIGINT)
        time.sleep(1)
        km.interrupt_kernel()
        reply, _, _ = collect_execution(kc, msg_id, timeout=30)
        assert reply["content"]["ename"] == "InterruptIgnored", reply["content"]
        # The provisioner reports the end like a process exit: code 1, as a killed `cellblock kernel`.
        assert wait_for(lambda: not km.is_alive(), timeout=15)
        assert km.provisioner.returncode == 1
        km.restart_kernel(now=True)
        kc.stop_channels()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        reply, iopub = execute(kc, "print('back')")
        assert stream_text(iopub) == "back\n"
        closed = [s for s in provisioned.session_of(km.kernel_id) if s["state"] == "closed"]
        assert [s["close_reason"] for s in closed] == ["interrupt_ignored"], closed
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def notebook(kernel_name):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": "cellblock", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint('uid', os.getuid())"),
                nbformat.v4.new_code_cell("6 * 7")]
    return nb


def test_nbclient(provisioned, monkeypatch):
    from nbclient import NotebookClient
    monkeypatch.setenv("JUPYTER_PATH", provisioned.env["JUPYTER_PATH"])
    before = {s["session_id"] for s in provisioned.sessions()}
    nb = notebook(KERNEL)
    NotebookClient(nb, timeout=60, startup_timeout=60).execute()
    assert nb.cells[0].outputs[0]["text"] == "uid 1000\n"
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "42"
    new = [s for s in provisioned.sessions() if s["session_id"] not in before]
    assert len(new) == 1 and new[0]["state"] == "closed", new


def test_nbconvert_execute(provisioned, tmp_path):
    before = {s["session_id"] for s in provisioned.sessions()}
    path = tmp_path / "served.ipynb"
    nbformat.write(notebook(KERNEL), str(path))
    run = subprocess.run(["/usr/bin/jupyter-nbconvert", "--to", "notebook", "--execute",
                          "--output", "done.ipynb", str(path)],
                         capture_output=True, text=True, timeout=300, env=provisioned.env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    done = nbformat.read(str(tmp_path / "done.ipynb"), as_version=4)
    assert done.cells[0].outputs[0]["text"] == "uid 1000\n"
    assert done.cells[1].outputs[0]["data"]["text/plain"] == "42"
    new = [s for s in provisioned.sessions() if s["session_id"] not in before]
    assert len(new) == 1 and new[0]["state"] == "closed", new


def test_jupyter_console(provisioned):
    from test_console import JUPYTER_CONSOLE, Terminal
    before = {s["session_id"] for s in provisioned.sessions()}
    env = dict(provisioned.env, TERM="xterm-256color")
    term = Terminal([JUPYTER_CONSOLE, "--kernel", KERNEL], env)
    try:
        term.prompt(1, timeout=90)
        mark = term.type_line("print(6*7)")
        term.expect(r"^42$", mark)
        term.prompt(2, mark)
        new = [s for s in provisioned.sessions(open_only=True) if s["session_id"] not in before]
        assert len(new) == 1, new
        mark = term.type_line("exit")
        status, signal = term.wait_exit(timeout=60)
        assert (status, signal) == (0, None), term.text[mark:]
    finally:
        term.kill()
    # The console sends shutdown_request and exits without waiting for the
    # reply; the server closes the session when the kernel answers (or after
    # its shutdown grace), which may be just after the console is gone.
    sid = new[0]["session_id"]
    closed = wait_for(lambda: provisioned.server.info_of(sid)["state"] == "closed", timeout=30)
    info = provisioned.server.info_of(sid)
    assert closed, info
    assert info["close_reason"] == "shutdown requested by the client", info


def test_notebook_in_chromium(provisioned, monkeypatch, tmp_path):
    """Notebook 6 in headless Chromium (tests/frontend/run_notebook.js, as in
    test_frontends.py) runs a notebook whose kernel is a session of the server."""
    from test_frontends import CHROMIUM, FRONTEND_DIR, NOTEBOOK_APP, NotebookServer
    for path in (NOTEBOOK_APP, CHROMIUM, os.path.join(FRONTEND_DIR, "node_modules", "playwright-core")):
        assert os.path.exists(path), f"{path} missing: scripts/setup.sh installs it"
    before = {s["session_id"] for s in provisioned.sessions()}
    monkeypatch.setenv("JUPYTER_PATH", provisioned.env["JUPYTER_PATH"])
    monkeypatch.setenv("PYTHONPATH", provisioned.site)
    server = NotebookServer(str(tmp_path / "server"))
    try:
        nbformat.write(notebook(KERNEL), os.path.join(server.notebook_dir, "served.ipynb"))
        run = subprocess.run(
            ["node", os.path.join(FRONTEND_DIR, "run_notebook.js"), "--url", server.url,
             "--token", server.token, "--notebook", "served.ipynb",
             "--screenshot", str(tmp_path / "served.png"), "--chromium", CHROMIUM,
             "--timeout-ms", "120000"],
            capture_output=True, text=True, timeout=300, cwd=FRONTEND_DIR)
        assert run.returncode == 0, f"{run.stderr}\n{run.stdout}\n{server.log_text()[-4000:]}"
        page = json.loads(run.stdout)
    finally:
        server.stop()
    assert page["kernelName"] == KERNEL
    cells = page["cells"]
    assert not any(c["errors"] for c in cells), cells
    assert cells[0]["stdout"].strip() == "uid 1000"
    assert page["kernelsAfter"] == [], page
    new = [s for s in provisioned.sessions() if s["session_id"] not in before]
    assert len(new) == 1, new
    # Close and Halt closed the session on the server.
    assert wait_for(lambda: provisioned.server.info_of(new[0]["session_id"])["state"] == "closed",
                    timeout=30)


def sleepy_kernel(provisioned):
    """A provisioner kernelspec whose sessions hibernate after 3 idle seconds."""
    name = KERNEL + "-sleepy"
    prefix = os.path.dirname(os.path.dirname(os.path.dirname(provisioned.kernels_dir)))
    out = subprocess.run([CELLBLOCK_BIN, "kernelspec", "install", "--provisioner", "--prefix",
                          prefix, "--name", name, "--server-file", provisioned.server_file,
                          "--limit", "hibernate_after_s=3"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return name


def test_notebook_in_chromium_keeps_working_after_the_kernel_slept(provisioned, monkeypatch,
                                                                    tmp_path):
    """Notebook 6 in headless Chromium: the kernel (a session with
    hibernate_after_s) sleeps while the page sits open, and a new cell then
    runs in it with the state the first cells left."""
    from test_frontends import CHROMIUM, FRONTEND_DIR, NOTEBOOK_APP, NotebookServer
    for path in (NOTEBOOK_APP, CHROMIUM, os.path.join(FRONTEND_DIR, "node_modules", "playwright-core")):
        assert os.path.exists(path), f"{path} missing: scripts/setup.sh installs it"
    name = sleepy_kernel(provisioned)
    before = {s["session_id"] for s in provisioned.sessions()}
    monkeypatch.setenv("JUPYTER_PATH", provisioned.env["JUPYTER_PATH"])
    monkeypatch.setenv("PYTHONPATH", provisioned.site)
    server = NotebookServer(str(tmp_path / "server"))
    slept = tmp_path / "slept"
    try:
        nb = notebook(name)
        nb.cells.append(nbformat.v4.new_code_cell("kept = 6 * 7"))
        nbformat.write(nb, os.path.join(server.notebook_dir, "sleepy.ipynb"))
        node = subprocess.Popen(
            ["node", os.path.join(FRONTEND_DIR, "run_notebook.js"), "--url", server.url,
             "--token", server.token, "--notebook", "sleepy.ipynb",
             "--screenshot", str(tmp_path / "sleepy.png"), "--chromium", CHROMIUM,
             "--timeout-ms", "120000", "--then-when-file", str(slept),
             "--then-code", "print(kept, Out[2])"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=FRONTEND_DIR)
        try:
            def new_session():
                new = [s for s in provisioned.sessions(open_only=True) if s["session_id"] not in before]
                return new[0]["session_id"] if new else None
            sid = wait_for(new_session, timeout=120, interval=0.5)
            assert sid, "no session for the notebook's kernel"
            assert wait_for(lambda: provisioned.server.info_of(sid)["state"] == "hibernated",
                            timeout=180, interval=0.5), (
                provisioned.server.info_of(sid)["state"],
                provisioned.server.ok("session_history_request",
                                      {"session_id": sid})["content"]["events"])
            slept.write_text("asleep")
            out, err = node.communicate(timeout=300)
        finally:
            if node.poll() is None:
                node.kill()
                node.communicate()
        assert node.returncode == 0, f"{err}\n{out}\n{server.log_text()[-4000:]}"
        page = json.loads(out)
    finally:
        server.stop()
    cells = page["cells"]
    assert not any(c["errors"] for c in cells), cells
    then = page["thenCell"]
    assert not then["errors"], then
    assert then["stdout"].strip() == "42 42", then
    assert then["prompt"] == "In [4]:", then  # the count goes on across the sleep
    kinds = [e["kind"] for e in provisioned.server.ok(
        "session_history_request", {"session_id": sid})["content"]["events"]]
    assert "hibernated" in kinds and "resumed" in kinds, kinds
    assert page["kernelsAfter"] == [], page


def console_with_state(provisioned, kernel_name):
    """`jupyter console` on a provisioned kernel of `kernel_name`, with
    `kept = 6 * 7` run at its first prompt: (the terminal, the session id)."""
    from test_console import JUPYTER_CONSOLE, Terminal
    before = {s["session_id"] for s in provisioned.sessions()}
    env = dict(provisioned.env, TERM="xterm-256color")
    term = Terminal([JUPYTER_CONSOLE, "--kernel", kernel_name], env)
    try:
        term.prompt(1, timeout=90)
        mark = term.type_line("kept = 6 * 7")
        term.prompt(2, mark)
        [new] = [s for s in provisioned.sessions(open_only=True) if s["session_id"] not in before]
    except BaseException:
        term.kill()
        raise
    return term, new["session_id"]


def test_a_kernel_idle_past_hibernate_after_sleeps_and_the_console_wakes_it(provisioned):
    """hibernate_after_s in the kernelspec's limits: the provisioned kernel
    hibernates while `jupyter console` sits at its prompt (its heartbeats do
    not wake it), and the next line the user types wakes it with its state."""
    term, sid = console_with_state(provisioned, sleepy_kernel(provisioned))
    try:
        assert provisioned.server.info_of(sid)["limits"]["hibernate_after_s"] == 3
        assert wait_for(lambda: provisioned.server.info_of(sid)["state"] == "hibernated",
                        timeout=120), provisioned.server.info_of(sid)
        time.sleep(4)  # heartbeats go on; the console must not call the kernel dead
        assert provisioned.server.info_of(sid)["state"] == "hibernated"
        mark = term.type_line("print(kept)")
        term.expect(r"^42$", mark, timeout=120)
        term.prompt(3, mark)
        assert "restarting" not in term.text[mark:].lower(), term.text[mark:]
        mark = term.type_line("exit")
        status, sig = term.wait_exit(timeout=60)
        assert (status, sig) == (0, None), term.text[mark:]
    finally:
        term.kill()
    kinds = [e["kind"] for e in provisioned.server.ok(
        "session_history_request", {"session_id": sid})["content"]["events"]]
    assert "hibernated" in kinds and "resumed" in kinds, kinds


def test_a_server_restart_is_invisible_to_the_console_and_its_provisioned_kernel(provisioned):
    """SIGHUP restarts the server under a `jupyter console` whose kernel the
    provisioner created (docs/restarts.md): the next line typed is answered
    with the earlier state, the prompt numbers go on, and neither the
    console nor jupyter_client's restarter sees a dead kernel."""
    srv = provisioned.server
    term, sid = console_with_state(provisioned, KERNEL)
    try:
        starts = srv.log().count("cellblock serve: manager on")
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: srv.log().count("cellblock serve: manager on") > starts,
                        timeout=120), srv.log()[-3000:]
        time.sleep(2)  # the console's heartbeats and the provisioner's polls go on
        mark = term.type_line("print(kept)")
        term.expect(r"^42$", mark, timeout=120)
        term.prompt(3, mark)
        assert "restarting" not in term.text.lower(), term.text[-2000:]
        mark = term.type_line("exit")
        status, sig = term.wait_exit(timeout=60)
        assert (status, sig) == (0, None), term.text[mark:]
    finally:
        term.kill()
    kinds = [e["kind"] for e in srv.ok(
        "session_history_request", {"session_id": sid})["content"]["events"]]
    # Its sandbox ran on through the restart: adopted, not woken from a snapshot.
    assert "handed_over" in kinds and "adopted" in kinds, kinds
    assert "hibernated" not in kinds, kinds

