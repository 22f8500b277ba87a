"""Declarative images: `cellblock image build | ls | rm | import`, and sessions on them.

python-minimal is built from images/python-minimal/image.json with
mmdebstrap (once per build tree, see images_helpers.py); the checks look at
the store on disk and at the sandboxes from the host (/proc/<pid>/root),
never only at what cellblock says. python-datasci is too large to build on
every CI run (docs/images.md): numpy is checked on `host` instead.
"""
import json
import os
import shutil
import stat
import tempfile

import images_helpers as ih
import server_helpers as sh
from images_helpers import run, shim_roots, unsealed, value
from images_helpers import minimal  # noqa: F401 (the fixture)
from server_helpers import server_factory  # noqa: F401


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
    assert info["images"]["python-datasci"]["preload"] == [
        "numpy", "pandas", "matplotlib", "matplotlib.pyplot", "matplotlib.backends.backend_agg",
        "scipy.stats", "seaborn"]
    # A warm sandbox of the built image, handed out with its content id.
    sid, kc, created = srv.open_session(image="python-minimal")
    assert created["warm"] is True and created["image_id"] == minimal, created
    assert run(kc, "print(1 + 1)")[1].strip() == "2"
    assert srv.ok("session_history_request", {"session_id": sid})["content"]["image_id"] == minimal
