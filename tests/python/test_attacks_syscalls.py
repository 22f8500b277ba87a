"""The attack suite, system calls: every call of the seccomp policy with
arguments the kernel would reject on its own, through the x86-64, i386 and x32
ABIs, and newer variants of denied calls.

HostWatch (attack_helpers.py) judges the host after every case: only what this
suite's own sessions could have changed, so that a busy shared host gives the
same verdict. A case that finds a gap FAILS and says what got through: the fix
belongs in the C++ code, never in a weaker assertion here. Traffic only ever
goes to 127.0.0.0/8, ::1 or unix sockets.
"""
import errno
import json
import platform
import re
import signal
import subprocess
import sys

import pytest

from attack_helpers import (CLONE_NS_FLAGS, CLONE_THREAD, INVALID_ARGS, NR32, NR64, SYSCALL_HELPER,
                            errname, gaps)
from attack_helpers import box, host, host_unchanged, shared_session  # the fixtures
from test_containment import cell, run_ok

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="raw syscall numbers and the i386 trampoline are x86-64's")


def test_raw_syscalls_with_invalid_arguments_are_stopped_by_the_policy(box):
    """Every call of the brief and of the profile, with arguments the kernel would reject
    on its own: EPERM/ENOSYS means the policy stopped it; EFAULT, EBADF, EINVAL, any
    other errno or a success means it reached the kernel: a GAP, named below.

    EPERM can also be a kernel capability check (e.g. reboot checks CAP_SYS_BOOT
    before its arguments); test_posture.py reads the loaded filter itself to tell."""
    calls = [(name, NR64[name], args) for name, args in INVALID_ARGS.items() if name in NR64]
    missing = sorted(set(INVALID_ARGS) - set(NR64))
    assert not missing, f"no x86-64 number for {missing}"
    calls += [(f"clone({flag}|CLONE_THREAD)", NR64["clone"], (bit | CLONE_THREAD, 0, 0, 0, 0))
              for flag, bit in CLONE_NS_FLAGS.items()]
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + f"""
import os
result = {{}}
me = os.getpid()
for name, nr, args in {calls!r}:
    rc = sc(nr, *args)
    if rc == 0 and os.getpid() != me:
        os._exit(0)  # a clone got through and this is the child: leave at once
    result[name] = rc
result['clone3'] = sc({NR64['clone3']}, 0, 0)
"""))
    clone3 = inside.pop("clone3")
    assert clone3 == -errno.ENOSYS, \
        f"clone3 must fail with ENOSYS (glibc then falls back to the filterable clone): {errname(-clone3)}"
    assert set(inside) == {name for name, _, _ in calls}, inside
    found = gaps(inside)
    assert found == {}, "these syscalls reached the kernel (GAP in the seccomp policy): " + \
        ", ".join(f"{name} -> {what}" for name, what in sorted(found.items()))


# The i386 names of the same operations. umount, stime, clock_settime64 and
# clock_adjtime64 exist only there: a deny-list of x86-64 names misses them.

I386_CALLS = {
    "mount": (0, 0, 0, 0, 0), "umount": (0,), "umount2": (0, 0), "pivot_root": (0, 0),
    "unshare": (-1,), "setns": (-1, 0), "ptrace": (-1, 0, 0, 0), "keyctl": (-1, 0, 0, 0, 0),
    "add_key": (0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0), "bpf": (-1, 0, 0),
    "userfaultfd": (-1,), "io_uring_setup": (0, 0), "perf_event_open": (0, 0, -1, -1, 0),
    "kexec_load": (0, 0, 0, 0), "init_module": (0, 0, 0), "finit_module": (-1, 0, 0),
    "delete_module": (0, 0), "open_by_handle_at": (-1, 0, 0), "reboot": (0, 0, 0, 0),
    "swapon": (0, 0), "swapoff": (0,), "clock_settime": (-1, 0), "clock_settime64": (-1, 0),
    "clock_adjtime": (-1, 0), "clock_adjtime64": (-1, 0), "settimeofday": (0, 0), "stime": (0,),
    "sethostname": (0, 0), "setdomainname": (0, 0), "acct": (0,), "quotactl": (0, 0, 0, 0),
    "syslog": (10, 0, 0), "process_vm_readv": (0, 0, 0, 0, 0), "pidfd_getfd": (-1, -1, 0),
    "fsopen": (0, 0), "fsmount": (-1, 0, 0), "move_mount": (-1, 0, -1, 0, 0),
    "open_tree": (-1, 0, 0), "chroot": (0,), "name_to_handle_at": (-1, 0, 0, 0, 0),
    "fanotify_init": (-1, 0), "kcmp": (0, 0, -1, 0, 0), "iopl": (0,), "ioperm": (0, 0, 0),
}


# Run as a program of its own: on the host (getpid only: the other calls, made by
# root, could change the host) and in a subprocess inside the sandbox (every
# call). A kernel without IA32 emulation kills the process at its first `int
# 0x80` (SIGSEGV), so the shared session's kernel never makes the call itself.
# Each result is printed and flushed at once: a crash shows how far it got.
I386_PROBE = SYSCALL_HELPER + """
import json, os, sys
def report(label, rc):
    print(json.dumps([label, rc]), flush=True)
report('getpid', [sc32({getpid}), os.getpid()])
if sys.argv[1:] == ['all']:
    me = os.getpid()
    for name, nr, args in {calls!r}:
        rc = sc32(nr, *args)
        if rc == 0 and os.getpid() != me:
            os._exit(0)
        report('i386 ' + name, rc)
    for family in (40, 16, 2):  # AF_VSOCK, AF_NETLINK, AF_INET through socketcall and socket
        ctypes.memmove(I386_ARGS, (ctypes.c_uint * 3)(family, 1 if family != 16 else 3, 0), 12)
        rc = sc32({socketcall}, 1, I386_ARGS)
        if rc >= 0: os.close(rc)
        report(f'i386 socketcall(SOCKET, {{family}})', rc)
        rc = sc32({socket}, family, 1 if family != 16 else 3, 0)
        if rc >= 0: os.close(rc)
        report(f'i386 socket({{family}})', rc)
    report('i386 clone3', sc32({clone3}, 0, 0))
"""


def _i386_outcome(returncode, results):
    """What `int 0x80` did for getpid: 'works', or how the kernel refused it."""
    if "getpid" in results:
        pid32, pid = results["getpid"]
        return "works" if pid32 == pid else f"refused ({errname(-pid32)})"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"no answer (exit {returncode})"


def host_i386_abi(probe):
    """What `int 0x80` does for getpid on the host, outside any sandbox ('works',
    or how the kernel refused it), and the probe's results."""
    on_host = subprocess.run([sys.executable, "-c", probe, "getpid"], capture_output=True,
                             text=True, timeout=60)
    results = dict(json.loads(line) for line in on_host.stdout.splitlines())
    return _i386_outcome(on_host.returncode, results)


def i386_probe(calls=()):
    return I386_PROBE.format(getpid=NR32["getpid"], calls=list(calls),
                             socketcall=NR32["socketcall"], socket=NR32["socket"],
                             clone3=NR32["clone3"])


def test_i386_and_x32_syscall_abis_are_filtered_too(box):
    """The same calls through `int 0x80` and the x32 numbering: the filter must cover
    every ABI the kernel accepts.

    Whether the kernel accepts i386 calls at all is probed on the host first, with
    the same trampoline outside any sandbox: a kernel built or booted without IA32
    emulation (ia32_emulation=0, as on 6.18.44-fc-v769) kills the caller with
    SIGSEGV at its first `int 0x80`. Then, in the sandbox, a refusal or that same
    SIGSEGV is containment; where the host's call works, every call must reach the
    policy and be refused by it. The i386 calls run in a subprocess inside the
    sandbox, so the shared session survives either way."""
    calls = [(name, NR32[name], args) for name, args in I386_CALLS.items() if name in NR32]
    calls += [(f"clone({flag}|CLONE_THREAD)", NR32["clone"], (bit | CLONE_THREAD, 0, 0, 0, 0))
              for flag, bit in CLONE_NS_FLAGS.items()]
    probe = i386_probe(calls)
    host_abi = host_i386_abi(probe)
    x32 = {name: 0x40000000 | NR64[name] for name in ("unshare", "mount", "setns", "ptrace",
                                                       "keyctl", "bpf", "pivot_root")}
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + f"""
import json, subprocess, sys
run = subprocess.run([sys.executable, '-c', {probe!r}, 'all'], capture_output=True, text=True,
                     timeout=120)
result = {{'returncode': run.returncode, 'stderr': run.stderr[-2000:],
          'i386': [json.loads(line) for line in run.stdout.splitlines()]}}
for name, nr in {x32!r}.items():
    result['x32 ' + name] = sc(nr, -1, 0, 0, 0, 0)
"""))
    returncode, stderr = inside.pop("returncode"), inside.pop("stderr")
    results = dict(inside.pop("i386"))
    sandbox_abi = _i386_outcome(returncode, results)
    # x32: a plain syscall with the x32 bit, on every kernel.
    found = gaps(inside)
    assert found == {}, "reached the kernel through the x32 ABI (GAP in the seccomp policy): " + \
        ", ".join(f"{name} -> {what}" for name, what in sorted(found.items()))
    if host_abi != "works":
        # No i386 ABI on this kernel: nothing can reach the kernel through it. The
        # sandbox must not do better than the host, and whatever it printed before
        # dying must be refusals.
        assert sandbox_abi != "works", (host_abi, sandbox_abi)
        results.pop("getpid", None)
        assert gaps(results) == {}, (host_abi, sandbox_abi, gaps(results))
        print(f"the host kernel has no i386 ABI (getpid via int 0x80: {host_abi}); "
              f"in the sandbox: {sandbox_abi}")
        return
    assert returncode == 0 and sandbox_abi == "works", \
        f"int 0x80 works on the host but in the sandbox getpid gave {sandbox_abi}: " \
        f"the case proves nothing (stderr: {stderr})"
    del results["getpid"]
    assert results.pop("i386 clone3") == -errno.ENOSYS, results
    # AF_INET/AF_NETLINK sockets are allowed on x86-64; on i386 socketcall is refused whole
    # and the direct socket call gives an fd: report only, they are not policy targets.
    for family in (16, 2):
        results.pop(f"i386 socketcall(SOCKET, {family})")
        results.pop(f"i386 socket({family})")
    assert len(results) == len(calls) + 2, sorted(results)
    found = gaps(results)
    assert found == {}, "reached the kernel through the i386 ABI (GAP in the seccomp policy): " + \
        ", ".join(f"{name} -> {what}" for name, what in sorted(found.items()))


def test_newer_variants_of_denied_calls_are_denied(box):
    """A deny-list only names the calls its author knew. open_tree is denied; its
    variant open_tree_attr (Linux 6.15, x86-64 number 467, newer than the
    headers and libseccomp here) must be too. Run on this machine's kernel."""
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if release < (6, 15):
        pytest.skip(f"kernel {platform.release()} has no open_tree_attr")
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + """
result = {'open_tree_attr': sc(467, -1, 0, 0, 0, 0), 'open_tree': sc(428, -1, 0, 0)}
"""))
    assert inside["open_tree"] in (-errno.EPERM,), inside
    found = gaps(inside)
    assert found == {}, "a newer variant of a denied call reached the kernel (GAP: deny-list " \
        f"with default allow): {found}"


def test_no_session_can_join_same_page_merging(box):
    """The kernel's same-page merging (KSM) merges identical pages of the
    processes that ask for it; a session that could ask would learn, by the
    time a write to its own page takes, whether anything else on the host
    that asked (a VM, a neighbour) holds a page it guessed. Refused on both
    ABIs: madvise MADV_MERGEABLE and prctl PR_SET_MEMORY_MERGE (EPERM); any
    other advice or option still works (sessions/seccomp.cpp). The i386 calls
    are made only where the host's kernel takes `int 0x80` at all (probed
    outside any sandbox, as above): on a kernel without IA32 emulation the
    first one kills its caller with SIGSEGV, which would end the shared
    session and prove nothing."""
    host_abi = host_i386_abi(i386_probe())
    i386 = host_abi == "works"
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + f"""
anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
buf = _libc.mmap(None, 1 << 16, 3, anon, -1, 0)
low = _libc.mmap(None, 1 << 16, 3, anon | 0x40, -1, 0)  # MAP_32BIT: an i386 argument
result = {{'madvise_mergeable': sc(28, buf, 1 << 16, 12),
          'madvise_dontneed': sc(28, buf, 1 << 16, 4),
          'prctl_memory_merge': sc(157, 67, 1, 0, 0, 0),
          'prctl_get_dumpable': sc(157, 3, 0, 0, 0, 0)}}
if {i386!r}:
    result.update({{'i386_madvise_mergeable': sc32(219, low, 1 << 16, 12),
                   'i386_prctl_memory_merge': sc32(172, 67, 1, 0, 0),
                   'i386_madvise_dontneed': sc32(219, low, 1 << 16, 4)}})
result['mg'] = any('mg' in l.split()[1:] for l in open('/proc/self/smaps')
                   if l.startswith('VmFlags:'))
"""))
    names = ["madvise_mergeable", "prctl_memory_merge"]
    names += ["i386_madvise_mergeable", "i386_prctl_memory_merge"] if i386 else []
    refused = {name: inside[name] for name in names}
    assert refused == {name: -errno.EPERM for name in refused}, \
        f"a session joined same-page merging (GAP): {inside}"
    assert not inside["mg"], f"a mapping of the session's is mergeable: {inside}"
    assert inside["madvise_dontneed"] == 0, inside
    assert inside["prctl_get_dumpable"] >= 0, inside
    if i386:
        assert inside["i386_madvise_dontneed"] == 0, inside
    else:
        print(f"the host kernel has no i386 ABI (getpid via int 0x80: {host_abi}): "
              "the i386 calls are not made")


def test_an_int_argument_is_judged_by_the_word_the_kernel_reads(box):
    """The kernel reads socket's family, madvise's advice and prctl's option
    as a C int, the register's low 32 bits: a rule that compared the whole
    register let `value | 1 << 32` through as `value` (an AF_VSOCK socket was
    made this way under the old `family != AF_VSOCK` rule). Now only whole
    values are allowed: a high word is refused whatever the low one holds
    (no caller passing an int sets it), and the values pass without one."""
    inside = run_ok(box["kc"], cell(SYSCALL_HELPER + """
import os
buf = _libc.mmap(None, 1 << 16, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
high = 1 << 32
result = {'socket_vsock': sc(41, 40 | high, 1, 0),
          'socket_vsock_top': sc(41, 40 | (0xffffffff << 32), 1, 0),
          'madvise_mergeable': sc(28, buf, 1 << 16, 12 | high),
          'prctl_memory_merge': sc(157, 67 | high, 1, 0, 0, 0),
          'socket_unix_high': sc(41, 1 | high, 1, 0),
          'madvise_dontneed_high': sc(28, buf, 1 << 16, 4 | high),
          'socket_unix': sc(41, 1, 1, 0),
          'madvise_dontneed': sc(28, buf, 1 << 16, 4),
          'prctl_get_dumpable': sc(157, 3, 0, 0, 0, 0)}
if result['socket_unix'] >= 0:
    os.close(result['socket_unix'])
    result['socket_unix'] = 'fd'
"""))
    refused = {name: inside[name] for name in ("socket_vsock", "socket_vsock_top",
                                               "madvise_mergeable", "prctl_memory_merge",
                                               "socket_unix_high", "madvise_dontneed_high")}
    found = gaps(refused)
    assert found == {}, f"a high word got a value through (GAP): {found}; all: {inside}"
    assert inside["socket_unix"] == "fd" and inside["madvise_dontneed"] == 0, inside
    assert inside["prctl_get_dumpable"] >= 0, inside
