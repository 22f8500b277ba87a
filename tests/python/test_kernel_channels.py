"""Kernel mode: stdin routing, message-mode interrupts and the heartbeat,
through a real cellblock kernel started by jupyter_client."""
import queue
import time

from conftest import run_cell, stream_text
from server_helpers import kernel_client


def reply_to(kc, msg_id, timeout=30):
    """The shell reply to msg_id. jupyter_client's wait_for_ready resends
    kernel_info_request every second while a kernel starts, so replies to
    those may still be queued: skip them, as frontends do."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg
        assert msg["msg_type"] == "kernel_info_reply", f"unexpected reply {msg['msg_type']}"


def second_client(km):
    """Another frontend on the same kernel (same key, same ports)."""
    kc = kernel_client()
    kc.load_connection_info(km.get_connection_info())
    kc.start_channels()
    kc.wait_for_ready(timeout=30)
    return kc


def test_input_request_reaches_only_the_client_that_asked(kernel):
    km, kc = kernel
    other = second_client(km)
    try:
        msg_id = kc.execute("name = input('who? ')\nprint('hello', name)", allow_stdin=True)
        request = kc.get_stdin_msg(timeout=30)
        assert request["msg_type"] == "input_request"
        assert request["content"]["prompt"] == "who? "
        assert request["parent_header"]["msg_id"] == msg_id
        # The other frontend never sees the prompt.
        try:
            stray = other.get_stdin_msg(timeout=1.0)
        except queue.Empty:
            stray = None
        assert stray is None, f"input_request leaked to another client: {stray}"
        kc.input("cellblock")
        reply = reply_to(kc, msg_id)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "ok"
        content, outputs = run_cell(kc, "print(name[::-1])")
        assert content["status"] == "ok"
        assert stream_text(outputs) == "kcolbllec\n"
    finally:
        other.stop_channels()


def test_replies_go_to_the_client_that_asked(kernel):
    km, kc = kernel
    other = second_client(km)
    try:
        mine = kc.execute("print('from a')")
        theirs = other.execute("print('from b')")
        reply_a = reply_to(kc, mine)
        reply_b = reply_to(other, theirs)
        assert reply_a["parent_header"]["msg_id"] == mine
        assert reply_b["parent_header"]["msg_id"] == theirs
        for kc_, label in ((kc, "a"), (other, "b")):
            try:
                extra = kc_.get_shell_msg(timeout=0.5)
            except queue.Empty:
                extra = None
            assert extra is None, f"client {label} got a second reply: {extra}"
    finally:
        other.stop_channels()


def test_message_mode_interrupt_stops_only_the_kernel(kernel):
    km, kc = kernel
    assert km.kernel_spec.interrupt_mode == "message"
    msg_id = kc.execute("import time\nfor i in range(600):\n    time.sleep(0.05)")
    # Wait until the cell is running in the kernel.
    deadline = time.monotonic() + 30
    busy = False
    while time.monotonic() < deadline and not busy:
        msg = kc.get_iopub_msg(timeout=30)
        busy = (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input")
    assert busy
    time.sleep(0.3)
    started = time.monotonic()
    km.interrupt_kernel()
    reply = reply_to(kc, msg_id)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 10
    # cellblock itself was not interrupted: the same session goes on.
    assert km.is_alive()
    content, outputs = run_cell(kc, "print(i < 599)")
    assert content["status"] == "ok"
    assert stream_text(outputs) == "True\n"


def test_heartbeat_is_answered_through_the_sandbox(kernel):
    km, kc = kernel
    deadline = time.monotonic() + 10
    while not kc.hb_channel.is_beating() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kc.hb_channel.is_beating()
