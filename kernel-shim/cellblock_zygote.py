"""cellblock's zygote: an interpreter that has imported the kernel and the
image's preload once, and forks sessions from that state.

It runs as the only program of a zygote container (see docs/zygote.md): no
user or PID namespace of its own, an unprivileged host uid, no capabilities,
no_new_privs and a seccomp profile that lets a child create namespaces. It
never runs session code and never holds a session's key or data: the server
sends it, per session, a socket to report on, the session's lifeline and log,
and the session's three directories as detached mounts (open_tree), all as
file descriptors; it forks and forgets them.

The zygote forks each request's child ahead of time: after every answer it
makes a spare fork, which closes what it inherited and waits for the next
request's descriptors (Spare).

The forked child does the containment itself, in this order, each step
reported to the server on the session's report socket (the kernel attaches
the sender's pid, which the child cannot forge):
  A (the fork): closes every other descriptor, joins the session's cgroup
    in each v1 hierarchy (writes 0 to the `tasks` files the server opened),
    unshares user, mount, PID, IPC, UTS and network namespaces at once ->
    "userns"; forks B -> "init PID"; meanwhile the server writes the user
    namespace's id maps (the session's own host id range) -> "mapped"; A
    tells B so and exits.
  B (PID 1 of the new PID namespace): becomes root of its user namespace
    once A says the maps are written; the server moves it into the
    session's v2 cgroup while B sets up; B unshares its cgroup namespace
    once told "cgrouped". Private mounts, its own /proc with
    the usual paths masked, fresh /tmp, home, /dev/shm, /dev/mqueue and
    /dev/pts, the session's ipc, input (read-only) and output directories
    moved in over the zygote's, hostname, loopback up, rlimits; drops the
    bounding set, becomes uid 1000 (no capabilities left), installs the
    session's seccomp filter; forks C -> "ready"; execs cellblock-shim
    --adopt C, which is the session's init from then on, as in a booted one.
  C: re-seeds every random generator, takes the session's environment and
    starts the kernel on /run/cellblock/kernel.json.
"""
import ctypes
import errno
import fcntl
import gc
import importlib
import json
import os
import signal
import socket
import struct
import sys
import time

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
LIBC.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
LIBC.unshare.argtypes = [ctypes.c_int]
LIBC.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
LIBC.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
SYS_MOVE_MOUNT = 429
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

SANDBOX_UID = 1000
SHIM = "/opt/cellblock/cellblock-shim"
CONNECTION_FILE = "/run/cellblock/kernel.json"
MAX_REQUEST = 65536
# The fds of a fork request, in order; then one `tasks` file per v1 cgroup.
REQUEST_FDS = ("report", "lifeline", "log", "ipc", "input", "output")
MAX_CGROUP_FDS = 32

# What runc masks and makes read-only in every session's /proc and /sys.
MASKED = ["/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
          "/proc/latency_stats", "/proc/sched_debug", "/proc/scsi", "/proc/timer_list",
          "/proc/timer_stats", "/sys/firmware", "/sys/devices/virtual/powercap"]
READ_ONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


def check(result, step):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{step}: {os.strerror(err)}")
    return result


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
          f"mount {fstype or source} on {target}")


def move_mount(tree_fd, target):
    check(LIBC.syscall(SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, target.encode(),
                       MOVE_MOUNT_F_EMPTY_PATH), f"move_mount onto {target}")


def prctl(option, a=0, b=0, c=0, d=0):
    return check(LIBC.prctl(option, a, b, c, d), f"prctl {option}")


# --- the three processes of a fork ---------------------------------------


def report(sock, text):
    sock.send(text.encode()[:4000])


def child_a(fds, request, bpf):
    """Runs in the fork; never returns."""
    report_sock = socket.socket(fileno=fds["report"])
    try:
        os.setsid()
        # Into the session's v1 cgroups: a single-threaded task moving itself
        # (pid 0) takes no global lock; the server opened the files.
        for fd in fds["cgroups"]:
            os.write(fd, b"0")
            os.close(fd)
        # All of the session's namespaces but its cgroup namespace, in one
        # call: the others are owned by the new user namespace, in which A has
        # every capability even before its ids are mapped.
        check(LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC |
                           CLONE_NEWUTS | CLONE_NEWNET), "unshare namespaces")
        report(report_sock, "userns")
        # B is forked while the server writes the maps (into A's /proc: A
        # lives until they are written). B waits until A has reported it and
        # heard "mapped": its own reports come after, and its ids exist.
        reported, report_done = os.pipe()
        pid = os.fork()
        if pid:
            report(report_sock, f"init {pid}")
            if report_sock.recv(64) != b"mapped":
                os._exit(1)
            os.write(report_done, b"x")
            os._exit(0)
        os.close(report_done)
        if os.read(reported, 1) != b"x":
            os._exit(1)
        os.close(reported)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        init_b(fds, report_sock, request, bpf)
    except BaseException as e:  # noqa: B902 - everything ends here, reported
        try:
            report(report_sock, f"error {type(e).__name__}: {e}")
        finally:
            os._exit(1)


def setup_mounts(fds, limits):
    # Nothing done here reaches the zygote's mounts (or the host's).
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Its own sysfs too, read-only: /sys/class/net shows this namespace's lo.
    mount("sysfs", "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in MASKED:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_RDONLY, "size=4k,mode=755")
        elif os.path.exists(path):
            mount("/dev/null", path, None, MS_BIND)
    for path in READ_ONLY:
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    disk = f"size={int(limits['disk_mb'])}m"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{disk}")
    home = os.environ.get("HOME", "/home/sandbox")
    mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV,
          f"mode=700,uid={SANDBOX_UID},gid={SANDBOX_UID},{disk}")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=1777,size={int(limits['shm_mb'])}m")
    mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
          "newinstance,ptmxmode=0666,mode=0620")
    # The server made these read-only, nosuid, nodev and noexec as it wished.
    move_mount(fds["ipc"], "/run/cellblock")
    move_mount(fds["input"], "/data/input")
    move_mount(fds["output"], "/data/output")
    for name in ("ipc", "input", "output"):
        os.close(fds[name])
    return home


def loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        iff_up, iff_loopback, iff_running = 0x1, 0x8, 0x40
        fcntl.ioctl(s, 0x8914,  # SIOCSIFFLAGS
                    struct.pack("16sh14x", b"lo", iff_up | iff_loopback | iff_running))


def drop_privileges(limits):
    import resource

    nofile = int(limits["nofile"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # As a booted session's: the pids cgroup is the limit that binds.
    nproc = int(limits["nproc"])
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    # The priority of the server thread that asked for it (a pool refill
    # boots at 19, as a booted refill does; a client's create at 0).
    nice = int(limits.get("nice", 0))
    if nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    # First to go when the host runs out of memory, as a booted session.
    # (The id change in A made this process non-dumpable, which hides its
    # /proc files from itself; the uid change below makes it so again.)
    prctl(PR_SET_DUMPABLE, 1)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    for cap in range(64):
        if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == 22:
            break  # EINVAL: past the last capability this kernel knows
    os.setgroups([])
    os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    # From root to a non-root uid: the permitted and effective sets empty.
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def install_seccomp(bpf):
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = SockFprog(len(bpf) // 8, ctypes.addressof(program))
    check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
          "install the seccomp filter")


def init_b(fds, report_sock, request, bpf):
    limits = request["limits"]
    home = setup_mounts(fds, limits)
    hostname = request.get("hostname", "sandbox").encode()
    check(LIBC.sethostname(hostname, len(hostname)), "sethostname")
    loopback_up()
    # The server moved this process into the session's v2 cgroup meanwhile:
    # the cgroup namespace is rooted there.
    if report_sock.recv(64) != b"cgrouped":
        os._exit(1)
    check(LIBC.unshare(CLONE_NEWCGROUP), "unshare cgroup namespace")
    drop_privileges(limits)
    os.chdir(home)
    install_seccomp(bpf)
    err_read, err_write = os.pipe()
    kernel = os.fork()
    if kernel == 0:
        run_kernel(request, err_write)
    os.close(err_write)
    report(report_sock, "ready")
    report_sock.close()
    # The session's init from now on: cellblock-shim adopts the kernel. Its
    # descriptors are moved clear of 2-4 first, where any of them may be.
    lifeline = fcntl.fcntl(fds["lifeline"], fcntl.F_DUPFD, 10)
    err_read = fcntl.fcntl(err_read, fcntl.F_DUPFD, 10)
    log = fcntl.fcntl(fds["log"], fcntl.F_DUPFD, 10)
    os.dup2(lifeline, 3)
    os.dup2(err_read, 4)
    os.dup2(log, 2)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.closerange(5, os.sysconf("SC_OPEN_MAX"))
    env = dict(e.split("=", 1) for e in request["env"])
    os.execve(SHIM, [SHIM, "--adopt", str(kernel), "4"], env)


def reseed():
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run_kernel(request, err_write):
    try:
        prctl(PR_SET_DUMPABLE, 1)  # as a booted kernel: its own /proc is its uid's
        os.setpgid(0, 0)
        os.dup2(err_write, 2)
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(dict(e.split("=", 1) for e in request["env"]))
        reseed()
        from cellblock_ipykernel import SandboxKernel, SandboxKernelApp

        sys.argv = ["cellblock_ipykernel.py", "-f", CONNECTION_FILE]
        # The application and shell the zygote prepared (prewarm) are this
        # kernel's; the rest of its start is a booted kernel's.
        SandboxKernelApp.launch_instance(argv=["-f", CONNECTION_FILE], kernel_class=SandboxKernel)
        os._exit(0)
    except BaseException as e:  # noqa: B902
        try:
            os.write(2, f"cellblock-zygote: the kernel failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(1)


# --- the zygote ------------------------------------------------------------

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
    cgroups = int(request.get("cgroups", 0))
    if not 0 <= cgroups <= MAX_CGROUP_FDS or len(fds_received) != len(REQUEST_FDS) + cgroups:
        raise ValueError(f"a fork request carries {len(REQUEST_FDS)} descriptors and one per "
                         f"v1 cgroup ({cgroups}), not {len(fds_received)}")
    fds = dict(zip(REQUEST_FDS, fds_received))
    fds["cgroups"] = fds_received[len(REQUEST_FDS):]
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
        child_a(fds, request, bpf)
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
                child_a(request_fds(request, fds_received), request, bpf)
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
        MAX_REQUEST, socket.CMSG_SPACE((len(REQUEST_FDS) + MAX_CGROUP_FDS) * 4))
    fds = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(cdata) // 4}i", cdata[:len(cdata) // 4 * 4]))
    return data, fds


def serve(path, bpf_holder, refused=None):
    spare = None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
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
                    if data.startswith(b"seccomp "):
                        bpf_holder[0] = data[len(b"seccomp "):]
                        reply = {"ok": True, "pid": os.getpid()}
                        if refused:
                            reply["refused"] = refused
                    elif refused:
                        reply = {"error": f"this host does not let a fork contain itself: {refused}"}
                    elif not bpf_holder[0]:
                        reply = {"error": "no seccomp filter was given before the fork request"}
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
                        reply = {"pid": pid}
                except Exception as e:  # noqa: B902 - the server gets the reason
                    reply = {"error": f"{type(e).__name__}: {e}"}
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
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit("cellblock-zygote: the container's init is gone")
    socket_path = argv[argv.index("--socket") + 1]
    preload = argv[argv.index("--preload") + 1].split(",") if "--preload" in argv else []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # What a kernel imports to start, and the image's preload, once.
    import cellblock_ipykernel
    import ipykernel.ipkernel  # noqa: F401
    import ipykernel.zmqshell  # noqa: F401
    for module in filter(None, preload):
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: B902 - the server reports this line
            sys.exit(f"cellblock-zygote: the image's preload (warm-up) failed: import {module}: "
                     f"{type(e).__name__}: {e}")
    # Half of a kernel's own start, done once: its command line parsed and its
    # IPython shell built (cellblock_ipykernel.prewarm), for every fork to adopt.
    # Without it (an image whose ipykernel lacks what it uses) each fork's
    # kernel builds its own, as a booted one does: slower, not broken.
    cellblock_ipykernel.SandboxKernelApp.preloaded = tuple(filter(None, preload))
    try:
        cellblock_ipykernel.prewarm(["-f", CONNECTION_FILE])
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
    serve(socket_path, [b""], refused)


if __name__ == "__main__":
    main(sys.argv)
