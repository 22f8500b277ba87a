"""Imported images: `cellblock image import` of a rootfs tarball, `image rm`
beside a running session, and what an imported root's own code can do (it
runs as nobody without network; its symlinks never lead the import to the
host). The tarballs are made from the stored python-minimal root (built once
per build tree, see images_helpers.py).
"""
import json
import os
import re
import shutil
import stat
import tempfile

import pytest

import images_helpers as ih
import server_helpers as sh
from images_helpers import store_residue, tar_of_stored_root, unsealed, value
from images_helpers import minimal  # noqa: F401 (the fixture)
from server_helpers import server_factory  # noqa: F401


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


# ---------------------------------------------------------------- zygotes of removed images

def test_removing_a_zygote_image_retires_its_zygote(minimal, server_factory, monkeypatch):
    """A zygote holds its image's root until it ends: once the image's name is
    removed (`image rm`, while the server runs), the zygote is retired at
    once, not kept until the server stops (the runc backend's image_changed).
    A forked session still running keeps its own root and goes on."""
    state = tempfile.mkdtemp(prefix="cb-images-zygote-", dir=ih.BUILD_DIR)
    os.chmod(state, 0o755)
    definition = ih.definition("python-minimal")
    definition.update({"name": "cb-zygote", "zygote": True})
    definition.pop("build", None)
    definition["rootfs"] = "store"
    images_dir = ih.images_dir_with("cb-zygote", definition)
    monkeypatch.setenv("CELLBLOCK_IMAGES_DIR", images_dir)
    tarball = os.path.join(state, "rootfs.tar")
    try:
        tar_of_stored_root(minimal, tarball)
        result = ih.cellblock("image", "import", "cb-zygote", tarball, "--state-dir", state)
        assert result.returncode == 0, result.stdout + result.stderr
        os.unlink(tarball)
        store = os.path.join(state, "images")
        srv = server_factory(["--image-store", store])
        sid, kc, created = srv.open_session(image="cb-zygote")
        assert value(kc, "6 * 7") == 42

        def zygotes():
            listed = srv.ok("session_list_request", {})["content"]["zygotes"]
            return [z for z in listed if z["image"] == "cb-zygote"]

        found = zygotes()
        assert len(found) == 1, found
        zygote_pids = set(found[0]["pids"])
        assert zygote_pids and sh.alive(zygote_pids), found
        assert sh.is_forked(srv.state_dir, sid)

        result = ih.cellblock("image", "rm", "cb-zygote", "--state-dir", state)
        assert result.returncode == 0, result.stderr
        # The server notices the name is gone and retires the zygote.
        assert sh.wait_for(lambda: not zygotes(), timeout=60, interval=0.5), zygotes()
        assert sh.wait_for(lambda: not sh.alive(zygote_pids), timeout=30), \
            f"the zygote's processes {zygote_pids} still run"
        assert "the image is gone; retired" in srv.log()
        # The session forked from it runs on.
        assert value(kc, "6 * 7") == 42
        srv.ok("session_close_request", {"session_id": sid})
        sh.assert_session_gone(srv.state_dir, sid)
    finally:
        shutil.rmtree(images_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
