"""Built images for the tests: python-minimal, built once per build tree.

`cellblock image build` is a real mmdebstrap run from deb.debian.org (about a
minute), so the store lives in the build tree (BUILD/images-test-state/images)
and a build is reused while its stored definition equals
images/python-minimal/image.json. The build (build/) and the ASan build
(build-asan/) keep a store each.
"""
import json
import os
import subprocess

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
