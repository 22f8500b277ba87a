"""Declarative images: `cellblock image build | ls | rm | import`, and sessions on them.

python-minimal is built from images/python-minimal/image.json with
mmdebstrap (once per build tree, see images_helpers.py); the checks look at
the store on disk and at the sandboxes from the host (/proc/<pid>/root),
never only at what cellblock says. python-datasci is too large to build on
every CI run (docs/images.md): numpy is checked on `host` instead.
"""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time

import pytest

import images_helpers as ih
import server_helpers as sh
from server_helpers import server_factory  # noqa: F401


@pytest.fixture(scope="module")
def minimal():
    """python-minimal's content id (built now or earlier in this build tree)."""
    id_, built_now, output = ih.ensure_minimal()
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
    rootfs = os.path.join(ih.STORE, "store", content_id, "rootfs")
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


# ---------------------------------------------------------------- the build

def test_built_image_is_stored_read_only_with_its_packages(minimal):
    id_, vdir = ih.current("python-minimal")
    assert id_ == minimal and os.path.basename(vdir) == minimal
    with open(os.path.join(vdir, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["name"] == "python-minimal" and manifest["source"] == "build", manifest
    assert manifest["suite"] == "bookworm"
    names = {p.split(":")[0] for p in manifest["packages"]}
    assert {"python3", "python3-ipykernel", "libc6"} <= names, sorted(names)
    assert "python3-numpy" not in names
    with open(os.path.join(vdir, "image.json")) as f:
        assert json.load(f) == ih.definition("python-minimal")
    rootfs = os.path.join(vdir, "rootfs")
    assert 50 << 20 < manifest["size_bytes"] < 600 << 20, manifest["size_bytes"]
    # Read-only: no write bit on the root, its dirs or files (but /tmp, a mount point).
    for path in (rootfs, os.path.join(rootfs, "usr"), os.path.join(rootfs, "usr/lib/python3/dist-packages"),
                 os.path.join(rootfs, "usr/bin/python3.11"), os.path.join(rootfs, "etc/passwd")):
        assert os.lstat(path).st_mode & 0o222 == 0, (path, oct(os.lstat(path).st_mode))
    assert stat.S_IMODE(os.lstat(os.path.join(rootfs, "tmp")).st_mode) == 0o1777
    # Sealed: no device node (mmdebstrap makes /dev/null and friends) and no
    # setuid/setgid file (Debian's su, mount, passwd ship setuid).
    assert unsealed(rootfs) == ([], []), unsealed(rootfs)
    # The sandbox's skeleton is in the image: mount points and a generated passwd.
    for point in ("proc", "dev", "sys", "run/cellblock", "data/input", "data/output",
                  "opt/cellblock", "home/sandbox"):
        assert os.path.isdir(os.path.join(rootfs, point)), point
    with open(os.path.join(rootfs, "etc/passwd")) as f:
        assert "sandbox:x:1000:1000:" in f.read()
    with open(os.path.join(rootfs, "etc/resolv.conf")) as f:
        assert f.read() == ""  # the build host's resolver stays out
    assert not os.listdir(os.path.join(ih.STORE, "tmp"))
    # `image ls` shows it.
    listed = json.loads(ih.cellblock("image", "ls", "--json", "--state-dir", ih.STATE_DIR,
                                     check=True).stdout)
    rows = {r["name"]: r for r in listed}
    assert rows["python-minimal"]["content_id"] == minimal, rows["python-minimal"]
    assert rows["host"]["rootfs"] == "host"
    text = ih.cellblock("image", "ls", "--state-dir", ih.STATE_DIR, check=True).stdout
    assert minimal[:12] in text and "python-minimal" in text, text


def test_building_an_unknown_definition_names_the_buildable_ones():
    result = ih.cellblock("image", "build", "no-such-image", "--state-dir", ih.STATE_DIR)
    assert result.returncode != 0
    assert "no image definition 'no-such-image'" in result.stderr, result.stderr
    assert "python-minimal" in result.stderr  # the ones that can be built are named


# ---------------------------------------------------------------- sessions

def test_session_on_built_image_beside_host(minimal, server_factory):
    """python-minimal runs code and lacks numpy; host, side by side, has it.
    Both sessions on python-minimal share the one read-only root; what they
    write goes to their own tmpfs."""
    srv = server_factory(["--image-store", ih.STORE])
    sid_min, kc_min, created = srv.open_session(image="python-minimal")
    sid_host, kc_host, created_host = srv.open_session(image="host")
    sid_min2, kc_min2, _ = srv.open_session(image="python-minimal")
    assert created["image"] == "python-minimal" and created["image_id"] == minimal, created
    assert created_host["image_id"] == ""

    # Both run at once: each is sent its code before either is read.
    msg_min = kc_min.execute("import sys; print(sys.version_info[:2], 6 * 7)")
    msg_host = kc_host.execute("import numpy; print(numpy.__version__, numpy.arange(4).sum())")
    reply_min, io_min, _ = sh.collect_execution(kc_min, msg_min)
    reply_host, io_host, _ = sh.collect_execution(kc_host, msg_host)
    assert reply_min["content"]["status"] == "ok" and "42" in sh.stream_text(io_min)
    assert reply_host["content"]["status"] == "ok" and sh.stream_text(io_host).split()[1] == "6"

    content, _ = run(kc_min, "import numpy")
    assert content["status"] == "error" and content["ename"] == "ModuleNotFoundError", content
    assert "numpy" in content["evalue"]
    assert value(kc_min, "__import__('os').path.exists('/usr/lib/python3/dist-packages/numpy')") is False
    assert value(kc_host, "__import__('os').path.exists('/usr/lib/python3/dist-packages/numpy')") is True

    # From the host: the sessions' processes live in the stored root, shared, not copied.
    rootfs = os.path.join(ih.STORE, "store", minimal, "rootfs")
    assert shim_roots(sid_min, [rootfs]) == {rootfs}, shim_roots(sid_min, [rootfs])
    assert shim_roots(sid_min2, [rootfs]) == {rootfs}
    assert shim_roots(sid_host, [rootfs]) == {"elsewhere"}

    # Writes: the root is read-only, /tmp is the session's own tmpfs.
    content, _ = run(kc_min, "open('/usr/cellblock-was-here', 'w')")
    assert content["ename"] == "OSError" and "Read-only file system" in content["evalue"], content
    content, _ = run(kc_min, "open('/tmp/mine', 'w').write('session 1')")
    assert content["status"] == "ok"
    assert value(kc_min2, "__import__('os').path.exists('/tmp/mine')") is False
    assert not os.path.exists(os.path.join(rootfs, "tmp", "mine"))
    # /usr is mounted nosuid in a built image as in `host`.
    assert value(kc_min, "any(l.split()[4] == '/usr' and 'nosuid' in l.split()[5] "
                         "for l in open('/proc/self/mountinfo'))") is True

    # The registry records the content id.
    history = srv.ok("session_history_request", {"session_id": sid_min})["content"]
    assert history["image"] == "python-minimal" and history["image_id"] == minimal, history
    created_event = [e for e in history["events"] if e["kind"] == "created"]
    assert created_event and minimal in created_event[0]["detail"], history["events"]
    assert srv.info_of(sid_min)["image_id"] == minimal
    assert srv.ok("session_history_request", {"session_id": sid_host})["content"]["image_id"] == ""
    out = srv.cli("history", sid_min, "--json").stdout
    assert json.loads(out)["image_id"] == minimal


def test_unknown_and_unbuilt_images_are_clear_errors(minimal, server_factory):
    srv = server_factory(["--image-store", ih.STORE])
    reply = srv.call("session_create_request", {"image": "no-such-image"})["content"]
    assert reply["status"] == "error" and reply["ename"] == "UnknownImage", reply
    assert "no image 'no-such-image'" in reply["evalue"]
    for name in ("host", "python-minimal", "python-datasci"):
        assert name in reply["evalue"], reply["evalue"]
    # A defined image with no build in the store.
    empty_store = tempfile.mkdtemp(prefix="cb-images-empty-")
    try:
        srv2 = server_factory(["--image-store", empty_store])
        reply = srv2.call("session_create_request", {"image": "python-minimal"})["content"]
        assert reply["status"] == "error" and reply["ename"] == "ImageNotBuilt", reply
        assert "cellblock image build python-minimal" in reply["evalue"], reply
    finally:
        shutil.rmtree(empty_store, ignore_errors=True)


def test_server_info_lists_images_and_a_warm_pool_on_a_built_image(minimal, server_factory):
    srv = server_factory(["--image-store", ih.STORE, "--pool", "python-minimal=1"])
    _, vdir = ih.current("python-minimal")
    with open(os.path.join(vdir, "manifest.json")) as f:
        size = json.load(f)["size_bytes"]

    def pool_ready():
        info = srv.ok("server_info_request", {})["content"]
        return info if (info["images"]["python-minimal"]["pool"] or {}).get("ready") == 1 else None

    info = sh.wait_for(pool_ready, timeout=90, interval=0.5)
    assert info, srv.ok("server_info_request", {})["content"]["images"]
    entry = info["images"]["python-minimal"]
    assert entry["built"] is True and entry["content_id"] == minimal, entry
    assert entry["size_bytes"] == size and entry["source"] == "build", entry
    assert entry["pool_content_id"] == minimal and entry["pool"]["target"] == 1, entry
    assert info["images"]["host"]["rootfs"] == "host"
    assert "content_id" not in info["images"]["host"]
    assert info["images"]["python-datasci"]["preload"] == ["numpy", "pandas", "matplotlib"]
    # A warm sandbox of the built image, handed out with its content id.
    sid, kc, created = srv.open_session(image="python-minimal")
    assert created["warm"] is True and created["image_id"] == minimal, created
    assert run(kc, "print(1 + 1)")[1].strip() == "2"
    assert srv.ok("session_history_request", {"session_id": sid})["content"]["image_id"] == minimal


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
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(images_dir, ignore_errors=True)
    assert proc.returncode != 0
    assert "stopped by signal" in rest, rest[-2000:]
    assert store_residue(ih.STORE, name) == {}, store_residue(ih.STORE, name)


# ---------------------------------------------------------------- import, rm

def test_import_a_rootfs_tarball_then_rm_spares_a_running_session(minimal, server_factory):
    state = tempfile.mkdtemp(prefix="cb-images-import-", dir=ih.BUILD_DIR)
    os.chmod(state, 0o755)
    tarball = os.path.join(state, "rootfs.tar")
    try:
        tar_of_stored_root(minimal, tarball)
        # What a hostile tarball may carry: device nodes (a character device
        # world-readable and writable, a block device) and a setuid-root file.
        import tarfile
        with tarfile.open(tarball, "a") as tar:
            for name, kind, major, minor in (("./usr/share/cb-mem", tarfile.CHRTYPE, 1, 1),
                                             ("./usr/share/cb-tty", tarfile.CHRTYPE, 5, 0),
                                             ("./var/cb-disk", tarfile.BLKTYPE, 7, 200)):
                node = tarfile.TarInfo(name)
                node.type, node.devmajor, node.devminor, node.mode = kind, major, minor, 0o666
                tar.addfile(node)
            suid = tarfile.TarInfo("./usr/bin/cb-suid")
            suid.mode, suid.size = 0o6755, len(b"#!/bin/sh\nid\n")
            tar.addfile(suid, __import__("io").BytesIO(b"#!/bin/sh\nid\n"))
        result = ih.cellblock("image", "import", "cb-imported", tarball, "--state-dir", state)
        assert result.returncode == 0, result.stdout + result.stderr
        imported = ih.content_id_in(result.stdout)
        removed = int(re.search(r"(\d+) device node\(s\) removed", result.stdout).group(1))
        assert removed >= 3, result.stdout
        os.unlink(tarball)
        store = os.path.join(state, "images")
        id_, vdir = ih.current("cb-imported", store)
        assert id_ == imported
        with open(os.path.join(vdir, "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["source"] == "import" and len(manifest["tarball_sha256"]) == 64
        stored_root = os.path.join(vdir, "rootfs")
        assert unsealed(stored_root) == ([], []), unsealed(stored_root)
        assert stat.S_IMODE(os.lstat(os.path.join(stored_root, "usr/bin/cb-suid")).st_mode) == 0o555

        srv = server_factory(["--image-store", store])
        # While `image rm` holds a version (its exclusive lock), no sandbox
        # starts on it: a clear error, and the next create works.
        import fcntl
        manifest_path = os.path.join(vdir, "manifest.json")
        with open(manifest_path) as removing:
            fcntl.flock(removing, fcntl.LOCK_EX)
            reply = srv.call("session_create_request", {"image": "cb-imported"})["content"]
        assert reply["status"] == "error" and reply["ename"] == "SandboxStartFailed", reply
        assert "is being removed" in reply["evalue"], reply
        sid, kc, created = srv.open_session(image="cb-imported")
        assert created["image_id"] == imported
        assert value(kc, "6 * 7") == 42
        # Inside: none of the nodes, the file without its bits, and the
        # sandbox's own /dev/null.
        assert value(kc, "[__import__('os').path.lexists(p) for p in "
                         "('/usr/share/cb-mem', '/usr/share/cb-tty', '/var/cb-disk')]") == [False] * 3
        assert value(kc, "oct(__import__('os').stat('/usr/bin/cb-suid').st_mode & 0o7777)") == "0o555"
        assert value(kc, "open('/dev/null', 'w').write('x')") == 1

        # The session holds its version (a shared flock on manifest.json,
        # taken before its runtime starts): an exclusive lock cannot be had.
        with open(manifest_path) as probe_lock:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

        # rm while the session runs: the name goes, the version in use stays.
        result = ih.cellblock("image", "rm", "cb-imported", "--state-dir", state)
        assert result.returncode == 0, result.stderr
        assert "kept" in result.stdout, result.stdout
        assert ih.current("cb-imported", store) == (None, None)
        assert os.path.isdir(vdir)
        assert value(kc, "6 * 7") == 42
        reply = srv.call("session_create_request", {"image": "cb-imported"})["content"]
        assert reply["ename"] == "ImageNotBuilt", reply

        srv.ok("session_close_request", {"session_id": sid})
        sh.assert_session_gone(srv.state_dir, sid)
        # A sandbox still starting has no process on the root yet, only its
        # hold on the version: rm keeps the version for it.
        with open(manifest_path) as starting:
            fcntl.flock(starting, fcntl.LOCK_SH)
            result = ih.cellblock("image", "rm", "cb-imported", "--state-dir", state)
            assert result.returncode == 0 and "kept" in result.stdout, result.stdout + result.stderr
            assert os.path.isdir(vdir)
        result = ih.cellblock("image", "rm", "cb-imported", "--state-dir", state)
        assert result.returncode == 0, result.stderr
        assert not os.path.exists(vdir)
        result = ih.cellblock("image", "rm", "cb-imported", "--state-dir", state)
        assert result.returncode != 0 and "not in the store" in result.stderr
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_an_imported_roots_own_code_runs_as_nobody_without_network(minimal):
    """`image import` starts the image's Python to check its kernel imports.
    An imported root is not trusted: that check must not run as root, reach
    the host's network, or change the root (a symlink planted then would steer
    the steps after the check). The tarball's own code (a .pth file Python
    runs at start) reports what it could do by failing the check on purpose,
    and a host listener on 127.0.0.1 must see no connection."""
    import socket
    import tarfile

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    probe = (
        "import errno, os, socket, sys\n"
        "out = ['uid=%d,%d gid=%d,%d groups=%s' % (os.getuid(), os.geteuid(), os.getgid(),\n"
        "       os.getegid(), os.getgroups())]\n"
        "def attempt(name, action):\n"
        "    try:\n"
        "        action(); out.append(name + '=ok')\n"
        "    except OSError as e:\n"
        "        out.append(name + '=' + errno.errorcode.get(e.errno, type(e).__name__))\n"
        f"attempt('net', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2))\n"
        "attempt('rootwrite', lambda: open('/cbprobe/out.txt', 'w'))\n"
        "attempt('symlink', lambda: os.symlink('/etc', '/cbprobe/etc-link'))\n"
        "attempt('tmpwrite', lambda: open('/tmp/cbprobe-tmp', 'w').write('x'))\n"
        "print('CBPROBE ' + ' '.join(out), file=sys.stderr)\n"
        "os._exit(3)\n")
    state = tempfile.mkdtemp(prefix="cb-images-probe-", dir=ih.BUILD_DIR)
    os.chmod(state, 0o755)
    tarball = os.path.join(state, "rootfs.tar")
    try:
        tar_of_stored_root(minimal, tarball)
        site = "./usr/lib/python3/dist-packages"
        with tarfile.open(tarball, "a") as tar:
            # A directory open to everyone (so only the read-only mount stops writes).
            outdir = tarfile.TarInfo("./cbprobe")
            outdir.type, outdir.mode = tarfile.DIRTYPE, 0o777
            tar.addfile(outdir)
            for name, text in (("cbprobe.py", probe), ("cbprobe.pth", "import cbprobe\n")):
                path = os.path.join(state, name)
                with open(path, "w") as f:
                    f.write(text)
                info = tar.gettarinfo(path, arcname=f"{site}/{name}")
                info.uid = info.gid = 0
                info.mode = 0o644
                with open(path, "rb") as f:
                    tar.addfile(info, f)
        result = ih.cellblock("image", "import", "cb-probed", tarball, "--state-dir", state)
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "check kernel" in output, output
        line = next((l for l in output.splitlines() if "CBPROBE " in l), None)
        assert line, output
        seen = line.split("CBPROBE ", 1)[1].split()
        assert seen[0] == "uid=65534,65534" and seen[1] == "gid=65534,65534", seen
        assert seen[2] == "groups=[]", seen
        assert seen[3] in ("net=ENETUNREACH", "net=ECONNREFUSED", "net=TimeoutError"), seen
        assert seen[4] == "rootwrite=EROFS" and seen[5] == "symlink=EROFS", seen
        assert seen[6] == "tmpwrite=ok", seen  # a private tmpfs, gone with the check
        with pytest.raises(socket.timeout):
            listener.accept()
        # The failed import left nothing: no name, no version, no temp dir, no mount.
        assert store_residue(os.path.join(state, "images"), "cb-probed") == {}
    finally:
        listener.close()
        shutil.rmtree(state, ignore_errors=True)


def test_an_imported_roots_symlinks_never_lead_the_import_to_the_host(minimal):
    """A tarball whose top-level dirs are symlinks to host directories
    (`./etc -> /etc` would have had the import delete and rewrite the host's
    /etc/passwd). Here they point at decoy directories on the host, each
    holding a sentinel file: the import must leave every decoy exactly as it
    was, and the stored root must have real directories there."""
    import tarfile

    state = tempfile.mkdtemp(prefix="cb-images-links-", dir=ih.BUILD_DIR)
    os.chmod(state, 0o755)
    decoys = tempfile.mkdtemp(prefix="cb-decoys-")
    linked = ["etc", "tmp", "dev", "run", "opt", "data", "home", "proc", "sys"]
    nested = {"dev/shm": "devshm", "data/input": "datainput", "run/cellblock": "runcb"}

    def snapshot():
        out = {}
        for dirpath, dirnames, filenames in os.walk(decoys):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                content = open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None
                out[os.path.relpath(path, decoys)] = (st.st_mode, content)
        return out

    for name in linked + list(nested.values()):
        os.makedirs(os.path.join(decoys, name))
        for sentinel in ("passwd", "hosts", "sentinel"):
            with open(os.path.join(decoys, name, sentinel), "w") as f:
                f.write(f"decoy {name}/{sentinel}\n")
        os.chmod(os.path.join(decoys, name), 0o700)
    before = snapshot()

    def import_with_links(name, links, exclude=()):
        """Imports the stored minimal root (less EXCLUDE) plus the symlinks
        LINKS {path in the tarball: decoy}; returns the stored root."""
        tarball = os.path.join(state, f"{name}.tar")
        tar_of_stored_root(minimal, tarball, exclude)
        with tarfile.open(tarball, "a") as tar:
            for path, decoy in links.items():
                link = tarfile.TarInfo(f"./{path}")
                link.type, link.linkname = tarfile.SYMTYPE, os.path.join(decoys, decoy)
                tar.addfile(link)
        result = ih.cellblock("image", "import", name, tarball, "--state-dir", state)
        assert snapshot() == before, f"{name}: the import wrote through a symlink to the host"
        assert result.returncode == 0, result.stdout + result.stderr
        return os.path.join(ih.current(name, os.path.join(state, "images"))[1], "rootfs")

    try:
        stored = import_with_links("cb-linked", {name: name for name in linked}, exclude=linked)
        for name in linked:
            assert stat.S_ISDIR(os.lstat(os.path.join(stored, name)).st_mode), name
        with open(os.path.join(stored, "etc", "passwd")) as f:
            assert "sandbox:x:" in f.read()

        # The same with symlinks one level down (the tarball's own /dev and
        # /data are real; their mount points are not).
        stored = import_with_links("cb-linked2", nested)
        for path in nested:
            assert stat.S_ISDIR(os.lstat(os.path.join(stored, path)).st_mode), path
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(decoys, ignore_errors=True)
