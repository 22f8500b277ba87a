"""`jupyter console --kernel cellblock-python`, driven as a person at a terminal.

The console runs in a pseudo-terminal (pexpect, from Debian's python3). We type
keystrokes, answer prompt_toolkit's cursor-position requests like a real
terminal does, strip ANSI escape codes from what the console draws and match
on the remaining text with timeouts. The kernel's stderr (cellblock's log) is
inherited by the console, so it shows up on the same terminal; the session id
is read from there to check, from the host, that the sandbox is gone after
the console exits.
"""
import os
import re
import subprocess
import time

import pexpect
import pytest

from conftest import KERNEL_NAME, STATE_DIR, wait_for

JUPYTER_CONSOLE = "/usr/bin/jupyter-console"
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
CPR_REQUEST = "\x1b[6n"
SESSION_LOG = re.compile(r"\[cellblock [^\]]*\] session ([0-9a-f]+): image")


class Terminal:
    """A console in a pty; `text` is everything it drew, without escape codes."""

    def __init__(self, argv, env):
        self.child = pexpect.spawn(argv[0], argv[1:], env=env, dimensions=(40, 120),
                                   encoding="utf-8", codec_errors="replace")
        self.raw = ""
        self.text = ""

    def _pump(self, timeout):
        try:
            chunk = self.child.read_nonblocking(65536, timeout=timeout)
        except pexpect.TIMEOUT:
            return True
        except pexpect.EOF:
            return False
        self.raw += chunk
        # prompt_toolkit asks where the cursor is; a real terminal answers.
        for _ in range(chunk.count(CPR_REQUEST)):
            self.child.send("\x1b[1;1R")
        self.text = ANSI.sub("", self.raw).replace("\r", "")
        return True

    def expect(self, pattern, start=0, timeout=60):
        """Waits until `pattern` matches the text after offset `start`; returns the match."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            m = regex.search(self.text, start)
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {pattern!r}; screen text:\n{self.text[-3000:]}")
            if not self._pump(0.2):
                m = regex.search(self.text, start)
                if m:
                    return m
                raise AssertionError(f"console exited while waiting for {pattern!r}:\n{self.text[-3000:]}")

    def prompt(self, number, start=0, timeout=60):
        return self.expect(rf"In \[{number}\]: ", start, timeout)

    def type_line(self, line):
        mark = len(self.text)
        self.child.send(line + "\r")
        return mark

    def wait_exit(self, timeout=60):
        deadline = time.monotonic() + timeout
        while self._pump(0.2):
            if time.monotonic() > deadline:
                raise AssertionError(f"console still running after {timeout} s:\n{self.text[-3000:]}")
        self.child.close()
        return self.child.exitstatus, self.child.signalstatus

    def kill(self):
        if self.child.isalive():
            self.child.terminate(force=True)


def child_pids(pid):
    pids = []
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            with open(f"/proc/{stat}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            pids.append(int(stat))
    return pids


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sandbox_leftovers(session):
    """What is left on the host of one cellblock session (other sessions may run)."""
    left = []
    runtime = os.path.join(STATE_DIR, "runtime")
    if os.path.isdir(runtime):
        listed = subprocess.run(["runc", "--root", runtime, "list", "-q"],
                                capture_output=True, text=True).stdout.split()
        left += [c for c in listed if session in c]
    session_dir = os.path.join(STATE_DIR, "sessions", session)
    if os.path.exists(session_dir):
        left.append(session_dir)
    with open("/proc/self/mountinfo") as f:
        left += [line.split()[4] for line in f if session in line.split()[4]]
    for cg in os.listdir("/proc"):
        if not cg.isdigit():
            continue
        try:
            with open(f"/proc/{cg}/cgroup") as f:
                if f"/cellblock/cb-{session}" in f.read():
                    left.append(f"process {cg}")
        except OSError:
            pass
    return left


@pytest.fixture
def console():
    env = dict(os.environ)
    spec = os.path.join(env.get("JUPYTER_PATH", ""), "kernels", KERNEL_NAME, "kernel.json")
    assert os.path.isfile(spec), "JUPYTER_PATH must hold the build tree's kernelspec (run through CTest)"
    env["TERM"] = "xterm-256color"
    term = Terminal([JUPYTER_CONSOLE, "--kernel", KERNEL_NAME], env)
    yield term
    term.kill()


def started_kernel(term):
    """Waits for the first prompt; returns (cellblock pid, session id)."""
    term.prompt(1, timeout=90)
    session = SESSION_LOG.search(term.text)
    assert session, f"no cellblock session line on the console's terminal:\n{term.text}"
    kernels = [p for p in child_pids(term.child.pid)
               if any(arg.endswith(b"cellblock") for arg in cmdline(p)[:1]) and b"kernel" in cmdline(p)]
    assert len(kernels) == 1, [cmdline(p) for p in child_pids(term.child.pid)]
    assert sandbox_leftovers(session.group(1)), "the session's sandbox should be running"
    return kernels[0], session.group(1)


def assert_everything_gone(kernel_pid, session):
    assert wait_for(lambda: not pid_alive(kernel_pid), timeout=30), \
        f"cellblock kernel process {kernel_pid} still alive: {cmdline(kernel_pid)}"
    wait_for(lambda: not sandbox_leftovers(session), timeout=30)
    left = sandbox_leftovers(session)
    assert not left, f"sandbox {session} left behind: {left}"


def test_console_session_with_state_then_exit(console):
    term = console
    kernel_pid, session = started_kernel(term)

    mark = term.type_line("print(6*7)")
    term.expect(r"^42$", mark)
    term.prompt(2, mark)

    mark = term.type_line("x = 5")
    term.prompt(3, mark)
    mark = term.type_line("x * 3")
    term.expect(r"^Out\[3\]: 15$", mark)
    term.prompt(4, mark)

    # A multi-line statement: the console asks the kernel (is_complete) and
    # shows a continuation prompt; auto-indent supplies the body's indentation.
    mark = term.type_line("for i in range(x):")
    term.expect(r"\.\.\.: ", mark)
    mark = term.type_line("print(i * x)")
    term.expect(r"\.\.\.: ", mark)
    mark = term.type_line("")
    term.expect(r"^0\n5\n10\n15\n20$", mark)
    term.prompt(5, mark)

    mark = term.type_line("exit")
    status, signal = term.wait_exit(timeout=60)
    assert (status, signal) == (0, None), term.text[mark:]
    assert "Shutting down kernel" in term.text[mark:]
    assert re.search(rf"session {session}: closed", term.text[mark:]), term.text[mark:]
    assert_everything_gone(kernel_pid, session)


def test_console_ctrl_d_asks_then_exits(console):
    term = console
    kernel_pid, session = started_kernel(term)

    mark = term.type_line("'cell' + 'block'")
    term.expect(r"^Out\[1\]: 'cellblock'$", mark)
    term.prompt(2, mark)

    mark = len(term.text)
    term.child.sendcontrol("d")
    term.expect(r"Do you really want to exit \(\[y\]/n\)\?", mark)
    term.type_line("y")
    status, signal = term.wait_exit(timeout=60)
    assert (status, signal) == (0, None), term.text[mark:]
    assert_everything_gone(kernel_pid, session)
