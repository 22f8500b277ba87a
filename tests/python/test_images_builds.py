"""Declarative images, rebuilds: a changed definition gives a new version while
running sessions keep theirs. (python-minimal is built once per build tree, see
images_helpers.py; test_images.py has the build itself and sessions on it,
test_images_failed_builds.py the builds that fail.)
"""
import os
import shutil

import images_helpers as ih
import server_helpers as sh
from images_helpers import images_dir_with, pids_on_root, pool_holds, run, shim_roots, value
from images_helpers import minimal  # noqa: F401 (the fixture)
from server_helpers import server_factory  # noqa: F401


# ---------------------------------------------------------------- rebuilds

def test_changed_packages_give_a_new_id_and_running_sessions_keep_theirs(minimal, server_factory):
    """A definition with one more package builds to another content id and
    moves the name; a session on the old version runs on undisturbed, the warm
    pool follows the name (its old sandbox destroyed, seen from the host), and
    the next session is warm on the new version. The unchanged definition then
    rebuilds to the very same id, and the pool follows back."""
    srv = server_factory(["--image-store", ih.STORE, "--pool", "python-minimal=1"])
    old_root = os.path.join(ih.STORE, "store", minimal, "rootfs")
    assert sh.wait_for(lambda: pool_holds(srv, "python-minimal", minimal), timeout=90, interval=0.5)
    sid_old, kc_old, created = srv.open_session(image="python-minimal")
    assert created["image_id"] == minimal and created["warm"] is True, created
    assert run(kc_old, "x = 41")[0]["status"] == "ok"
    old_session_pids = set(sh.session_pids(sid_old))
    assert old_session_pids
    # The refill after the take: a second sandbox on the old root, not a session.
    assert sh.wait_for(lambda: pool_holds(srv, "python-minimal", minimal), timeout=90, interval=0.5)
    pooled_old = pids_on_root(old_root) - old_session_pids
    assert pooled_old, "the pool's sandbox of the old version is not on its root"

    changed = ih.definition("python-minimal")
    changed["build"]["packages"].append("hello")  # GNU hello: 50 kB
    images_dir = images_dir_with("python-minimal", changed)
    try:
        result = ih.build("python-minimal", images_dir=images_dir)
        assert result.returncode == 0, result.stdout + result.stderr
        changed_id = ih.content_id_in(result.stdout)
        assert changed_id != minimal
        assert "[1/5] mmdebstrap" in result.stdout and "I: " in result.stdout  # progress shown
        assert ih.current("python-minimal")[0] == changed_id

        # The old session: same root, same kernel, state intact.
        assert value(kc_old, "x + 1") == 42
        assert value(kc_old, "__import__('os').path.exists('/usr/bin/hello')") is False
        assert os.path.isdir(os.path.join(old_root, "usr"))
        assert shim_roots(sid_old, [old_root]) == {old_root}

        # The pool follows the name without a restart: a sandbox of the new
        # version, and the old version's pooled sandbox gone from the host.
        assert sh.wait_for(lambda: pool_holds(srv, "python-minimal", changed_id),
                           timeout=90, interval=0.5), \
            srv.ok("server_info_request", {})["content"]["images"]["python-minimal"]
        assert sh.wait_for(lambda: not (pooled_old & pids_on_root(old_root)), timeout=30), \
            "the old version's pooled sandbox still runs"
        assert old_session_pids <= pids_on_root(old_root)  # the session was not touched
        assert "the pool follows" in srv.log()

        # A new session gets the new version, warm.
        sid_new, kc_new, created_new = srv.open_session(image="python-minimal")
        assert created_new["image_id"] == changed_id and created_new["warm"] is True, created_new
        assert value(kc_new, "__import__('subprocess').run(['/usr/bin/hello'], capture_output=True, "
                             "text=True).stdout") == "Hello, world!\n"
        assert srv.ok("session_history_request", {"session_id": sid_new})["content"]["image_id"] == changed_id
        assert srv.ok("session_history_request", {"session_id": sid_old})["content"]["image_id"] == minimal
    finally:
        shutil.rmtree(images_dir, ignore_errors=True)
        # The unchanged definition: a real rebuild, the same id, the name back.
        result = ih.build("python-minimal")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ih.content_id_in(result.stdout) == minimal
    assert "already stored" in result.stdout
    assert ih.current("python-minimal")[0] == minimal
    # Both sessions still answer, and the pool is back on the first version.
    assert value(kc_old, "x") == 41
    assert value(kc_new, "2 * 21") == 42
    assert sh.wait_for(lambda: pool_holds(srv, "python-minimal", minimal), timeout=90, interval=0.5)
    sid_back, kc_back, created_back = srv.open_session(image="python-minimal")
    assert created_back["image_id"] == minimal and created_back["warm"] is True, created_back
    assert not os.listdir(os.path.join(ih.STORE, "tmp"))
