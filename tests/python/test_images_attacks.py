"""The attack suite (test_attacks.py) again, on the built python-minimal image.

Kernel-mode cases go through a kernelspec of the same name whose argv adds
`--image python-minimal --image-store STORE`; server-mode cases get a server
whose default image (and warm pool) is python-minimal. The image is built
once per build tree (images_helpers.py).
"""
import json
import os
import subprocess
import sys
import tempfile

import images_helpers as ih

HERE = os.path.dirname(os.path.abspath(__file__))

PROBE = """
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


def test_attack_suite_passes_on_a_built_image():
    content_id, _, _ = ih.ensure_minimal()
    jupyter = tempfile.mkdtemp(prefix="cb-images-kernelspec-")
    try:
        ih.cellblock("kernelspec", "install", "--prefix", jupyter,
                     "--limit", "exec_timeout_s=600",  # as the build tree's kernelspec
                     "--kernel-arg=--image", "--kernel-arg=python-minimal",
                     "--kernel-arg=--image-store", f"--kernel-arg={ih.STORE}", check=True)
        env = dict(os.environ, JUPYTER_PATH=os.path.join(jupyter, "share", "jupyter"),
                   CELLBLOCK_ATTACK_IMAGE="python-minimal",
                   CELLBLOCK_ATTACK_SERVE_ARGS=json.dumps(["--image", "python-minimal",
                                                           "--image-store", ih.STORE]))
        # The kernelspec really starts python-minimal (no numpy, ipykernel present).
        probe = subprocess.run([sys.executable, "-c", PROBE.format(here=HERE)], env=env, cwd=HERE,
                               capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0 and probe.stdout.strip().endswith("False True"), \
            probe.stdout + probe.stderr
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "test_attacks.py"], env=env, cwd=HERE, capture_output=True,
                               text=True, timeout=840)
        assert suite.returncode == 0, \
            f"the attack suite on python-minimal ({content_id[:12]}) failed:\n{suite.stdout[-12000:]}"
        print(suite.stdout[-3000:])
    finally:
        subprocess.run(["rm", "-rf", jupyter])
