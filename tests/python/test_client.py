"""The Python client (clients/python, package `cellblock`) against a real `cellblock serve`.

Every check goes through the client and is compared with what the server's
own registry or a second, independent view says (session lists, histories,
files written by the sandbox and read back byte for byte).
"""
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from server_helpers import server, wait_for  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CLIENT_DIR = os.path.join(SOURCE_DIR, "clients", "python")
sys.path.insert(0, CLIENT_DIR)

import cellblock  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cb(server):  # noqa: F811
    with cellblock.connect(state_dir=server.state_dir) as conn:
        yield conn


def open_ids(server):  # noqa: F811
    return {s["session_id"] for s in server.ok("session_list_request", {"open_only": True})
            ["content"]["sessions"]}


def test_connect_finds_the_server_from_its_state_dir(cb, server):  # noqa: F811
    assert cb.pid == server.proc.pid
    info = cb.info()
    assert info["version"] and "host" in info["images"]


def test_connect_without_a_server_says_so(tmp_path):
    with pytest.raises(cellblock.ServerNotFound, match="no server connection file"):
        cellblock.connect(state_dir=str(tmp_path))
    stale = tmp_path / "server.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale.write_text('{"manager": "tcp://127.0.0.1:9", "key": "00", "pid": %d}' % dead.pid)
    with pytest.raises(cellblock.ServerNotFound, match="not running"):
        cellblock.connect(path=str(stale))


def test_run_returns_stdout_stderr_results_and_budget(cb, server):  # noqa: F811
    with cb.session(limits={"max_executions": 10}) as s:
        assert s.id in open_ids(server)
        r = s.run("import sys\nprint('out'); print('err', file=sys.stderr)\n6 * 7")
        assert r.ok and r.error is None
        assert (r.stdout, r.stderr) == ("out\n", "err\n")
        assert r.text == "42" and r.results[0].is_main_result
        assert r.execution_count == 1
        assert r.budget["executions_used"] == 1 and r.budget["executions_left"] == 9
        for key in ("wall_ms", "cpu_ms", "memory_peak_bytes", "output_truncated"):
            assert key in r.budget, r.budget
        r2 = s.run("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n'done'")
        assert r2.execution_count == 2
        assert [x.html for x in r2.results] == ["<b>hi</b>", None]
        assert r2.results[1].text == "'done'"
    assert s.id not in open_ids(server)


def test_png_is_decoded_to_bytes_identical_to_the_file_written(cb):
    with cb.session() as s:
        r = s.run("import matplotlib.pyplot as plt, hashlib\n"
                  "plt.plot([1, 3, 2]); plt.savefig('/tmp/p.png', format='png'); plt.show()")
        assert r.ok, r.error
        pngs = [x.png for x in r.results if x.png is not None]
        assert len(pngs) == 1 and pngs[0].startswith(PNG_MAGIC)
        assert isinstance(r.results[0].raw["image/png"], str)   # base64 kept for nbformat
        assert r.outputs[0]["output_type"] == "display_data"


def test_callbacks_stream_output_while_the_code_runs(cb):
    seen = []
    with cb.session() as s:
        started = time.monotonic()
        r = s.run("import time, sys\n"
                  "for i in range(3):\n"
                  "    print('tick', i, flush=True); time.sleep(0.4)\n"
                  "print('warn', file=sys.stderr, flush=True)\n"
                  "from IPython.display import display; display(7)\n"
                  "raise ValueError('late')",
                  on_stdout=lambda t: seen.append(("out", t, time.monotonic() - started)),
                  on_stderr=lambda t: seen.append(("err", t, time.monotonic() - started)),
                  on_result=lambda x: seen.append(("result", x.text, time.monotonic() - started)),
                  on_error=lambda e: seen.append(("error", e.ename, time.monotonic() - started)))
        total = r.duration_s
    kinds = [k for k, _, _ in seen]
    assert kinds[:3] == ["out"] * 3 and kinds[-3:] == ["err", "result", "error"], seen
    assert "".join(t for k, t, _ in seen if k == "out") == r.stdout == "tick 0\ntick 1\ntick 2\n"
    # The first tick arrived long before the execution ended: streamed, not batched.
    assert seen[0][2] < total - 0.6, (seen, total)


def test_code_errors_are_data_not_exceptions(cb):
    with cb.session() as s:
        r = s.run("1 / 0")
        assert r.status == "error" and r.error.ename == "ZeroDivisionError"
        assert r.error.evalue == "division by zero" and not r.error.by_server
        assert any("ZeroDivisionError" in line for line in r.error.traceback)
        with pytest.raises(cellblock.CodeError) as e:
            r.raise_for_error()
        assert e.value.ename == "ZeroDivisionError"
        # Code that raises an exception *named* like a server error is still the code's own.
        r = s.run("raise type('ExecutionTimeout', (Exception,), {})('forged')")
        assert r.error.ename == "ExecutionTimeout" and not r.error.by_server and not r.timed_out
        assert s.run("'alive'").text == "'alive'"


def test_execution_cap_raises_execution_limit_exceeded(cb):
    with cb.session(limits={"max_executions": 2}) as s:
        assert s.run("1").budget["executions_left"] == 1
        assert s.run("2").budget["executions_left"] == 0
        with pytest.raises(cellblock.ExecutionLimitExceeded) as e:
            s.run("3")
        assert e.value.execution.error.by_server
        assert "2 executions" in str(e.value)
        r = s.run("4", raise_errors=False)
        assert r.error.ename == "ExecutionLimitExceeded" and r.results == []


def test_timeout_interrupts_and_the_session_lives_on(cb):
    with cb.session() as s:
        s.run("x = 5")
        t = time.monotonic()
        with pytest.raises(cellblock.ExecutionTimeout) as e:
            s.run("while True: pass", timeout=1)
        assert time.monotonic() - t < 10
        assert e.value.execution.timed_out
        assert e.value.execution.error.ename == "KeyboardInterrupt"
        assert "passed its timeout of 1.0 s" in str(e.value)
        assert s.run("x + 1").text == "6"


def test_memory_limit_closes_the_session(cb, server):  # noqa: F811
    s = cb.session(limits={"memory_mb": 128})
    with pytest.raises(cellblock.MemoryLimitExceeded):
        s.run("hog = b'x' * (512 << 20)")
    with pytest.raises(cellblock.SessionClosed):
        s.run("1")
    assert s.id not in open_ids(server)
    s.close()   # closing a session the server closed already is fine


def test_put_and_get_files(cb):
    payload = os.urandom(300_000)
    with cb.session() as s:
        assert s.put("dir/blob.bin", payload) == "/data/input/dir/blob.bin"
        r = s.run("import hashlib, shutil\n"
                  "data = open('/data/input/dir/blob.bin', 'rb').read()\n"
                  "open('/data/output/copy.bin', 'wb').write(data[::-1])\n"
                  "print(hashlib.sha256(data).hexdigest())")
        assert r.stdout.strip() == hashlib.sha256(payload).hexdigest()
        assert s.get("copy.bin") == payload[::-1]
        assert s.get("/data/output/copy.bin") == payload[::-1]
        with pytest.raises(cellblock.FileNotFound):
            s.get("missing.txt")
        with pytest.raises(cellblock.InvalidPath):
            s.put("../escape.txt", b"x")
        s.run("import os; os.symlink('/etc/passwd', '/data/output/link')")
        with pytest.raises(cellblock.FileError):
            s.get("link")
        history = s.history()
        assert [e["kind"] for e in history["events"]].count("file_put") == 1


def test_manager_errors_are_named_exceptions(cb):
    with pytest.raises(cellblock.UnknownImage):
        cb.session(image="no-such-image")
    with pytest.raises(cellblock.LimitAboveMaximum):
        cb.session(limits={"max_executions": 10**9})
    with pytest.raises(cellblock.InvalidLimits):
        cb.session(limits={"no_such_limit": 1})
    with pytest.raises(cellblock.NoSuchSession):
        cb.request("session_info_request", {"session_id": "0000000000000000"})


def test_closing_the_server_closes_its_sessions(server):  # noqa: F811
    with cellblock.connect(state_dir=server.state_dir) as conn:
        a, b = conn.session(), conn.session()
        b.close()
        assert a.id in open_ids(server) and b.id not in open_ids(server)
    assert a.closed and a.id not in open_ids(server)


def test_sessions_run_in_parallel_threads_and_see_nothing_of_each_other(cb):
    results, errors = {}, []

    def work(n):
        try:
            with cb.session() as s:
                s.run(f"secret = {n}; open('/tmp/mine', 'w').write('{n}')")
                time.sleep(0.2)
                r = s.run("import os; print(secret, open('/tmp/mine').read(), len(os.listdir('/tmp')))")
                results[n] = r.stdout.split()
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {n: [str(n), str(n), "1"] for n in range(4)}


def test_the_package_installs_with_pip(tmp_path):
    import shutil
    # From a copy: setuptools builds in the source tree (build/, *.egg-info).
    source = tmp_path / "src"
    shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    probe = subprocess.run([sys.executable, "-c", "import cellblock, cellblock.eval; print(cellblock.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(target)))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith(str(target)), probe.stdout


def test_the_example_in_docs_client_md_runs(server):  # noqa: F811
    import re
    with open(os.path.join(SOURCE_DIR, "docs", "client.md")) as f:
        doc = f.read()
    example = re.search(r"## A runnable example.*?```python\n(.*?)```", doc, re.S).group(1)
    example = example.replace('state_dir="/run/cb-demo"', f'state_dir="{server.state_dir}"')
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=CLIENT_DIR))
    assert out.returncode == 0, out.stderr
    assert "ZeroDivisionError division by zero" in out.stdout
    assert "stopped: ExecutionTimeout" in out.stdout and out.stdout.rstrip().endswith("4")
