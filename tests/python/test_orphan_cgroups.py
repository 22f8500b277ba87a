"""At start the server removes cellblock's empty `cb-*` cgroups older than a
minute (left by runs killed mid-way with their session directories gone), and
leaves alone a young empty one (another server may be creating that sandbox)
and any cgroup that still has tasks."""
import glob
import os
import secrets
import subprocess
import time

from server_helpers import server_factory  # noqa: F401


def make_cgroup(controller, name, age_s):
    path = f"/sys/fs/cgroup/{controller}/cellblock/{name}"
    os.makedirs(path)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_empty_old_orphans_are_removed_young_and_busy_ones_kept(server_factory):  # noqa: F811
    controllers = [c for c in ("pids", "memory", "cpu")
                   if os.path.isdir(f"/sys/fs/cgroup/{c}/cellblock")]
    if not controllers:
        import pytest
        pytest.skip("no cgroup v1 cellblock parents on this host")
    tag = secrets.token_hex(4)
    old = [make_cgroup(c, f"cb-orphan-old-{tag}", 3600) for c in controllers]
    young = make_cgroup(controllers[0], f"cb-orphan-young-{tag}", 0)
    busy = make_cgroup(controllers[0], f"cb-orphan-busy-{tag}", 3600)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        with open(os.path.join(busy, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        srv = server_factory(["--pool", "host=0"])
        assert not [p for p in old if os.path.exists(p)], "old empty orphans were kept"
        assert os.path.isdir(young), "a young empty cgroup was removed"
        assert os.path.isdir(busy), "a cgroup with a task was removed"
        assert sleeper.poll() is None
        for p in old:
            assert f"removed empty cgroup {p}" in srv.log()
    finally:
        sleeper.kill()
        sleeper.wait()
        # The sleeper is gone, so every cgroup the test made is empty now.
        for p in glob.glob(f"/sys/fs/cgroup/*/cellblock/cb-orphan-*-{tag}"):
            try:
                os.rmdir(p)
            except OSError:
                pass
