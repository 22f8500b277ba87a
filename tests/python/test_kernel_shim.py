"""The kernel shim's own helpers (kernel-shim/cellblock_ipykernel.py) that a
forked kernel uses to start from its zygote's state without touching all of
it (docs/zygote.md, "What a fork's kernel does not touch"). Checked here on
the interpreter running the tests; test_zygote.py checks the same behaviour
in real forked sessions."""
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", "../.."), "kernel-shim"))
import cellblock_ipykernel as shim  # noqa: E402


@pytest.fixture
def fake_modules():
    added = []

    def add(name):
        sys.modules[name] = types.ModuleType(name)
        added.append(name)

    yield add
    for name in added:
        sys.modules.pop(name, None)


def test_the_modules_at_start_are_the_zygotes_and_those_imported_since(fake_modules):
    fake_modules("cb_shim_test_before")
    at_start = shim._ModulesAtStart()
    fake_modules("cb_shim_test_after_1")
    fake_modules("cb_shim_test_after_2")
    now = at_start.now()
    assert now == set(sys.modules)
    assert {"cb_shim_test_before", "cb_shim_test_after_1", "cb_shim_test_after_2"} <= now
    # Made from the zygote's set, not built anew from sys.modules.
    assert now is at_start.names


def test_the_modules_at_start_are_built_anew_when_one_of_the_zygotes_is_gone(fake_modules):
    fake_modules("cb_shim_test_gone")
    fake_modules("cb_shim_test_stays")
    at_start = shim._ModulesAtStart()
    del sys.modules["cb_shim_test_gone"]
    fake_modules("cb_shim_test_new")
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_gone" not in now and "cb_shim_test_new" in now
    assert now is not at_start.names


def test_the_modules_at_start_are_built_anew_when_the_zygotes_last_is_gone(fake_modules):
    fake_modules("cb_shim_test_last")
    at_start = shim._ModulesAtStart()
    assert at_start.last == "cb_shim_test_last"
    fake_modules("cb_shim_test_since")
    del sys.modules["cb_shim_test_last"]
    fake_modules("cb_shim_test_last")  # back, at the end: after one added since
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_since" in now


def test_only_the_finders_of_the_homes_import_path_entries_are_forgotten(tmp_path, monkeypatch):
    home = str(tmp_path / "home")
    packages = os.path.join(home, ".local", "packages")
    elsewhere = str(tmp_path / "elsewhere")
    missing = str(tmp_path / "missing")
    not_on_path = os.path.join(home, "not-on-path")
    monkeypatch.setattr(sys, "path", [packages, elsewhere, missing, *sys.path])
    cache = dict(sys.path_importer_cache)
    monkeypatch.setattr(sys, "path_importer_cache", cache)
    marker = object()
    cache.update({packages: marker, elsewhere: marker, missing: None, home: marker,
                  not_on_path: marker})
    shim._forget_finders_under(home)
    assert packages not in cache and missing not in cache and home not in cache
    assert cache[elsewhere] is marker
    # Not on the import path: not looked at (a package's own dir, say).
    assert cache[not_on_path] is marker


@pytest.fixture
def curve_kernel(tmp_path):
    """The shim's kernel, a real process outside any sandbox, on 127.0.0.1 with
    a connection file naming a CurveZMQ secret key (as the Swarm backend's
    secret does). Yields (connection info as rewritten by ipykernel with its
    ports, the kernel's public key)."""
    import json
    import subprocess
    import time

    import zmq

    public, secret = zmq.curve_keypair()
    path = tmp_path / "kernel.json"
    info = {"transport": "tcp", "ip": "127.0.0.1", "shell_port": 0, "iopub_port": 0,
            "stdin_port": 0, "control_port": 0, "hb_port": 0, "key": "inner-key",
            "signature_scheme": "hmac-sha256", "kernel_name": "host",
            "curve_secret_key": secret.decode()}
    path.write_text(json.dumps(info))
    env = dict(os.environ, HOME=str(tmp_path), IPYTHONDIR=str(tmp_path / "ipython"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    log = open(tmp_path / "kernel.log", "wb")
    kernel = subprocess.Popen([sys.executable, os.path.abspath(shim.__file__), "-f", str(path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            written = json.loads(path.read_text() or "{}")
            if written.get("shell_port") and written.get("hb_port"):
                break
            assert kernel.poll() is None, (tmp_path / "kernel.log").read_text()
            assert time.monotonic() < deadline, "the kernel wrote no ports in 60 s"
            time.sleep(0.1)
        yield written, public
    finally:
        kernel.kill()
        kernel.wait()
        log.close()


def _kernel_info(info, context, server_key=None, wait_s=10):
    """kernel_info_request on shell as a DEALER (a CURVE client when
    `server_key` is given); the reply's content, or None after `wait_s`."""
    import zmq
    from jupyter_client.session import Session

    session = Session(key=info["key"].encode())
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if server_key:
        client_public, client_secret = zmq.curve_keypair()
        sock.curve_serverkey = server_key
        sock.curve_publickey = client_public
        sock.curve_secretkey = client_secret
    sock.connect(f"tcp://127.0.0.1:{info['shell_port']}")
    try:
        session.send(sock, "kernel_info_request", {})
        if not sock.poll(wait_s * 1000):
            return None
        _, msg = session.feed_identities(sock.recv_multipart(), copy=True)
        return session.deserialize(msg)["content"]
    finally:
        sock.close()


def test_a_connection_file_with_a_curve_key_makes_every_channel_a_curve_server(curve_kernel):
    import zmq

    from server_helpers import zmtp_mechanism

    info, public = curve_kernel
    # ipykernel writes its file again, without cellblock's field.
    assert "curve_secret_key" not in info
    # Each of the five ports greets with the CURVE mechanism.
    for channel in ("shell", "iopub", "stdin", "control", "hb"):
        assert zmtp_mechanism(info[f"{channel}_port"]) == "CURVE", channel

    context = zmq.Context()
    try:
        # With the kernel's public key: answered, as by any kernel.
        reply = _kernel_info(info, context, server_key=public)
        assert reply is not None and reply["status"] == "ok", reply
        hb = context.socket(zmq.REQ)
        hb.linger = 0
        hb.curve_serverkey = public
        hb.curve_publickey, hb.curve_secretkey = zmq.curve_keypair()
        hb.connect(f"tcp://127.0.0.1:{info['hb_port']}")
        hb.send(b"ping")
        assert hb.poll(10000) and hb.recv() == b"ping"
        hb.close()
        # Without it (the NULL mechanism of a plain Jupyter client), or with
        # another key: the handshake fails and nothing is answered.
        assert _kernel_info(info, context, wait_s=3) is None
        other_public, _ = zmq.curve_keypair()
        assert _kernel_info(info, context, server_key=other_public, wait_s=3) is None
    finally:
        context.term()
