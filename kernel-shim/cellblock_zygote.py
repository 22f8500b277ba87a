"""cellblock's zygote: an interpreter that has imported the kernel and the
image's preload once, and forks sessions from that state.

It runs as the only program of a zygote container (see docs/zygote.md): no
user or PID namespace of its own, an unprivileged host uid, no capabilities,
no_new_privs and a seccomp profile that lets a child create namespaces. It
never runs session code and never holds a session's key or data: the server
sends it, per session, a socket to report on, the session's lifeline and log,
and the session's three directories as detached mounts (open_tree), all as
file descriptors (in the order of cellblock_protocol.FORK_FDS); it forks and
forgets them. What each fork then does to contain itself is
cellblock_containment.py.

The zygote forks each request's child ahead of time: after every answer it
makes a spare fork, which closes what it inherited and waits for the next
request's descriptors (Spare).
"""
import ctypes
import errno
import gc
import importlib
import json
import os
import signal
import socket
import struct
import sys
import time

import cellblock_containment as containment
import cellblock_protocol as protocol
from cellblock_containment import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID,
                                   CLONE_NEWUSER, CLONE_NEWUTS, LIBC, MS_NODEV, MS_NOSUID,
                                   MS_PRIVATE, MS_REC, check, mount, prctl)

FD_BYTES = struct.calcsize("i")  # one descriptor in SCM_RIGHTS

# What a host that forbids a fork's containment answers (unlike ENOSPC,
# ENOMEM or EAGAIN, which say "not now").
REFUSALS = (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EINVAL)
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 2 << 20


def collapse_into_huge_pages(budget_s=2.0):
    """Backs the zygote's anonymous memory with transparent huge pages where
    whole 2 MiB stretches of it are mapped (the interpreter's heap and the
    imports' large allocations): a fork then copies one page-table entry per
    2 MiB instead of 512, and each of a session's three forks is cheaper
    (docs/zygote.md, "Huge pages"). A page a session writes is still copied
    alone (the kernel splits the shared huge page's mapping in the writer).
    Returns (MiB collapsed, why not where it failed). Nothing depends on it:
    a kernel without MADV_COLLAPSE (before 6.1) or with THP off refuses. The
    kernel may compact memory to find huge pages (about 0.2 s here): on a
    fragmented host it stops after `budget_s`, so the zygote's start is not
    held up."""
    LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed, refused = 0, set()
    deadline = time.monotonic() + budget_s
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for parts in regions:
        path = parts[5] if len(parts) > 5 else ""
        if parts[1] != "rw-p" or path not in ("", "[heap]"):
            continue
        low, high = (int(x, 16) for x in parts[0].split("-"))
        start = (low + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = high & ~(HUGE_PAGE - 1)
        if end - start < HUGE_PAGE:
            continue
        if time.monotonic() > deadline:
            refused.add(f"stopped after {budget_s:g} s")
            break
        LIBC.madvise(start, end - start, MADV_HUGEPAGE)
        if LIBC.madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += (end - start) >> 20
        else:
            refused.add(os.strerror(ctypes.get_errno()))
    return collapsed, ", ".join(sorted(refused))


def forking_refused():
    """Why this host does not let a fork contain itself, or None if it does.

    A child tries what every fork's containment starts with: its own user
    namespace (which hosts may forbid to unprivileged processes: the
    `user.max_user_namespaces` or `kernel.unprivileged_userns_clone` sysctls,
    AppArmor's `apparmor_restrict_unprivileged_userns`, a seccomp policy),
    the other namespaces, and mounts in them (what AppArmor's restriction
    takes away while still letting the namespace be made). The server then
    boots the image's sessions instead (docs/zygote.md). A failure that says
    "not now" rather than "not here" (a namespace count at its limit, no
    memory) is not a refusal: the zygote serves, and a fork that meets it
    fails with its reason."""
    reason_read, reason_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reason_read)
            check(LIBC.unshare(CLONE_NEWUSER), "unshare user namespace")
            check(LIBC.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
                               CLONE_NEWNET), "unshare namespaces")
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=4k")
            os._exit(0)
        except BaseException as e:  # noqa: B902 - the reason is the answer
            try:
                refusal = getattr(e, "errno", None) in REFUSALS
                os.write(reason_write, (b"R" if refusal else b"T") +
                         f"{type(e).__name__}: {e}".encode()[:1000])
            finally:
                os._exit(1)
    os.close(reason_write)
    with os.fdopen(reason_read, "rb") as f:
        reason = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    if reason.startswith("T"):
        print(f"cellblock-zygote: the fork probe failed for now ({reason[1:]}); serving",
              file=sys.stderr)
        return None
    return reason[1:] or f"the probe ended with status {os.waitstatus_to_exitcode(status)}"


def request_fds(request, fds_received):
    """A fork request's descriptors by name (protocol.FORK_FDS), and its v1
    cgroups' `tasks` files as "cgroups"."""
    cgroups = int(request.get("cgroups", 0))
    named = len(protocol.FORK_FDS)
    if not 0 <= cgroups <= protocol.MAX_CGROUP_FDS or len(fds_received) != named + cgroups:
        raise ValueError(f"a fork request carries {named} descriptors and one per "
                         f"v1 cgroup ({cgroups}), not {len(fds_received)}")
    fds = dict(zip(protocol.FORK_FDS, fds_received))
    fds["cgroups"] = fds_received[named:]
    return fds


def close_all_but(keep, *sockets):
    # In a fork: the zygote's sockets and every other descriptor it held.
    for sock in sockets:
        sock.detach()
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) > 2 and int(fd) not in keep:
            try:
                os.close(int(fd))
            except OSError:
                pass
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def fork_session(conn, listener, request, fds, fds_received, bpf):
    """Forks A for a request whose descriptors are `fds` (request_fds) of
    those received (`fds_received`, all that A keeps)."""
    pid = os.fork()
    if pid == 0:
        close_all_but(set(fds_received), conn, listener)
        containment.child_a(fds, request, bpf)
    return pid


class Spare:
    """A fork made ahead of the next request (as Android's zygote keeps
    unspecialised processes): the request's descriptors are handed to it and
    it goes on as A, so the zygote's fork and A's closing of the zygote's
    descriptors are not on the next session's way. Until then it holds
    nothing of any session: it waits, in the zygote's container and
    cgroups, on a socket of its own to the zygote, and ends when that
    closes (the zygote ended or dropped it)."""

    def __init__(self, conn, listener, bpf):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                close_all_but({theirs.fileno()}, conn, listener, ours)
                payload, fds_received = receive(theirs)
                if not payload:
                    os._exit(0)
                theirs.close()
                request = json.loads(payload)
                containment.child_a(request_fds(request, fds_received), request, bpf)
            finally:
                os._exit(1)
        theirs.close()
        self.sock = ours
        self.bpf = bpf

    def take(self, payload, fds):
        """Hands a request to the spare; its pid, or None if it is gone."""
        try:
            self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           struct.pack(f"{len(fds)}i", *fds))])
            return self.pid
        except OSError:
            return None
        finally:
            self.drop()

    def drop(self):
        self.sock.close()


def receive(sock):
    """One message of the fork protocol: (its bytes, the descriptors it carried)."""
    data, ancdata, _, _ = sock.recvmsg(
        protocol.MAX_REQUEST,
        socket.CMSG_SPACE((len(protocol.FORK_FDS) + protocol.MAX_CGROUP_FDS) * FD_BYTES))
    fds = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(cdata) // FD_BYTES
            fds.extend(struct.unpack(f"{count}i", cdata[:count * FD_BYTES]))
    return data, fds


def serve(path, bpf_holder, refused=None, skipped=()):
    seccomp = f"{protocol.SECCOMP} ".encode()
    spare = None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # The server waits for the path to appear, then connects: bound under
    # another name and renamed once listening, it is never there refusing.
    listener.bind(path + ".new")
    listener.listen(1)
    os.rename(path + ".new", path)
    while True:
        conn, _ = listener.accept()
        with conn:
            while True:
                try:
                    data, fds = receive(conn)
                except OSError:
                    break
                if not data:
                    break
                try:
                    if data.startswith(seccomp):
                        bpf_holder[0] = data[len(seccomp):]
                        reply = {"ok": True, protocol.REPLY_PID: os.getpid()}
                        if refused:
                            reply[protocol.REPLY_REFUSED] = refused
                        if skipped:  # at most 20 named: the reply has a size limit
                            reply[protocol.REPLY_SKIPPED] = list(skipped[:20]) + (
                                [f"and {len(skipped) - 20} more"] if len(skipped) > 20 else [])
                    elif refused:
                        reply = {protocol.REPLY_ERROR:
                                 f"this host does not let a fork contain itself: {refused}"}
                    elif not bpf_holder[0]:
                        reply = {protocol.REPLY_ERROR:
                                 "no seccomp filter was given before the fork request"}
                    else:
                        request = json.loads(data)
                        named = request_fds(request, fds)  # checked before any fork
                        pid = None
                        if spare and spare.bpf == bpf_holder[0]:
                            pid = spare.take(data, fds)
                        elif spare:
                            spare.drop()  # made for another seccomp filter
                        spare = None
                        if pid is None:
                            pid = fork_session(conn, listener, request, named, fds,
                                               bpf_holder[0])
                        reply = {protocol.REPLY_PID: pid}
                except Exception as e:  # noqa: B902 - the server gets the reason
                    reply = {protocol.REPLY_ERROR: f"{type(e).__name__}: {e}"}
                finally:
                    for fd in fds:
                        os.close(fd)
                conn.send(json.dumps(reply).encode())
                # The next request's fork, made now that this one is answered.
                if spare is None and bpf_holder[0] and not refused:
                    spare = Spare(conn, listener, bpf_holder[0])


def main(argv):
    # The zygote has no PID namespace whose end would end it: it ends with
    # its container's init (the shim), which ends with the server's lifeline.
    parent = os.getppid()
    prctl(containment.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit("cellblock-zygote: the container's init is gone")
    socket_path = argv[argv.index(protocol.SOCKET_OPTION) + 1]

    def modules(option):
        return list(filter(None, argv[argv.index(option) + 1].split(","))) if option in argv else []

    preload = modules(protocol.PRELOAD_OPTION)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # What a kernel imports to start, and the image's preload, once.
    import cellblock_ipykernel
    import ipykernel.ipkernel  # noqa: F401
    import ipykernel.zmqshell  # noqa: F401
    for module in preload:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: B902 - the server reports this line
            sys.exit(f"cellblock-zygote: the image's preload (warm-up) failed: import {module}: "
                     f"{type(e).__name__}: {e}")
    # The image's warm imports: in every fork's sys.modules, bound in no
    # namespace; a speed-up, so one this root cannot import is skipped, and
    # named to the server (its log) and in the zygote's.
    skipped = []
    for module in modules(protocol.WARM_IMPORTS_OPTION):
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: B902 - any failure only costs the speed-up
            skipped.append(f"{module} ({type(e).__name__}: {str(e)[:200]})")
            print(f"cellblock-zygote: warm import {skipped[-1]} skipped", file=sys.stderr)
    # Half of a kernel's own start, done once: its command line parsed and its
    # IPython shell built (cellblock_ipykernel.prewarm), for every fork to adopt.
    # Without it (an image whose ipykernel lacks what it uses) each fork's
    # kernel builds its own, as a booted one does: slower, not broken.
    cellblock_ipykernel.SandboxKernelApp.preloaded = tuple(preload)
    try:
        cellblock_ipykernel.prewarm(["-f", protocol.CONNECTION_FILE])
    except Exception as e:  # noqa: B902 - reported, then done without
        print(f"cellblock-zygote: the kernel's start is not prepared "
              f"({type(e).__name__}: {e}); each session builds its own", file=sys.stderr)
    # Asked once, before any fork request: the server's answer to a host that
    # refuses is to boot this image's sessions, not to fail each create.
    refused = forking_refused()
    if refused:
        print(f"cellblock-zygote: this host does not let a fork contain itself ({refused})",
              file=sys.stderr)
    # A finished fork is reaped at once; sessions are not the zygote's children.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # Objects alive now are never collected again: the collector's passes in
    # the sessions leave their pages shared.
    gc.collect()
    gc.freeze()
    if not refused:  # a zygote that cannot fork is only asked why, then ended
        collapsed, why_not = collapse_into_huge_pages()
        print(f"cellblock-zygote: {collapsed} MiB in huge pages"
              + (f" (refused elsewhere: {why_not})" if why_not else ""), file=sys.stderr)
    serve(socket_path, [b""], refused, skipped)


if __name__ == "__main__":
    main(sys.argv)
