"""Figure 8: a Jupyter frontend's kernel start, as jupyter_client does it
(KernelManager.start_kernel → client wait_for_ready → the reply of a first 1+1),
through the cellblock-provisioner kernelspec (a warm session of a running
`cellblock serve`) against the cellblock-python kernelspec (a `cellblock kernel`
process with its own new sandbox): the same client code on both sides."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from client import BenchError
from servers import CELLBLOCK, ROOT, CellblockServer
from stats import Row, summary

PROVISIONED = "cb-bench-provisioned"
KERNEL_MODE = "cb-bench-kernel"


def register_provisioner(tmp):
    """The client package on sys.path and its entry point as an installed
    distribution would declare it (entrypoints reads *.dist-info on sys.path)."""
    dist = os.path.join(tmp, "site", "cellblock-0.1.0.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write("[jupyter_client.kernel_provisioners]\n"
                "cellblock-provisioner = cellblock.provisioner:CellblockProvisioner\n")
    for path in (os.path.join(tmp, "site"), os.path.join(ROOT, "clients", "python")):
        if path not in sys.path:
            sys.path.insert(0, path)


def install(prefix, *args):
    out = subprocess.run([CELLBLOCK, "kernelspec", "install", "--prefix", prefix, *args],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise BenchError(f"kernelspec install {args}: {out.stderr}")


def one_start(ksm, name):
    """Seconds from start_kernel to the execute_reply of 1+1 (checked), and the kernel's warmth."""
    t0 = time.perf_counter()
    km = KernelManager(kernel_name=name, kernel_spec_manager=ksm)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        ready = time.perf_counter()
        msg_id = kc.execute("1+1")
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        done = time.perf_counter()
        if reply["content"].get("status") != "ok":
            raise BenchError(f"1+1 through {name}: {reply['content']}")
        warm = getattr(km.provisioner, "started_warm", None)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {"ready_ms": (ready - t0) * 1000, "reply_ms": (done - t0) * 1000, "warm": warm}


def kernel_start(bench):
    prov_reps, kernel_reps = bench.n(20, 3), bench.n(6, 2)
    tmp = tempfile.mkdtemp(prefix="cellblock-bench-kernel-")
    try:
        register_provisioner(tmp)
        prefix = os.path.join(tmp, "prefix")
        ksm = KernelSpecManager(kernel_dirs=[os.path.join(prefix, "share", "jupyter", "kernels")])
        provisioned, kernel_mode = [], []
        with CellblockServer("kernel-start", {"host": 2}) as srv:
            install(prefix, "--provisioner", "--name", PROVISIONED,
                    "--server-file", os.path.join(srv.state_dir, "server.json"))
            install(prefix, "--name", KERNEL_MODE)
            bench.log("kernel start: waiting for the warm pool")
            srv.wait_pool("host")
            one_start(ksm, PROVISIONED)  # first-use costs of jupyter_client and the provisioner
            one_start(ksm, KERNEL_MODE)
            every = max(1, prov_reps // kernel_reps)
            for i in range(prov_reps):
                srv.wait_pool("host")
                r = one_start(ksm, PROVISIONED)
                if not r["warm"]:
                    raise BenchError("a provisioned kernel from a full pool was not warm")
                provisioned.append(r)
                if i % every == 0 and len(kernel_mode) < kernel_reps:
                    kernel_mode.append(one_start(ksm, KERNEL_MODE))
            while len(kernel_mode) < kernel_reps:
                kernel_mode.append(one_start(ksm, KERNEL_MODE))
        bench.raw["kernel_start"] = {"provisioner": provisioned, "kernel_mode": kernel_mode}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for key, what in (("reply_ms", "start_kernel → execute_reply of the first 1+1"),
                      ("ready_ms", "start_kernel → wait_for_ready returns")):
        p = summary([r[key] for r in provisioned])
        k = summary([r[key] for r in kernel_mode])
        rows.append(Row("8", f"Frontend kernel start (jupyter_client): {what}, through "
                             "cellblock-provisioner (a warm session of `cellblock serve`)",
                        "ms", p, k, "cellblock-python kernelspec (`cellblock kernel`, new sandbox)",
                        note=f"kernel mode ÷ provisioner = {k['median'] / p['median']:.1f}×",
                        detail="no target: how much a frontend gains from the server's pool"))
    return rows
