"""Declarative images, failed builds: a build that fails and one that is
interrupted leave nothing in the store. (python-minimal is built once per
build tree, see images_helpers.py.)
"""
import glob
import os
import shutil
import signal
import subprocess
import time

import images_helpers as ih
from images_helpers import images_dir_with, store_residue
from images_helpers import minimal  # noqa: F401 (the fixture)


# ---------------------------------------------------------------- failures leave nothing

def test_failed_builds_leave_nothing_behind(minimal):
    names = {"cb-broken-pkg": ["python3", "cellblock-no-such-package"],
             "cb-no-ipykernel": ["python3"]}
    defs = {}
    for name, packages in names.items():
        d = ih.definition("python-minimal")
        d["name"] = name
        d["build"]["packages"] = packages
        defs[name] = d
    for name, d in defs.items():
        images_dir = images_dir_with(name, d)
        try:
            result = ih.build(name, images_dir=images_dir)
        finally:
            shutil.rmtree(images_dir, ignore_errors=True)
        assert result.returncode != 0, result.stdout
        if name == "cb-broken-pkg":
            assert "mmdebstrap exited" in result.stderr, result.stderr
        else:
            # mmdebstrap succeeded; the kernel check refused the root.
            assert "check kernel" in result.stderr and "ipykernel" in result.stderr, result.stderr
        assert store_residue(ih.STORE, name) == {}, store_residue(ih.STORE, name)
    # The image built before is untouched.
    assert ih.current("python-minimal")[0] == minimal


def test_interrupted_build_leaves_nothing_behind(minimal):
    name = "cb-interrupted"
    d = ih.definition("python-minimal")
    d["name"] = name
    images_dir = images_dir_with(name, d)
    env = dict(os.environ, CELLBLOCK_IMAGES_DIR=images_dir)
    proc = subprocess.Popen([ih.CELLBLOCK_BIN, "image", "build", name, "--state-dir", ih.STATE_DIR],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            seen.append(line)
            # Mid-way: mmdebstrap has its root and its mounts in the temp dir.
            if "installing essential packages" in line or time.monotonic() > deadline:
                break
        tmp = os.listdir(os.path.join(ih.STORE, "tmp"))
        assert tmp, f"no build in progress when interrupted: {''.join(seen)}"
        proc.send_signal(signal.SIGTERM)
        # mmdebstrap finishes the setup step it is in before it stops (up to 5
        # minutes on a loaded host): cellblock kills its process group 10 s after
        # the signal (kStopGrace). Generous here: a loaded host is slow to unmount.
        rest = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(images_dir, ignore_errors=True)
    assert proc.returncode != 0
    assert "stopped by signal" in rest, rest[-2000:]
    assert store_residue(ih.STORE, name) == {}, store_residue(ih.STORE, name)
    # Nor a process of the build (mmdebstrap, or a dpkg it ran in the root).
    assert processes_under(os.path.join(ih.STORE, "tmp")) == [], rest[-2000:]


def processes_under(path):
    """Live processes whose root or working directory lies under `path`."""
    found = []
    for proc_dir in glob.glob("/proc/[0-9]*"):
        for link in ("root", "cwd"):
            try:
                target = os.readlink(os.path.join(proc_dir, link))
            except OSError:
                continue
            if target == path or target.startswith(path + "/"):
                found.append((proc_dir, link, target))
    return found
