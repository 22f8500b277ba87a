"""A stopping `cellblock serve` does not wait out a kernel that is slow to start.

The pool's workers probe each new kernel for up to 60 s. A server told to stop
while a probe waits used to hold its shutdown for the rest of that minute (seen
on a busy host: "did not exit within 60 s of SIGTERM"). Now the probe is
abandoned at once. The slow kernel here is an image whose kernel never binds
its sockets: only the abandonment can end its probe before 60 s.
"""
import json
import os
import shutil
import tempfile
import time

import server_helpers as sh

HERE = os.path.dirname(os.path.abspath(__file__))
HOST_IMAGE = os.path.join(HERE, "..", "..", "images", "host", "image.json")


def slow_image_dir():
    """An images dir holding `slowstart`: the host image with a kernel that only sleeps."""
    with open(HOST_IMAGE) as f:
        image = json.load(f)
    image["name"] = "slowstart"
    image["kernel_argv"] = ["/usr/bin/python3", "-c", "import time; time.sleep(600)"]
    image["zygote"] = False  # a kernel of its own: booted, not forked
    directory = tempfile.mkdtemp(prefix="cb-slowstart-images-")
    os.makedirs(os.path.join(directory, "slowstart"))
    with open(os.path.join(directory, "slowstart", "image.json"), "w") as f:
        json.dump(image, f)
    return directory


def test_sigterm_abandons_a_kernel_start_still_being_probed(monkeypatch):
    images = slow_image_dir()
    monkeypatch.setenv("CELLBLOCK_IMAGES_DIR", images)
    srv = sh.start_server(["--pool", "slowstart=1", "--pool", "host=0"])
    passed = False
    try:
        # The pool's sandbox is up and its probe is waiting for the kernel's sockets.
        box = sh.wait_for(lambda: [d for d in sh.sessions_on_disk(srv.state_dir)
                                   if sh.session_pids(d)], timeout=60, interval=0.2)
        assert box, f"the pool never started its slowstart sandbox:\n{srv.log()[-3000:]}"
        started = time.monotonic()
        # Exiting at all before the probe's own 60 s deadline proves the abandonment;
        # the bound given here only keeps a hung server from hanging the suite.
        srv.terminate(timeout=120)
        took = time.monotonic() - started
        log = srv.log()
        assert "its start was abandoned (the server is stopping)" in log, log[-3000:]
        assert "did not create its sockets in time" not in log, log[-3000:]
        print(f"serve exited {took:.1f} s after SIGTERM")
        assert sh.state_dir_residue(srv.state_dir) == {}, sh.state_dir_residue(srv.state_dir)
        passed = True
    finally:
        if srv.proc.poll() is None:
            srv.kill9()
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(srv.state_dir, ignore_errors=True)
        # The server's log is kept only when the test failed (it was left in /run before).
        if passed and os.path.exists(srv.log_path):
            os.unlink(srv.log_path)
