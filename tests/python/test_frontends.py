"""Real Jupyter frontends on the cellblock-python kernelspec.

- Jupyter Notebook (Debian's classic notebook 6.x) on 127.0.0.1 with a token,
  driven in Debian's headless Chromium by tests/frontend/run_notebook.js
  (playwright-core from npm, installed by tests/frontend/install.sh): the page
  runs a print cell and a matplotlib cell through cellblock, must show the
  text and the PNG, and a screenshot is kept under
  <build>/test-artifacts/. File > Close and Halt must then leave nothing of
  the session's sandbox on the host.
- `jupyter nbconvert --to html --execute` on the same notebook: the HTML
  carries the PNG and the printed text, and the sandbox is gone afterwards.

`jupyter console` is covered by test_console.py. One notebook server and one
browser for the module keep this quick (it runs twice in CI, once under ASan).
"""
import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import nbformat
import pytest

from conftest import KERNEL_NAME, wait_for
from test_console import SESSION_LOG, sandbox_leftovers

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FRONTEND_DIR = os.path.join(SOURCE_DIR, "tests", "frontend")
CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
# The build tree that holds this cellblock: build/ or build-asan/.
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(CELLBLOCK_BIN))), "test-artifacts")
NOTEBOOK_APP = "/usr/bin/jupyter-notebook"
NBCONVERT = "/usr/bin/jupyter-nbconvert"
CHROMIUM = "/usr/bin/chromium"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PRINTED = "hello from cellblock 42"
# The notebook server runs as root; cellblock's sandbox runs code as uid 1000.
SANDBOX_UID_LINE = "uid 1000"

CELLS = [
    'print("hello from cellblock", 6 * 7)',
    "import os\nprint('uid', os.getuid())",
    "import matplotlib.pyplot as plt\n"
    "import numpy as np\n"
    "x = np.linspace(0, 2 * np.pi, 200)\n"
    "fig, ax = plt.subplots(figsize=(6, 4))\n"
    "ax.plot(x, np.sin(x), label='sin')\n"
    "ax.plot(x, np.cos(x), label='cos')\n"
    "ax.set_title('cellblock plot')\n"
    "ax.legend()\n"
    "plt.show()",
]


def write_notebook(path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "cellblock", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# cellblock frontend test")]
    nb.cells += [nbformat.v4.new_code_cell(src) for src in CELLS]
    nbformat.write(nb, path)


def sessions_in(log_text):
    return sorted(set(SESSION_LOG.findall(log_text)))


def assert_sandboxes_gone(sessions):
    for session in sessions:
        wait_for(lambda: not sandbox_leftovers(session), timeout=60)
        left = sandbox_leftovers(session)
        assert not left, f"sandbox {session} left behind: {left}"


def check_png(b64, what):
    raw = base64.b64decode(b64)
    assert raw[:8] == PNG_MAGIC, what
    assert raw[12:16] == b"IHDR", what
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert width >= 200 and height >= 150, (what, width, height)
    assert len(raw) > 10000, (what, len(raw))  # two curves and a legend, not an empty canvas
    return raw


@pytest.fixture(scope="module")
def workdir():
    spec = os.path.join(os.environ.get("JUPYTER_PATH", ""), "kernels", KERNEL_NAME, "kernel.json")
    assert os.path.isfile(spec), "JUPYTER_PATH must hold the build tree's kernelspec (run through CTest)"
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = tempfile.mkdtemp(prefix="cellblock-frontends-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, token, method="GET"):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as res:
        body = res.read()
    return json.loads(body) if body else None


class NotebookServer:
    """`jupyter notebook` on 127.0.0.1 with a token and its own Jupyter dirs."""

    def __init__(self, root):
        self.root = root
        self.notebook_dir = os.path.join(root, "notebooks")
        self.runtime_dir = os.path.join(root, "runtime")
        for d in (self.notebook_dir, self.runtime_dir):
            os.makedirs(d)
        self.token = secrets.token_hex(24)
        self.log_path = os.path.join(root, "notebook-server.log")
        env = dict(os.environ)
        env.update({
            "JUPYTER_RUNTIME_DIR": self.runtime_dir,
            "JUPYTER_CONFIG_DIR": os.path.join(root, "config"),
            "JUPYTER_DATA_DIR": os.path.join(root, "data"),
            "IPYTHONDIR": os.path.join(root, "ipython"),
        })
        self.log = open(self.log_path, "w")
        # The kernels it starts (cellblock kernel) inherit its stderr: their
        # log lines, with the session ids, land in the same file.
        self.proc = subprocess.Popen(
            [NOTEBOOK_APP, "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={free_port()}",
             "--port-retries=50", f"--notebook-dir={self.notebook_dir}",
             f"--NotebookApp.token={self.token}", "--NotebookApp.password="],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
        self.url = self._wait_until_serving()

    def log_text(self):
        with open(self.log_path) as f:
            return f.read()

    def _wait_until_serving(self, timeout=90):
        info_file = os.path.join(self.runtime_dir, f"nbserver-{self.proc.pid}.json")

        def serving():
            assert self.proc.poll() is None, f"notebook server exited:\n{self.log_text()}"
            if not os.path.exists(info_file):
                return None
            try:
                with open(info_file) as f:
                    url = json.load(f)["url"]
                http_json(url + "api/status", self.token)
                return url
            except (OSError, ValueError, KeyError):
                return None

        url = wait_for(serving, timeout=timeout, interval=0.1)
        assert url, f"notebook server not serving after {timeout} s:\n{self.log_text()}"
        assert url.startswith("http://127.0.0.1:"), url
        return url

    def stop(self):
        if self.proc.poll() is None:
            try:
                http_json(self.url + "api/shutdown", self.token, method="POST")
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def notebook_server(workdir):
    for path, what in ((NOTEBOOK_APP, "jupyter-notebook"), (CHROMIUM, "chromium")):
        assert os.path.exists(path), f"{path} missing: sudo scripts/setup.sh installs {what}"
    assert os.path.isdir(os.path.join(FRONTEND_DIR, "node_modules", "playwright-core")), \
        "playwright-core missing: run tests/frontend/install.sh (scripts/setup.sh does)"
    server = NotebookServer(os.path.join(workdir, "server"))
    yield server
    server.stop()
    shutil.copy(server.log_path, os.path.join(ARTIFACTS, "notebook-server.log"))
    # Whatever happened in the test, the server's shutdown leaves no sandbox.
    assert_sandboxes_gone(sessions_in(server.log_text()))


def test_notebook_in_chromium_shows_plot_and_text(notebook_server):
    server = notebook_server
    write_notebook(os.path.join(server.notebook_dir, "plot.ipynb"))
    screenshot = os.path.join(ARTIFACTS, "notebook-plot.png")
    if os.path.exists(screenshot):
        os.unlink(screenshot)

    started = time.monotonic()
    run = subprocess.run(
        ["node", os.path.join(FRONTEND_DIR, "run_notebook.js"), "--url", server.url, "--token", server.token,
         "--notebook", "plot.ipynb", "--screenshot", screenshot, "--chromium", CHROMIUM,
         "--timeout-ms", "180000"],
        capture_output=True, text=True, timeout=400, cwd=FRONTEND_DIR)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, \
        f"driver failed ({elapsed:.0f} s):\n{run.stderr}\n{run.stdout}\nserver log:\n{server.log_text()[-5000:]}"
    page = json.loads(run.stdout)

    assert page["kernelName"] == KERNEL_NAME
    # Notebook 6 keeps the kernel_info_reply's content (ipykernel's, relayed by cellblock).
    assert page["kernelInfo"]["status"] == "ok", page["kernelInfo"]
    assert page["kernelInfo"]["language_info"]["name"] == "python", page["kernelInfo"]
    cells = page["cells"]
    assert [c["prompt"] for c in cells] == ["In [1]:", "In [2]:", "In [3]:"], cells
    assert not any(c["errors"] for c in cells), cells
    assert cells[0]["stdout"].strip() == PRINTED
    assert cells[1]["stdout"].strip() == SANDBOX_UID_LINE
    assert not cells[0]["images"] and not cells[1]["images"]

    [img] = cells[2]["images"]
    assert img["srcPrefix"] == "data:image/png;base64,"
    assert img["srcLength"] > 10000, img
    # The browser decoded it and lays it out at a real size.
    assert img["complete"] and img["naturalWidth"] >= 200 and img["naturalHeight"] >= 150, img
    assert img["width"] >= 200 and img["height"] >= 150, img

    with open(screenshot, "rb") as f:
        shot = f.read()
    assert shot[:8] == PNG_MAGIC and len(shot) > 20000

    # Saved from the page: the notebook on disk holds what the kernel produced.
    assert page["saved"]
    saved = nbformat.read(os.path.join(server.notebook_dir, "plot.ipynb"), as_version=4)
    code = [c for c in saved.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3]
    pngs = [o.data["image/png"] for o in code[2].outputs
            if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 1
    # The page showed exactly the PNG the kernel sent (and the server saved).
    assert hashlib.sha256(check_png(pngs[0], "saved notebook")).hexdigest() == img["sha256"]

    # Close and Halt: the server shut the kernel down, and nothing of the
    # session's sandbox is left on the host.
    assert [s["kernel"] for s in page["sessionsBefore"]] == [KERNEL_NAME]
    assert page["kernelsAfter"] == [] and page["sessionsAfter"] == []
    sessions = sessions_in(server.log_text())
    assert len(sessions) == 1, f"expected one cellblock session in the server log:\n{server.log_text()}"
    assert_sandboxes_gone(sessions)
    assert re.search(rf"session {sessions[0]}: closed", server.log_text()), server.log_text()[-3000:]


def test_nbconvert_execute_to_html(workdir):
    out_dir = os.path.join(workdir, "nbconvert")
    os.makedirs(out_dir)
    notebook = os.path.join(out_dir, "plot.ipynb")
    write_notebook(notebook)

    # The kernel comes from the notebook's metadata, as for any user.
    run = subprocess.run(
        [NBCONVERT, "--to", "html", "--execute", "--ExecutePreprocessor.timeout=180",
         "--ExecutePreprocessor.startup_timeout=120", "--output-dir", out_dir, notebook],
        capture_output=True, text=True, timeout=400, cwd=out_dir)
    assert run.returncode == 0, run.stderr
    html_path = os.path.join(out_dir, "plot.html")
    shutil.copy(html_path, os.path.join(ARTIFACTS, "nbconvert-plot.html"))
    with open(html_path) as f:
        html = f.read()

    assert PRINTED in html
    assert SANDBOX_UID_LINE in html
    pngs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=\s]+)"', html)
    assert len(pngs) == 1, f"{len(pngs)} PNG images in the HTML"
    check_png(pngs[0], "nbconvert HTML")
    assert "Traceback" not in html

    # nbconvert shut its kernel down on exit: the sandbox is gone.
    sessions = sessions_in(run.stderr)
    assert len(sessions) == 1, run.stderr
    assert_sandboxes_gone(sessions)
