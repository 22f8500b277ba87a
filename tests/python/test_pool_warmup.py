"""The pool's warm-up: every pooled kernel runs one execution before a session
gets it (a fresh interpreter's first execution costs about twice a later one),
and imports its image's `preload` modules. The session must not see the
warm-up: its first execution is number 1, `_`, `In` and `Out` are as in a
fresh kernel. A preload that cannot be imported is a clear start error.
"""
import json
import os
import shutil
import tempfile

import pytest

from server_helpers import execute, server_factory, stream_text, wait_for  # noqa: F401

CELLBLOCK_SOURCE_DIR = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))

PROBE = ("import sys\n"
         "print(repr(_), len(In), len(Out), 'wave' in sys.modules, "
         "'tabnanny' in sys.modules)")


@pytest.fixture
def images_dir(monkeypatch):
    """A copy of the host image as 'host-preload' with two stdlib preloads, and
    one with a module that does not exist."""
    d = tempfile.mkdtemp(prefix="cellblock-test-images-")
    with open(os.path.join(CELLBLOCK_SOURCE_DIR, "images", "host", "image.json")) as f:
        host = json.load(f)
    for name, preload in (("host-preload", ["wave", "tabnanny"]),
                          ("host-badpreload", ["no_such_module_cellblock"])):
        os.makedirs(os.path.join(d, name))
        with open(os.path.join(d, name, "image.json"), "w") as f:
            json.dump(dict(host, name=name, preload=preload), f)
    monkeypatch.setenv("CELLBLOCK_IMAGES_DIR", d)
    yield d
    shutil.rmtree(d)


def first_cell(srv, image):
    reply = srv.create(image=image)
    kc = srv.connect(reply["connection"])
    r, msgs = execute(kc, PROBE)
    assert r["content"]["status"] == "ok", r["content"]
    return reply, r["content"]["execution_count"], stream_text(msgs).split()


def test_warmed_kernel_looks_fresh_and_has_its_preloads(server_factory, images_dir):  # noqa: F811
    srv = server_factory(["--pool", "host=1", "--pool", "host-preload=1"])

    def pool_full():
        pool = srv.ok("server_info_request", {})["content"]["pool"]
        return all(pool[name]["ready"] >= 1 for name in ("host", "host-preload"))

    assert wait_for(pool_full, timeout=120), srv.ok("server_info_request", {})["content"]["pool"]
    plain, count, seen = first_cell(srv, "host")
    assert plain["warm"] is True
    assert count == 1
    # _ is '' and In holds only [''] + this cell; nothing in Out; no preloads.
    assert seen == ["''", "2", "0", "False", "False"], seen

    assert wait_for(pool_full, timeout=120)
    pre, count, seen = first_cell(srv, "host-preload")
    assert pre["warm"] is True
    assert count == 1
    assert seen == ["''", "2", "0", "True", "True"], seen


def test_a_preload_that_fails_is_a_clear_start_error(server_factory, images_dir):  # noqa: F811
    srv = server_factory(["--pool", "host=0"])
    reply = srv.call("session_create_request", {"image": "host-badpreload"}, timeout=120)
    content = reply["content"]
    assert content["status"] == "error"
    assert content["ename"] == "SandboxStartFailed"
    assert "warm-up" in content["evalue"] and "no_such_module_cellblock" in content["evalue"], \
        content["evalue"]
