"""Jupyter protocol conformance of the cellblock-python kernel.

jupyter_kernel_test drives one kernel (started through the build tree's
kernelspec, i.e. cellblock -> runc sandbox -> ipykernel) for the whole class
and validates every reply and IOPub message against the v5 message schemas.
Its tests run in alphabetical order on that one kernel.

test_history is overridden (IPython numbers the current session 0 in range
replies; see there). The extra tests at the bottom of the class check what
the generic suite does not look at: kernel_info's protocol version, that the
image/png is a real PNG, that the DataFrame HTML holds the data, that state
carries over, that a request sent after an error's reply and idle is run (not
aborted), that the error names the exception. The last test, outside the
class, starts a kernel whose launcher exits at once and checks that the client
is told the kernel died.
"""
import base64
import struct

import jupyter_kernel_test

from conftest import KERNEL_NAME, wait_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

PLOT_CODE = (
    "import matplotlib.pyplot as plt\n"
    "fig, ax = plt.subplots(figsize=(4, 3), dpi=50)\n"
    "ax.plot([1, 2, 3], [4, 1, 9])\n"
    "plt.show()"
)

DATAFRAME_CODE = (
    "import pandas as pd\n"
    "from IPython.display import display\n"
    "display(pd.DataFrame({'city': ['Oslo', 'Lima'], 'units': [1234, 5678]}))"
)

ERROR_CODE = "raise ValueError('cellblock conformance error')"


class CellblockKernelTests(jupyter_kernel_test.KernelTests):
    kernel_name = KERNEL_NAME
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"

    code_stderr = "import sys; print('to stderr', file=sys.stderr)"

    code_generate_error = ERROR_CODE

    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n for n in range(3)]", "result": "[0, 1, 2]"},
        {"code": "'cell' + 'block'", "result": "'cellblock'"},
    ]

    code_display_data = [
        {"code": PLOT_CODE, "mime": "image/png"},
        {"code": DATAFRAME_CODE, "mime": "text/html"},
        {"code": "from IPython.display import HTML, display; display(HTML('<b>hi</b>'))",
         "mime": "text/html"},
    ]

    completion_samples = [
        {"text": "zi", "matches": {"zip"}},
        {"text": "import sys; sys.ver", "matches": {"version", "version_info"}},
        {"text": "import colle", "matches": {"collections"}},
    ]

    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n    return x\n\n"]
    incomplete_code_samples = ["def f(x):", "x = (", "for i in range(3):"]
    invalid_code_samples = ["1 +/ 2", "import = 7q"]

    code_inspect_sample = "print"

    # "1?2*" is a glob: it matches "1+2+3" from code_execute_result only.
    code_history_pattern = "1?2*"
    # test_history is overridden below (see there for why); it checks all three.
    supported_history_operations = ("tail", "range", "search")

    code_clear_output = (
        "from IPython.display import clear_output\n"
        "print('soon gone')\n"
        "clear_output()"
    )

    code_page_something = "print?"

    def test_history(self):
        """jupyter_kernel_test's history checks, with one correction for IPython.

        Upstream's range check expects the reply to echo the session number it
        got from a tail request. IPython answers a range over the *current*
        session with session number 0 (HistoryManager._get_range_session yields
        (0, line, input)); a bare ipykernel fails upstream's check the same way
        ("0 != 5" here). Left as is, upstream's test would have to drop "range",
        and then pytest reports the whole test as skipped, hiding the tail and
        search results. So the same checks are made here, accepting 0 as the
        current session in range replies.
        """
        codes = [s["code"] for s in self.code_execute_result]
        n = len(codes)

        with self.subTest(hist_access_type="tail"):
            reply = self.history_helper(codes, output=False, raw=True, hist_access_type="tail", n=n)
            history = reply["content"]["history"]
            self.assertEqual(len(history), n)
            self.assertEqual(len(history[0]), 3)
            self.assertEqual(codes, [h[2] for h in history])
            session, start = history[0][0:2]
            self.assertGreaterEqual(session, 1)
            self.assertEqual([h[1] for h in history], list(range(start, start + n)))

            reply = self.history_helper(codes, output=True, raw=True, hist_access_type="tail", n=n)
            history = reply["content"]["history"]
            self.assertEqual(len(history), n)
            self.assertEqual(len(history[0][2]), 2)
            self.assertEqual(codes, [h[2][0] for h in history])

        with self.subTest(hist_access_type="range"):
            reply = self.history_helper(codes, output=False, raw=True, hist_access_type="range",
                                        session=session, start=start, stop=start + n)
            history = reply["content"]["history"]
            self.assertEqual(len(history), n)
            self.assertTrue(all(h[0] in (0, session) for h in history), history)
            self.assertEqual([h[1] for h in history], list(range(start, start + n)))
            self.assertEqual([h[2] for h in history], codes)

        with self.subTest(hist_access_type="search"):
            reply = self.history_helper(codes, output=False, raw=True, hist_access_type="search",
                                        pattern=self.code_history_pattern)
            self.assertGreaterEqual(len(reply["content"]["history"]), 1)
            self.assertTrue(all(h[2] == "1+2+3" for h in reply["content"]["history"]))
            reply = self.history_helper(codes, output=False, raw=True, hist_access_type="search",
                                        pattern=self.code_history_pattern, unique=True)
            self.assertEqual(len(reply["content"]["history"]), 1)
            reply = self.history_helper(codes, output=False, raw=True, hist_access_type="search",
                                        pattern=self.code_history_pattern, n=3)
            self.assertEqual(len(reply["content"]["history"]), 3)

    # ---- checks the generic suite does not make ------------------------------

    def _outputs_of(self, code, **kwargs):
        self.flush_channels()
        reply, outputs = self.execute_helper(code, **kwargs)
        return reply, outputs

    def test_kernel_info_details(self):
        self.flush_channels()
        msg_id = self.kc.kernel_info()
        reply = self.kc.get_shell_msg(timeout=jupyter_kernel_test.TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=jupyter_kernel_test.TIMEOUT)
        content = reply["content"]
        self.assertEqual(content["status"], "ok")
        self.assertEqual(content["protocol_version"], "5.3")
        self.assertEqual(content["language_info"]["mimetype"], "text/x-python")

    def test_png_is_a_real_png(self):
        reply, outputs = self._outputs_of(PLOT_CODE)
        self.assertEqual(reply["content"]["status"], "ok")
        pngs = [m["content"]["data"]["image/png"] for m in outputs
                if m["msg_type"] == "display_data" and "image/png" in m["content"]["data"]]
        self.assertEqual(len(pngs), 1, outputs)
        raw = base64.b64decode(pngs[0])
        self.assertEqual(raw[:8], PNG_MAGIC)
        self.assertEqual(raw[12:16], b"IHDR")
        width, height = struct.unpack(">II", raw[16:24])
        # figsize 4x3 inches at 50 dpi (the inline backend may crop with bbox_inches)
        self.assertTrue(100 <= width <= 200 and 75 <= height <= 150, (width, height))

    def test_dataframe_html_holds_the_data(self):
        reply, outputs = self._outputs_of(DATAFRAME_CODE)
        self.assertEqual(reply["content"]["status"], "ok")
        html = [m["content"]["data"]["text/html"] for m in outputs
                if m["msg_type"] == "display_data" and "text/html" in m["content"]["data"]]
        self.assertEqual(len(html), 1, outputs)
        self.assertIn("<table", html[0])
        for cell in ("Oslo", "Lima", "1234", "5678", "city", "units"):
            self.assertIn(cell, html[0])

    def test_request_after_error_is_not_aborted(self):
        """After an error reply and idle, the next request must run.

        The messaging spec aborts only requests queued before the error.
        ipykernel 6.17 alone aborts the next request about one time in three
        (its stop-aborting marker is scheduled with call_later(0)); cellblock's
        launcher (kernel-shim/cellblock_ipykernel.py) works around it. This
        repeats the error -> next-request sequence, no sleeps in between.
        """
        statuses = []
        for i in range(10):
            reply, _ = self._outputs_of(ERROR_CODE)
            self.assertEqual(reply["content"]["status"], "error")
            # Not execute_helper: its validator rejects an "aborted" reply
            # before we could report which status came back.
            status, results = self._execute_unvalidated(f"{i} + 100")
            statuses.append(status)
            if status == "ok":
                self.assertEqual(results, [str(i + 100)])
        self.assertEqual(statuses, ["ok"] * 10)

    def _execute_unvalidated(self, code):
        msg_id = self.kc.execute(code)
        while True:
            reply = self.kc.get_shell_msg(timeout=jupyter_kernel_test.TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        results = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=jupyter_kernel_test.TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "execute_result":
                results.append(msg["content"]["data"]["text/plain"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return reply["content"]["status"], results

    def test_traceback_names_the_exception(self):
        reply, outputs = self._outputs_of(ERROR_CODE)
        self.assertEqual(reply["content"]["status"], "error")
        self.assertEqual(reply["content"]["ename"], "ValueError")
        self.assertEqual(reply["content"]["evalue"], "cellblock conformance error")
        errors = [m for m in outputs if m["msg_type"] == "error"]
        self.assertEqual(len(errors), 1)
        self.assertEqual(errors[0]["content"]["ename"], "ValueError")
        self.assertTrue(any("cellblock conformance error" in line
                            for line in errors[0]["content"]["traceback"]))

    def test_state_persists_between_requests(self):
        reply, _ = self._outputs_of("conformance_state = 6 * 7")
        self.assertEqual(reply["content"]["status"], "ok")
        reply, outputs = self._outputs_of("conformance_state + 1")
        self.assertEqual(reply["content"]["status"], "ok")
        results = [m["content"]["data"]["text/plain"] for m in outputs
                   if m["msg_type"] == "execute_result"]
        self.assertEqual(results, ["43"])


class ServerSessionKernelTests(CellblockKernelTests):
    """The same suite against one session of a running `cellblock serve`,
    instead of a kernel started through the kernelspec. A test module
    subclasses it (with `__test__ = True`) and sets `server_for_class` (a
    server_helpers.ServerProcess) in a fixture; `check_session` may assert
    what kind of session it got."""

    __test__ = False  # collected only as a subclass
    server_for_class = None

    @classmethod
    def check_session(cls):
        pass

    @classmethod
    def setUpClass(cls):
        cls.server = cls.server_for_class
        cls.sid, cls.kc, _ = cls.server.open_session()
        cls.km = None
        cls.check_session()

    @classmethod
    def tearDownClass(cls):
        cls.kc.stop_channels()
        cls.server.ok("session_close_request", {"session_id": cls.sid})


# ---- a kernel that dies while starting ---------------------------------------

def test_kernel_dying_at_start_is_reported_as_a_dead_kernel(tmp_path, monkeypatch):
    """If ipykernel exits before it is ready, the client must learn that the
    kernel died, as it does with any local kernel ("Kernel died before replying
    to kernel_info"), not crash on a malformed kernel_info_reply.

    The launcher in a copy of libexec exits with status 3 at once; everything
    else (cellblock binary, shim, image, runc) is the real thing.
    """
    import json
    import os
    import shutil
    import time

    from jupyter_client.manager import KernelManager

    cellblock = os.environ["CELLBLOCK_BIN"]
    real_libexec = os.path.join(os.path.dirname(os.path.dirname(cellblock)), "libexec", "cellblock")
    libexec = tmp_path / "libexec"
    libexec.mkdir()
    shutil.copy2(os.path.join(real_libexec, "cellblock-shim"), libexec / "cellblock-shim")
    (libexec / "cellblock_ipykernel.py").write_text("import sys\nsys.exit(3)\n")
    spec_dir = tmp_path / "jupyter" / "kernels" / "cellblock-dies-at-start"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [cellblock, "kernel", "--libexec-dir", str(libexec), "-f", "{connection_file}"],
        "display_name": "cellblock, launcher exits at once",
        "language": "python",
        "interrupt_mode": "message",
    }))
    # The sandbox's user must be able to traverse the bind-mounted libexec.
    for d in (tmp_path, libexec):
        os.chmod(d, 0o755)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))

    stderr_path = tmp_path / "kernel.stderr"
    km = KernelManager(kernel_name="cellblock-dies-at-start")
    with open(stderr_path, "wb") as stderr:
        km.start_kernel(stderr=stderr)
    kc = km.client()
    kc.start_channels()
    try:
        started = time.monotonic()
        error = None
        try:
            kc.wait_for_ready(timeout=60)
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            error = e
        # cellblock must notice within seconds, not at the 60 s client timeout.
        assert time.monotonic() - started < 30
        log = stderr_path.read_text(errors="replace")
        assert "the kernel exited with status 3" in log, log
        assert isinstance(error, RuntimeError) and "died" in str(error), (
            f"wait_for_ready raised {type(error).__name__}: {error!r}; kernel log:\n{log}")
    finally:
        kc.stop_channels()
        # Let cellblock finish its own cleanup: SIGKILL (shutdown_kernel(now=True))
        # during it leaves the session directory and its mounts behind.
        wait_for(lambda: not km.is_alive(), timeout=15)
        if km.has_kernel:
            km.shutdown_kernel(now=not km.is_alive())
