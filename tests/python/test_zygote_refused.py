"""A host that refuses what forking needs (docs/zygote.md, "What the host must
allow"): the image's sessions boot instead of failing, the server says why
once, and `session_list` and `cellblock ls` show it.

A real refusal, scoped to this test's zygote: its image (the host image under
a name of its own, in a folder of this test's) preloads a module that has the
kernel refuse the zygote user namespaces, as a host policy would (a seccomp
filter: `unshare` with CLONE_NEWUSER fails with EPERM; the zygote's children
inherit it). Nothing of the host's own settings changes.
"""
import os
import shutil
import subprocess
import tempfile

import pytest

import server_helpers as sh

IMAGE = "host-zygote-refused"
MODULE = "cb_refuse_userns"

# Installs, in the process that imports it, a seccomp filter under which
# unshare(CLONE_NEWUSER) fails with EPERM and every other call is allowed.
REFUSE_USERNS = r'''
import ctypes, struct

AUDIT_ARCH_X86_64, NR_UNSHARE, CLONE_NEWUSER = 0xC000003E, 272, 0x10000000
LD_ABS, JEQ, AND, RET = 0x20, 0x15, 0x54, 0x06
ALLOW, EPERM = 0x7FFF0000, 0x00050000 | 1


def insn(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)


program = b"".join([
    insn(LD_ABS, 0, 0, 4),                      # arch
    insn(JEQ, 0, 5, AUDIT_ARCH_X86_64),         # another ABI: allowed
    insn(LD_ABS, 0, 0, 0),                      # nr
    insn(JEQ, 0, 3, NR_UNSHARE),
    insn(LD_ABS, 0, 0, 16),                     # args[0], low half
    insn(AND, 0, 0, CLONE_NEWUSER),
    insn(JEQ, 1, 0, CLONE_NEWUSER),
    insn(RET, 0, 0, ALLOW),
    insn(RET, 0, 0, EPERM),
])
buf = ctypes.create_string_buffer(program)


class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                       ctypes.c_ulong]
prog = Prog(len(program) // 8, ctypes.addressof(buf))
if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    raise OSError(ctypes.get_errno(), "no_new_privs")
if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
    raise OSError(ctypes.get_errno(), "seccomp")
'''


@pytest.fixture(scope="module")
def refusing():
    # Bound into the image's sandboxes at the same path; not under /tmp (a
    # session's own /tmp is a fresh tmpfs).
    modules = tempfile.mkdtemp(prefix="cb-zygote-refused-", dir="/var/tmp")
    os.chmod(modules, 0o755)
    with open(os.path.join(modules, MODULE + ".py"), "w") as f:
        f.write(REFUSE_USERNS)
    os.chmod(os.path.join(modules, MODULE + ".py"), 0o644)
    definition = dict(sh.host_image_definition(), name=IMAGE, zygote=True, preload=[MODULE])
    definition["host_binds"] = definition.get("host_binds", []) + [modules]
    definition["env"] = dict(definition.get("env", {}), PYTHONPATH=modules)
    try:
        srv, images = sh.start_server_with_image(
            definition, ["--image", IMAGE, "--pool", f"{IMAGE}=0", "--pool", "host=0"])
    except BaseException:
        shutil.rmtree(modules, ignore_errors=True)
        raise
    yield srv
    problems = srv.shutdown()
    shutil.rmtree(images, ignore_errors=True)
    shutil.rmtree(modules, ignore_errors=True)
    assert not problems, "\n".join(problems)


def test_the_filter_refuses_a_user_namespace_and_nothing_else():
    """The test's own premise, checked outside any server: the module makes
    unshare(CLONE_NEWUSER) fail with EPERM, and leaves the rest alone."""
    code = ("import ctypes, os, sys; sys.path.insert(0, sys.argv[1]); import " + MODULE + "\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "r = libc.unshare(0x10000000)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0)\n"
            "print(r, ctypes.get_errno(), os.waitpid(pid, 0)[1] == 0)\n")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, MODULE + ".py"), "w") as f:
            f.write(REFUSE_USERNS)
        out = subprocess.run(["/usr/bin/python3", "-c", code, d], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    assert out.split()[:3] == ["-1", "1", "True"], out


def test_a_zygote_image_boots_its_sessions_where_forking_is_refused(refusing):
    sids = []
    for _ in range(2):
        sid, kc, _ = refusing.open_session()
        sids.append(sid)
        assert sh.run_ok(kc, "print(6 * 7)").strip() == "42"
        # Booted by runc, as an image without a zygote: not forked.
        assert not sh.is_forked(refusing.state_dir, sid)
    listing = refusing.ok("session_list_request", {"open_only": True})["content"]
    assert listing["zygotes"] == [], listing["zygotes"]
    (refused,) = listing["zygotes_refused"]
    assert refused["image"] == IMAGE
    assert "unshare user namespace: Operation not permitted" in refused["why"], refused
    # Said once, with the reason, however many sessions booted since.
    log = refusing.log()
    warnings = [line for line in log.splitlines()
                if f"zygote of image {IMAGE}: this host does not let" in line]
    assert len(warnings) == 1, warnings
    assert "its sessions boot instead" in warnings[0]
    # And an operator sees it in `cellblock ls`.
    out = refusing.cli("ls").stdout
    assert f"(zygote of {IMAGE} refused: its sessions boot)" in out, out
    for sid in sids:
        refusing.ok("session_close_request", {"session_id": sid})
