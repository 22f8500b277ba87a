"""Boot memory marked for KSM (kernel-shim/cellblock_dedup.py), in real
/usr/bin/python3 processes: what is marked, when, and that nothing is where
the address layout is random. The node's KSM itself is not needed: the
kernel's own VmFlags (`mg`) say what a process marked."""
import json
import os
import subprocess
import textwrap

SOURCE = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SHIM = os.path.join(SOURCE, "kernel-shim")

BODY = textwrap.dedent("""
    import json, mmap, sys
    sys.path.insert(0, %r)
    import cellblock_dedup

    def mergeable_bytes(inside=None):
        # The marked bytes of every mapping, or of the one holding `inside`.
        total, start, end = 0, 0, 0
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
            elif head == "VmFlags:" and "mg" in line.split()[1:]:
                if inside is None or start <= inside < end:
                    total += end - start
        return total

    PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc's (mmap's default is shared)
    memory = cellblock_dedup.BootMemory()
    before = mergeable_bytes()
    memory.mark()  # the kernel's start
    at_start = mergeable_bytes()
    warm = mmap.mmap(-1, 8 << 20, flags=PRIVATE)  # the warm-up's imports
    memory.before_execute(store_history=False)
    memory.mark()
    warm_marked = mergeable_bytes(inside=id_of(warm)) > 0
    memory.before_execute(store_history=True)  # the session's first cell
    late = mmap.mmap(-1, 8 << 20, flags=PRIVATE)  # the session's data
    memory.mark()
    late_marked = mergeable_bytes(inside=id_of(late)) > 0
    print(json.dumps(dict(enabled=memory.enabled, before=before, at_start=at_start,
                          reported=memory.marked, warm=warm_marked, late=late_marked)))
""" % SHIM)

# An anonymous mmap's start address, from ctypes.
ADDRESS = textwrap.dedent("""
    import ctypes
    def id_of(m):
        return ctypes.addressof(ctypes.c_char.from_buffer(m))
""")


def run(fixed_layout):
    argv = ["/usr/bin/python3", "-c", ADDRESS + BODY]
    if fixed_layout:
        argv = ["setarch", "x86_64", "-R"] + argv
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_kernel_with_a_fixed_layout_marks_its_boot_memory_and_never_its_sessions_data():
    seen = run(fixed_layout=True)
    assert seen["enabled"]
    assert seen["before"] == 0
    # The interpreter's heap and its libraries' data: megabytes, all reported.
    assert seen["at_start"] > 4 << 20, seen
    assert seen["reported"] >= seen["at_start"]
    assert seen["warm"], "a mapping made during the warm-up is marked"
    assert not seen["late"], "a mapping made after the first stored cell must never be marked"


def test_a_kernel_with_a_random_layout_marks_nothing():
    seen = run(fixed_layout=False)
    assert not seen["enabled"]
    assert seen["at_start"] == 0 and not seen["warm"] and not seen["late"]
    assert seen["reported"] == 0


def test_only_private_writable_mappings_are_chosen():
    from importlib import util
    spec = util.spec_from_file_location("cellblock_dedup", os.path.join(SHIM, "cellblock_dedup.py"))
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    maps = "\n".join([
        "55d0a0000000-55d0a0001000 r--p 00000000 08:01 1 /usr/bin/python3.11",
        "55d0a0100000-55d0a0102000 rw-p 00100000 08:01 1 /usr/bin/python3.11",
        "55d0a1000000-55d0a2000000 rw-p 00000000 00:00 0                          [heap]",
        "7f0000000000-7f0000100000 rw-s 00000000 00:01 7 /dev/shm/shared",
        "7f0000200000-7f0000300000 rw-p 00000000 00:00 0 ",
        "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]",
        "7ffc00100000-7ffc00104000 r--p 00000000 00:00 0                          [vvar]",
        "garbage",
    ])
    assert module.mergeable_ranges(maps) == [
        (0x55d0a0100000, 0x55d0a0102000), (0x55d0a1000000, 0x55d0a2000000),
        (0x7f0000200000, 0x7f0000300000)]


def test_the_flag_is_refused_without_the_swarm_backend():
    from conftest import CELLBLOCK_BIN
    import shutil
    import tempfile
    state_dir = tempfile.mkdtemp(prefix="cellblock-dedup-")
    try:
        run = subprocess.run([CELLBLOCK_BIN, "serve", "--state-dir", state_dir,
                              "--swarm-share-boot-memory"],
                             capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    assert run.returncode != 0
    assert "--swarm-share-boot-memory is for --backend swarm" in run.stderr + run.stdout


def test_the_engine_profile_is_the_sessions_own_and_lets_the_layout_be_fixed():
    """`cellblock seccomp-profile`: what a node's dockerd is given
    (deploy/swarm/README.md). An allowlist, the denied calls EPERM, and
    `personality` with any argument (Docker's default allows five values,
    not ADDR_NO_RANDOMIZE)."""
    from conftest import CELLBLOCK_BIN
    run = subprocess.run([CELLBLOCK_BIN, "seccomp-profile"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    profile = json.loads(run.stdout)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    allowed = [r for r in profile["syscalls"]
               if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")]
    denied = [r for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ERRNO"
              and r.get("errnoRet") == 1]
    assert any("personality" in r["names"] for r in allowed)
    for call in ("ptrace", "unshare", "mount", "bpf", "keyctl"):
        assert any(call in r["names"] for r in denied), call
        assert not any(call in r["names"] for r in allowed), call
