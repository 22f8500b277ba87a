"""The relay's two transports to a kernel's sockets (`--kernel-transport`):
ZMTP spoken in the server's own loop (the default) and libzmq through its I/O
thread. Each is driven through a real server, real sandboxes and a real
jupyter_client: every channel (shell, iopub, stdin, control, heartbeat), a
large rich output, and what each does with a kernel message over the frame
cap.
"""
import base64
import time

import pytest
import zmq

from server_helpers import execute, run_ok, server_factory, stream_text, wait_for  # noqa: F401

TRANSPORTS = ("zmtp", "libzmq")


def served(server_factory, transport):
    srv = server_factory(["--kernel-transport", transport, "--client-transport", transport,
                          "--pool", "host=1"])
    return srv


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_channel_works(server_factory, transport):
    srv = served(server_factory, transport)
    # Display data counts against the output budget: room for the 3 MB display.
    _, kc, _ = srv.open_session(limits={"output_bytes": 6_000_000})
    # shell and iopub: results, streams and an ordered stream of prints.
    out = run_ok(kc, "for i in range(300): print(i)")
    assert out == "".join(f"{i}\n" for i in range(300))
    reply, msgs = execute(kc, "6*7")
    assert reply["content"]["status"] == "ok"
    results = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert results == ["42"]
    # A 3 MB PNG-sized display crosses in one frame, byte for byte.
    payload = bytes(range(256)) * (3 * 4096)
    code = ("import base64\nfrom IPython.display import display\n"
            f"display({{'image/png': base64.b64encode(bytes(range(256)) * {3 * 4096}).decode()}}, "
            "raw=True)")
    reply, msgs = execute(kc, code)
    assert reply["content"]["status"] == "ok"
    shown = [m for m in msgs if m["msg_type"] == "display_data"]
    assert len(shown) == 1
    assert base64.b64decode(shown[0]["content"]["data"]["image/png"]) == payload
    # stdin: the kernel's input_request reaches this client, its answer the kernel.
    msg_id = kc.execute("print(input('name? ')[::-1])", allow_stdin=True)
    request = kc.get_stdin_msg(timeout=30)
    assert request["msg_type"] == "input_request"
    assert request["content"]["prompt"] == "name? "
    kc.input("cellblock")
    reply = kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok"
    # control: kernel_info on the control channel.
    control = zmq.Context.instance().socket(zmq.DEALER)
    try:
        control.connect(f"tcp://{kc.ip}:{kc.control_port}")
        sent = kc.session.send(control, "kernel_info_request", {})
        assert control.poll(30000), "no reply on control"
        _, reply = kc.session.recv(control)
    finally:
        control.close(linger=0)
    assert reply["msg_type"] == "kernel_info_reply"
    assert reply["parent_header"]["msg_id"] == sent["header"]["msg_id"]
    # heartbeat: beats come back through the sandbox.
    wait_for(kc.hb_channel.is_beating, timeout=10)
    assert kc.hb_channel.is_beating()
    assert f"kernel transport: {transport}, client transport: {transport}" in srv.log()


def test_a_message_over_the_frame_cap_is_dropped_and_the_session_goes_on(server_factory):
    """A kernel frame over 64 MiB (the server's cap on the kernel's frames) is
    read past and dropped whole; the connection stays in step, so the same
    execution's reply and idle and every later output still arrive. (libzmq
    cuts the connection instead and loses what it held.)"""
    srv = served(server_factory, "zmtp")
    _, kc, _ = srv.open_session(limits={"memory_mb": 1024})
    # Sent on the kernel's iopub directly, as a kernel that ignores its output
    # budget would (cellblock's launcher drops a display past it at the source).
    code = ("k = get_ipython().kernel\n"
            "k.session.send(k.iopub_socket, 'display_data', {'data': {'text/plain': "
            "'x' * (70 << 20)}, 'metadata': {}}, parent=k.get_parent('shell'), "
            "ident=b'display_data')\n"
            "print('after')")
    reply, msgs = execute(kc, code, timeout=120)
    assert reply["content"]["status"] == "ok"
    assert not [m for m in msgs if m["msg_type"] == "display_data"]
    assert stream_text(msgs) == "after\n"
    assert run_ok(kc, "print('still here')") == "still here\n"
    assert "dropped a message over the frame limits" in srv.log()
