"""Packages through the egress gateway (docs/network.md): `%pip install` from
a PEP 503 index the test builds and serves on 127.0.0.1 (a wheel made here),
reached by name through the gateway. The package lands in the session's own
home (PIP_TARGET, on the import path), imports in that session in the next
cell and not in any other session, and a package too large for the session's
disk fails with pip's own "No space left on device".
"""
import base64
import hashlib
import http.server
import io
import os
import threading
import zipfile

import pytest

import server_helpers as sh
from server_helpers import execute, stream_text

INDEX = "index.cellblock.test"


def wheel(name, version, modules):
    """A pure-Python wheel: {module file: source}."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = dict(modules)
    files[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    files[f"{dist}.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: cellblock-test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n")
    record = []
    for path, text in files.items():
        data = text if isinstance(text, bytes) else text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, text in files.items():
            z.writestr(path, text)
    return f"{dist}-py3-none-any.whl", out.getvalue()


class Index(http.server.BaseHTTPRequestHandler):
    files = {}  # wheel file name -> bytes
    projects = {}  # normalised project name -> [wheel file names]

    def log_message(self, *args):
        pass

    def do_GET(self):
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        body, kind = None, "text/html"
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in Index.projects:
            links = "".join(
                f'<a href="/files/{f}#sha256={hashlib.sha256(Index.files[f]).hexdigest()}">{f}</a>\n'
                for f in Index.projects[parts[1]])
            body = f"<html><body>{links}</body></html>".encode()
        elif len(parts) == 2 and parts[0] == "files" and parts[1] in Index.files:
            body, kind = Index.files[parts[1]], "application/octet-stream"
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def pkg_server():
    for name, modules in (
        ("cb-tinypkg", {"cb_tinypkg/__init__.py": "VALUE = 'installed through the gateway'\n"}),
        # 3 MB that does not compress: more than a 1 MB home holds.
        ("cb-hugepkg", {"cb_hugepkg/__init__.py": "", "cb_hugepkg/blob.bin": os.urandom(3 << 20)}),
    ):
        filename, data = wheel(name, "1.0", modules)
        Index.files[filename] = data
        Index.projects[name] = [filename]
    index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=index.serve_forever, daemon=True).start()
    port = index.server_address[1]
    srv = sh.start_server([
        "--pool", "host=1",
        "--egress-allow", f"{INDEX}:{port}",
        "--egress-resolve", f"{INDEX}=127.0.0.1",
        "--egress-private", "127.0.0.1/32",
        # Nothing here may ask a DNS server: names not pinned do not resolve.
        "--egress-no-dns",
    ])
    srv.index_url = f"http://{INDEX}:{port}/simple/"
    srv.trusted = f"{INDEX}:{port}"
    yield srv
    problems = srv.shutdown()
    index.shutdown()
    index.server_close()
    assert not problems, "\n".join(problems)


def pip_install(kc, srv, name, timeout=120):
    reply, msgs = execute(kc, f"%pip install --index-url {srv.index_url} "
                              f"--trusted-host {srv.trusted} {name}", timeout=timeout)
    assert reply["content"]["status"] == "ok", reply["content"]
    return stream_text(msgs) + stream_text(msgs, "stderr")


def test_pip_installs_into_the_session_and_the_package_imports(pkg_server):
    limits = {"network": {"mode": "gateway"}}
    sid, kc, _ = pkg_server.open_session(limits=limits)
    out = pip_install(kc, pkg_server, "cb-tinypkg")
    assert "Successfully installed cb-tinypkg-1.0" in out, out
    reply, msgs = execute(kc, "import cb_tinypkg\nprint(cb_tinypkg.VALUE, cb_tinypkg.__file__)")
    assert reply["content"]["status"] == "ok", reply["content"]
    value_and_path = stream_text(msgs)
    assert "installed through the gateway" in value_and_path
    assert "/home/sandbox/.packages/cb_tinypkg/__init__.py" in value_and_path, value_and_path
    # The image is untouched: another session does not have it.
    _, other, _ = pkg_server.open_session(limits=limits)
    reply, msgs = execute(other, "import cb_tinypkg")
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "ModuleNotFoundError", reply["content"]


def test_a_package_larger_than_the_sessions_disk_fails_clearly(pkg_server):
    sid, kc, _ = pkg_server.open_session(limits={"network": {"mode": "gateway"}, "disk_mb": 1})
    out = pip_install(kc, pkg_server, "cb-hugepkg")
    assert "No space left on device" in out, out
    reply, msgs = execute(kc, "import cb_hugepkg")
    assert reply["content"]["status"] == "error", reply["content"]


def test_pip_without_the_gateway_is_told_there_is_no_network(pkg_server):
    sid, kc, _ = pkg_server.open_session()
    out = pip_install(kc, pkg_server, "cb-tinypkg")
    # pip reads the gateway's 403 for the index page as "no versions".
    assert "No matching distribution found for cb-tinypkg" in out, out
    reply, _ = execute(kc, "import cb_tinypkg")
    assert reply["content"]["ename"] == "ModuleNotFoundError", reply["content"]
