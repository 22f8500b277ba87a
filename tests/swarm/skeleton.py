"""The node image: an empty root whose programs come from the host's /usr.

Nothing is downloaded: the tar is written here and fed to `docker import`.
A container of this image sees the host's /usr only where it is bound in
(read-only), so the same tar serves the docker-in-docker workers and the
trivial services the tests place on them.
"""

import io
import tarfile
import time

DIRECTORIES = ("etc", "var", "var/lib", "var/lib/docker", "run", "tmp",
               "proc", "sys", "dev", "root", "usr", "opt")
SYMLINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib",
            "lib64": "usr/lib64", "var/run": "../run"}
FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    "etc/hosts": "",
    "etc/resolv.conf": "",
}


def skeleton_tar() -> bytes:
    """The root as an uncompressed tar, the input `docker import -` takes."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in DIRECTORIES:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
            if name == "tmp":
                info.mode = 0o1777
            tar.addfile(info)
        for name, target in SYMLINKS.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, now
            tar.addfile(info)
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, now
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
