"""The exact level on runsc, tried by hand (docs/hibernation.md, "The exact
level on runsc"): not a bench figure; cellblock's shim and kernel launcher,
with this script in the server's place.

A cellblock server starts one `host-gvisor` session, only to lend its bundle
(the image's rootfs, mounts, seccomp profile and its init: cellblock-shim
with the kernel launcher) and its kernel.json. Then, for each run, a
sandbox of that shape starts with the shim's channel bridge on
(CELLBLOCK_BRIDGE: the kernel binds inside the sandbox, the shim holds the
host sockets, kernel-shim/channel_bridge.hpp), this script listening for
its lifeline as the server does, and: a client connects to the host-side
sockets and runs cells that leave variables, a generator, a running thread,
a socketpair with bytes in flight, an open file in /tmp and N MB of random
bytes in a NumPy array; "quiesce" on the lifeline (the shim answers "quiet"
and closes every host socket); `runsc checkpoint`; the sandbox ends;
`runsc restore` from the image into a new bundle with a new ipc dir; SIGUSR1
(`runsc kill`); the shim connects its lifeline again with its key and
listens again; a new client checks that all of it is there and that the
thread went on.

Prints, per run: the quiesce, the checkpoint, the image's size, the restore
until `running`, and until the kernel answered. Run as root from a build,
with the tests' environment (JUPYTER_PATH, CELLBLOCK_BIN,
CELLBLOCK_SOURCE_DIR): /usr/bin/python3 bench/runsc_exact/probe.py [--mb N] [--runs R]
"""
import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
import server_helpers as sh  # noqa: E402
from jupyter_client import BlockingKernelClient  # noqa: E402

CELL_BEFORE = """
import itertools, os, socket, threading, time
import numpy as np
x = 42
count = [0]
def tick():
    while True:
        count[0] += 1
        time.sleep(0.05)
th = threading.Thread(target=tick, daemon=True)
th.start()
gen = itertools.count(100)
next(gen)
a, b = socket.socketpair()
a.send(b'kept in flight')
big = np.frombuffer(os.urandom({mb} * 2**20), dtype=np.uint8)
f = open('/tmp/open.txt', 'w+')
f.write('hello')
f.flush()
time.sleep(0.3)
print(count[0], int(big[:4096].sum()))
"""
INNER = "/tmp/.cellblock-channels"  # the bridge's directory, the sandbox's own tmpfs


def listen_lifeline(ipc):
    """The server's lifeline listener: root's, the sandbox's user may connect."""
    path = os.path.join(ipc, "lifeline.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o666)
    s.listen(1)
    s.settimeout(60)
    return s, path


def take_lifeline(listening):
    s, path = listening
    try:
        conn, _ = s.accept()
    finally:
        s.close()
        os.unlink(path)
    conn.settimeout(60)
    return conn


def read_line(conn):
    line = b""
    while not line.endswith(b"\n"):
        got = conn.recv(1)
        if not got:
            return None
        line += got
    return line.decode().rstrip("\n")


CELL_AFTER = ("f.seek(0)\n"
              "print(x, next(gen), count[0], th.is_alive(), b.recv(100), big.nbytes,"
              " int(big[:4096].sum()), f.read())")


class Probe:
    def __init__(self, template, kernel_json, work):
        self.template, self.kernel_json, self.work = template, kernel_json, work
        self.root = os.path.join(work, "runtime")
        os.makedirs(self.root)
        self.runsc = ["runsc", f"--root={self.root}", "--host-uds=all", "--network=none",
                      "--oci-seccomp"]
        self.started = []

    def call(self, *args, timeout=300):
        r = subprocess.run(self.runsc + list(args), capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"runsc {' '.join(args)}: {r.returncode}: {r.stderr[-800:]}")
        return r

    def bundle(self, name):
        """A bundle shaped like the template's, its own ipc, input and output dirs."""
        bundle, ipc = os.path.join(self.work, name), os.path.join(self.work, name + "-ipc")
        os.makedirs(bundle)
        shutil.copytree(os.path.join(self.template, "rootfs"), os.path.join(bundle, "rootfs"),
                        symlinks=True)
        dirs = {}
        for d in ("ipc", "input", "output"):
            dirs[d] = os.path.join(self.work, f"{name}-{d}")
            os.makedirs(dirs[d], exist_ok=True)
            os.chmod(dirs[d], 0o1777)
        conf = json.load(open(os.path.join(self.template, "config.json")))
        kernel = dict(self.kernel_json, ip=INNER + "/k")
        with open(os.path.join(ipc, "kernel.json"), "w") as f:
            json.dump(kernel, f)
        os.chmod(os.path.join(ipc, "kernel.json"), 0o644)
        # The template's init (the shim and the launcher), bridged; its
        # lifeline at the usual path, no adoption grace (this script gives
        # it a key, as a server with a grace does).
        conf["process"]["env"] = [e for e in conf["process"]["env"]
                                  if not e.startswith("CELLBLOCK_ADOPT_GRACE_MS=")]
        conf["process"]["env"].append(f"CELLBLOCK_BRIDGE={INNER}")
        conf["linux"]["cgroupsPath"] = f"/cellblock-exact-probe/{os.path.basename(self.work)}-{name}"
        sources = {"/run/cellblock": dirs["ipc"], "/data/input": dirs["input"],
                   "/data/output": dirs["output"]}
        for m in conf["mounts"]:
            m["source"] = sources.get(m["destination"], m.get("source"))
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(conf, f)
        return bundle, ipc, dict(self.kernel_json, ip=os.path.join(ipc, "k"))

    def client(self, connection, timeout=120):
        kc = BlockingKernelClient()
        kc.load_connection_info(connection)
        kc.start_channels()
        deadline = time.monotonic() + timeout
        while True:
            kc.kernel_info()
            try:
                kc.get_shell_msg(timeout=0.5)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError("the kernel did not answer")
        return kc

    @staticmethod
    def run(kc, code):
        out = []
        reply = kc.execute_interactive(
            code, timeout=120,
            output_hook=lambda m: out.append(m["content"].get("text", "")
                                             if m["msg_type"] == "stream" else ""))
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content']}")
        return "".join(out).strip()

    def start(self, name, argv):
        self.started.append(name)
        log = open(os.path.join(self.work, name + ".log"), "w")
        return subprocess.Popen(self.runsc + argv, stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)

    def state(self, name):
        return subprocess.run(self.runsc + ["state", name], capture_output=True, text=True)

    def wait_gone(self, name, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            r = self.state(name)
            if r.returncode != 0 and "does not exist" in r.stderr:
                return
            if '"stopped"' in r.stdout:
                self.call("delete", "-force", name)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not end after its checkpoint: {r.stdout}")
            time.sleep(0.02)

    def wait_state(self, name, status, timeout=120):
        deadline = time.monotonic() + timeout
        while f'"{status}"' not in self.state(name).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} is not {status}")
            time.sleep(0.02)

    def once(self, i, mb):
        first, second = f"r{i}a", f"r{i}b"
        bundle, ipc, connection = self.bundle(first)
        listening = listen_lifeline(ipc)
        self.start(first, ["run", "-bundle", bundle, first])
        lifeline = take_lifeline(listening)
        key = secrets.token_hex(16)
        lifeline.sendall(f"adopt-key {key}\n".encode())
        kc = self.client(connection)
        before = self.run(kc, CELL_BEFORE.replace("{mb}", str(mb)))
        kc.stop_channels()
        t = time.monotonic()
        lifeline.sendall(b"quiesce\n")
        said = read_line(lifeline)
        if said != "quiet":
            raise RuntimeError(f"the shim answered {said!r} to quiesce")
        if read_line(lifeline) is not None:
            raise RuntimeError("the lifeline went on after 'quiet'")
        lifeline.close()
        quiesce = time.monotonic() - t
        image = os.path.join(self.work, f"image-{i}")
        os.makedirs(image, mode=0o700)
        t = time.monotonic()
        self.call("checkpoint", f"--image-path={image}", first)
        checkpoint = time.monotonic() - t
        files = {f: os.path.getsize(os.path.join(image, f)) for f in os.listdir(image)}
        size = sum(files.values())
        modes = {f: oct(os.stat(os.path.join(image, f)).st_mode & 0o777) for f in files}
        # The sandbox ends after the checkpoint, and runsc removes its state
        # itself; a delete before it has ended can time out ("stopping
        # container: context deadline exceeded").
        self.wait_gone(first)
        bundle2, ipc2, connection2 = self.bundle(second)
        listening = listen_lifeline(ipc2)
        t = time.monotonic()
        self.start(second, ["restore", f"--image-path={image}", "-bundle", bundle2, second])
        self.wait_state(second, "running")
        running = time.monotonic() - t
        self.call("kill", second, "USR1")
        lifeline = take_lifeline(listening)
        said = read_line(lifeline)
        if said != f"adopt {key}":
            raise RuntimeError(f"the restored shim said {said!r}, not its key")
        lifeline.sendall(b"adopted\n")
        kc = self.client(connection2)
        answered = time.monotonic() - t
        after = self.run(kc, CELL_AFTER)
        kc.stop_channels()
        lifeline.close()  # no grace: the shim ends the sandbox
        self.wait_gone(second)
        print(f"run {i}: {mb} MB: quiesce {quiesce * 1000:.0f} ms, checkpoint {checkpoint:.2f} s, "
              f"image {size / 2**20:.1f} MiB, restore: running {running:.2f} s, "
              f"answered {answered:.2f} s; image files {files}, modes {modes}", flush=True)
        print(f"  before: {before}\n  after:  {after}", flush=True)
        count_before, sum_before = before.split()
        fields = after.split()
        assert fields[0] == "42" and fields[1] == "101", after
        assert int(fields[2]) > int(count_before) and fields[3] == "True", after
        assert "kept in flight" in after and fields[-2] == sum_before and fields[-1] == "hello", after

    def cleanup(self):
        for name in self.started:
            subprocess.run(self.runsc + ["delete", "-force", name], capture_output=True)
        group = f"cellblock-exact-probe/{os.path.basename(self.work)}"
        for controller in os.listdir("/sys/fs/cgroup"):
            base = os.path.join("/sys/fs/cgroup", controller, "cellblock-exact-probe")
            if os.path.isdir(base):
                for d in os.listdir(base):
                    if d.startswith(os.path.basename(self.work)):
                        try:
                            os.rmdir(os.path.join(base, d))
                        except OSError as e:
                            print(f"cgroup {group}: {e}")
                try:
                    os.rmdir(base)  # another probe's may still be there
                except OSError:
                    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    srv = sh.start_server(["--pool", "host=0", "--pool", "host-gvisor=0"])
    work = tempfile.mkdtemp(prefix="cellblock-exact-probe-", dir="/run")
    os.chmod(work, 0o711)  # the sandbox's mapped uids pass through to its dirs
    probe = None
    try:
        sid = srv.create(image="host-gvisor")["session_id"]
        session = os.path.join(srv.state_dir, "sessions", sid)
        kernel_json = json.load(open(os.path.join(session, "ipc", "kernel.json")))
        probe = Probe(os.path.join(session, "bundle"), kernel_json, work)
        for i in range(args.runs):
            probe.once(i, args.mb)
    except Exception:
        for name in sorted(os.listdir(work)):
            if name.endswith(".log"):
                print(f"--- {name}:\n" + open(os.path.join(work, name)).read()[-3000:])
        raise
    finally:
        if probe:
            probe.cleanup()
        shutil.rmtree(work, ignore_errors=True)
        print(srv.shutdown() or "server shut down cleanly")


main()
