"""Built images for the tests: python-minimal, built once per build tree.

`cellblock image build` is a real mmdebstrap run from deb.debian.org (about a
minute), so the store lives in the build tree (BUILD/images-test-state/images)
and a build is reused while its stored definition equals
images/python-minimal/image.json. The build (build/) and the ASan build
(build-asan/) keep a store each.
"""
import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest

import server_helpers as sh

CELLBLOCK_BIN = os.environ.get("CELLBLOCK_BIN", "cellblock")
SOURCE_DIR = os.environ.get("CELLBLOCK_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUILD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(CELLBLOCK_BIN)))
STATE_DIR = os.path.join(BUILD_DIR, "images-test-state")
STORE = os.path.join(STATE_DIR, "images")


def cellblock(*args, env=None, timeout=900, check=False):
    """Runs `cellblock ARGS`; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    result = subprocess.run([CELLBLOCK_BIN, *args], capture_output=True, text=True,
                            timeout=timeout, env=full_env)
    if check:
        assert result.returncode == 0, \
            f"cellblock {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def build(name, state_dir=STATE_DIR, images_dir=None, timeout=900):
    """`cellblock image build NAME`; returns the CompletedProcess."""
    env = {"CELLBLOCK_IMAGES_DIR": images_dir} if images_dir else None
    return cellblock("image", "build", name, "--state-dir", state_dir, env=env, timeout=timeout)


def definition(name):
    with open(os.path.join(SOURCE_DIR, "images", name, "image.json")) as f:
        return json.load(f)


def current(name, store=STORE):
    """(content id, version dir) of NAME's current version, or (None, None)."""
    link = os.path.join(store, "names", name)
    if not os.path.islink(link):
        return None, None
    vdir = os.path.join(store, "store", os.path.basename(os.readlink(link)))
    try:
        with open(os.path.join(vdir, "manifest.json")) as f:
            return json.load(f)["content_id"], vdir
    except OSError:
        return None, None


def content_id_in(output):
    """The content id a build printed ("image NAME: <64 hex>")."""
    for line in output.splitlines():
        if line.startswith("image ") and ": " in line:
            candidate = line.rsplit(": ", 1)[1].strip()
            if len(candidate) == 64 and all(c in "0123456789abcdef" for c in candidate):
                return candidate
    raise AssertionError(f"no content id in the build's output:\n{output}")


def ensure_minimal():
    """python-minimal's content id, building it unless the store holds a build of
    the current definition. Returns (content id, whether it was built now, output)."""
    id_, vdir = current("python-minimal")
    if id_:
        with open(os.path.join(vdir, "image.json")) as f:
            if json.load(f) == definition("python-minimal"):
                return id_, False, ""
    result = build("python-minimal")
    assert result.returncode == 0, f"building python-minimal failed:\n{result.stdout}\n{result.stderr}"
    return content_id_in(result.stdout), True, result.stdout


HERE = os.path.dirname(os.path.abspath(__file__))

# Starts a kernel through the kernelspec in JUPYTER_PATH and reports whether
# numpy and ipykernel are there: python-minimal has ipykernel and no numpy.
KERNELSPEC_PROBE = """
import os, sys
sys.path.insert(0, {here!r})
from conftest import start_kernel, run_cell, stream_text, stop_kernel
km, kc = start_kernel()
try:
    reply, out = run_cell(kc, "import os; print(os.path.exists('/usr/lib/python3/dist-packages/numpy'), "
                              "os.path.exists('/usr/lib/python3/dist-packages/ipykernel'))")
    print(stream_text(out).strip())
finally:
    stop_kernel(km, kc)
"""


def run_attack_file_on_minimal(test_file, timeout=600):
    """Runs one file of the attack suite (test_attacks_*.py) on python-minimal.

    Kernel-mode cases go through a kernelspec of the same name whose argv adds
    `--image python-minimal --image-store STORE`; server-mode cases get a server
    whose default image (and warm pool) is python-minimal. Returns pytest's output.
    """
    content_id, _, _ = ensure_minimal()
    jupyter = tempfile.mkdtemp(prefix="cb-images-kernelspec-")
    try:
        cellblock("kernelspec", "install", "--prefix", jupyter,
                  "--limit", "exec_timeout_s=600",  # as the build tree's kernelspec
                  "--kernel-arg=--image", "--kernel-arg=python-minimal",
                  "--kernel-arg=--image-store", f"--kernel-arg={STORE}", check=True)
        env = dict(os.environ, JUPYTER_PATH=os.path.join(jupyter, "share", "jupyter"),
                   CELLBLOCK_ATTACK_IMAGE="python-minimal",
                   CELLBLOCK_ATTACK_SERVE_ARGS=json.dumps(["--image", "python-minimal",
                                                           "--image-store", STORE]))
        # The kernelspec really starts python-minimal (no numpy, ipykernel present).
        probe = subprocess.run([sys.executable, "-c", KERNELSPEC_PROBE.format(here=HERE)], env=env,
                               cwd=HERE, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0 and probe.stdout.strip().endswith("False True"), \
            probe.stdout + probe.stderr
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                test_file], env=env, cwd=HERE, capture_output=True, text=True,
                               timeout=timeout)
        assert suite.returncode == 0, \
            f"{test_file} on python-minimal ({content_id[:12]}) failed:\n{suite.stdout[-12000:]}"
        return suite.stdout
    finally:
        subprocess.run(["rm", "-rf", jupyter])


# ---------------------------------------------------------------- for test_images*.py

@pytest.fixture(scope="module")
def minimal():
    """python-minimal's content id (built now or earlier in this build tree)."""
    id_, built_now, output = ensure_minimal()
    if built_now:
        print(output)
    return id_


def run(kc, code, timeout=60):
    """(reply content, stdout) of one execution."""
    reply, iopub = sh.execute(kc, code, timeout=timeout)
    return reply["content"], sh.stream_text(iopub)


def value(kc, expression):
    content, out = run(kc, f"print(repr({expression}))")
    assert content["status"] == "ok", content
    return eval(out.strip())  # our own repr of plain values


def shim_roots(sid, candidates):
    """Which of `candidates` (host dirs) the processes of session `sid` have as
    their root, seen from the host (by inode: the link reads "/" from here)."""
    by_inode = {(os.stat(c).st_dev, os.stat(c).st_ino): c for c in candidates}
    roots = set()
    for pid in sh.session_pids(sid):
        try:
            st = os.stat(f"/proc/{pid}/root")
        except OSError:
            continue
        roots.add(by_inode.get((st.st_dev, st.st_ino), "elsewhere"))
    return roots


def pids_on_root(root):
    """Host pids (not zombies) whose root directory is `root` (by inode)."""
    want = os.stat(root)
    pids = set()
    for path in sh.glob.glob("/proc/[0-9]*/root"):
        pid = int(path.split("/")[2])
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) and \
                sh.proc_state(pid) not in (None, "Z"):
            pids.add(pid)
    return pids


def unsealed(rootfs):
    """([device nodes], [setuid/setgid files]) under rootfs, symlinks not followed."""
    devices, set_id = [], []
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                devices.append(path)
            elif not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                set_id.append(path)
    return devices, set_id


def tar_of_stored_root(content_id, tarball, exclude=()):
    """Writes TARBALL: the stored root of version CONTENT_ID, less the top-level
    entries named in EXCLUDE (what a test then appends is the tarball's own)."""
    rootfs = os.path.join(STORE, "store", content_id, "rootfs")
    excludes = [f"--exclude=./{name}" for name in exclude]
    subprocess.run(["tar", "--create", "--file", tarball, *excludes, "--directory", rootfs, "."],
                   check=True, timeout=300)


def pool_holds(srv, name, content_id, ready=1):
    """server_info's entry for NAME once its pool holds `ready` sandboxes of content_id."""
    entry = srv.ok("server_info_request", {})["content"]["images"][name]
    pool = entry["pool"] or {}
    return entry if entry["pool_content_id"] == content_id and pool.get("ready") == ready else None


def store_residue(store, name):
    """Anything a build of NAME left in the store: temp dirs, a name, versions, mounts."""
    left = {}
    tmp = os.path.join(store, "tmp")
    if os.path.isdir(tmp) and os.listdir(tmp):
        left["tmp"] = os.listdir(tmp)
    if os.path.lexists(os.path.join(store, "names", name)):
        left["name"] = name
    versions = []
    for vdir in sh.glob.glob(os.path.join(store, "store", "*")):
        try:
            with open(os.path.join(vdir, "manifest.json")) as f:
                if json.load(f)["name"] == name:
                    versions.append(vdir)
        except (OSError, ValueError):
            versions.append(vdir)  # a version without a manifest is half-made
    if versions:
        left["versions"] = versions
    mounts = sh.mounts_under(store)
    if mounts:
        left["mounts"] = mounts
    return left


def images_dir_with(name, definition):
    """A temp image dir holding NAME/image.json = definition (for CELLBLOCK_IMAGES_DIR)."""
    d = tempfile.mkdtemp(prefix="cb-images-def-")
    os.makedirs(os.path.join(d, name))
    with open(os.path.join(d, name, "image.json"), "w") as f:
        json.dump(definition, f)
    return d
