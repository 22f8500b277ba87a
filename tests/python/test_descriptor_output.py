"""Descriptor-level output (subprocesses, C libraries, os.write(1, ...)) survives
any bytes: a UTF-8 character split across ipykernel's 1000-byte reads, invalid
UTF-8 and binary data on descriptors 1 and 2 no longer end the forwarding.

ipykernel 6.17 decoded each read strictly: the first split character killed its
watcher thread, every later subprocess output of the session was lost, and past
~64 KiB the writer blocked on the full pipe until the cell's timeout.
kernel-shim/cellblock_ipykernel.py decodes incrementally with replacement. Both
kernels are checked: forked from the zygote (serve, image host) and booted
(kernel mode).
"""
import server_helpers as sh
from conftest import run_cell, stream_text
from server_helpers import server  # noqa: F401 (the fixture)

PY = "/usr/bin/python3"
# "é" is 2 bytes: 'x' + 1000 of them puts a split at every 1000-byte read.
WRITES = f"""
import subprocess, time
subprocess.run([{PY!r}, '-c', 'print("x" + "é" * 1000)'])
subprocess.run([{PY!r}, '-c', '''
import os
os.write(1, b"bad \\\\xff\\\\xfe bytes\\\\n")
os.write(2, "é".encode() * 999 + b"\\\\xc3")
os.write(2, b"\\\\n")
os.write(1, bytes(range(256)) + b"\\\\n")
'''])
subprocess.run(['echo', 'after'])
time.sleep(0.5)
"""
LATER = "import subprocess, time\nsubprocess.run(['echo', 'later'])\ntime.sleep(0.5)"
# Past the pipe's 64 KiB: it used to block the writer until the timeout.
LARGE = f"import subprocess, time\nsubprocess.run([{PY!r}, '-c', 'print(\"é\" * 40000)'])\n" \
        "subprocess.run(['echo', 'large done'])\ntime.sleep(0.5)"


def check_session(run):
    out, err = run(WRITES)
    assert "x" + "é" * 1000 in out, out[:200]
    assert "bad \ufffd\ufffd bytes" in out, out
    assert out.rstrip().endswith("after"), out[-300:]
    # 999 whole characters, then the lone lead byte replaced.
    assert "é" * 999 + "\ufffd" in err, err[-100:]
    out, _ = run(LATER)
    assert out.strip() == "later", out
    out, _ = run(LARGE)
    assert "é" * 40000 in out and out.rstrip().endswith("large done"), out[-200:]


def test_a_forked_session_forwards_every_later_descriptor_output(server):  # noqa: F811
    sid, kc, created = server.open_session()

    def run(code):
        reply, msgs = sh.execute(kc, code, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        return sh.stream_text(msgs, "stdout"), sh.stream_text(msgs, "stderr")

    assert sh.is_forked(server.state_dir, sid), "the host image's sessions are forked"
    check_session(run)


def test_a_booted_kernel_forwards_every_later_descriptor_output(kernel):
    def run(code):
        reply, msgs = run_cell(kernel[1], code, timeout=120)
        assert reply["status"] == "ok", reply
        return stream_text(msgs, "stdout"), stream_text(msgs, "stderr")

    check_session(run)
