"""`cellblock eval --embedded`: a `cellblock serve` started for one run, in a
state dir of its own, stopped at its end."""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

from . import client as cb
from .errors import ServerNotFound


class EmbeddedServer:
    """`cellblock serve` started for this run, in its own state dir, stopped at the end."""

    def __init__(self, binary, parallel, image=None):
        self.binary = binary
        self.state_dir = f"/run/cellblock-eval-{os.getpid()}-{secrets.token_hex(4)}"
        pool_image = image or "host"
        self.args = [binary, "serve", "--state-dir", self.state_dir,
                     "--pool", f"{pool_image}={max(1, min(parallel, 8))}"]
        if image:
            self.args += ["--image", image]
        self.proc = None
        self.log_path = self.state_dir + ".log"

    def start(self, timeout=60):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=self._log)
        file = os.path.join(self.state_dir, "server.json")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerNotFound(f"{' '.join(self.args)} exited with {self.proc.returncode}: "
                                     f"{self.log()[-2000:]}")
            try:
                with open(file) as f:
                    if json.load(f).get("pid") == self.proc.pid:
                        return cb.connect(path=file, timeout=30)
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        self.stop()
        raise ServerNotFound(f"the embedded server wrote no {file} in {timeout} s")

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.proc is not None and self.proc.returncode == 0:
            os.unlink(self.log_path)
        else:
            print(f"cellblock eval: the embedded server exited with "
                  f"{self.proc.returncode if self.proc else '?'}; its log: {self.log_path}",
                  file=sys.stderr)


def find_binary():
    if os.environ.get("CELLBLOCK_BIN"):
        return os.environ["CELLBLOCK_BIN"]
    return shutil.which("cellblock")
