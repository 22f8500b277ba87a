"""How a session forked from the zygote (cellblock_zygote.py) contains
itself: the three processes of a fork, and the system calls they need.

The forked child does the containment itself, in this order, each step
reported to the server on the session's report socket (the kernel attaches
the sender's pid, which the child cannot forge; the words are
cellblock_protocol's):
  A (the fork): closes every other descriptor, joins the session's cgroup
    in each v1 hierarchy (writes 0 to the `tasks` files the server opened),
    unshares user, mount, PID, IPC, UTS and network namespaces at once ->
    `userns`; forks B -> `init PID`; meanwhile the server writes the user
    namespace's id maps (the session's own host id range) -> `mapped`; A
    tells B so and exits.
  B (PID 1 of the new PID namespace): becomes root of its user namespace
    once A says the maps are written; the server moves it into the
    session's v2 cgroup while B sets up; B unshares its cgroup namespace
    once told `cgrouped`. Private mounts, its own /proc with
    the usual paths masked, fresh /tmp, home, /dev/shm, /dev/mqueue and
    /dev/pts, the session's ipc, input (read-only) and output directories
    moved in over the zygote's, hostname, loopback up, rlimits; drops the
    bounding set, becomes uid 1000 (no capabilities left), installs the
    session's seccomp filter; forks C -> `ready`; execs cellblock-shim
    --adopt C, which is the session's init from then on, as in a booted one.
  C: re-seeds every random generator, takes the session's environment and
    starts the kernel on /run/cellblock/kernel.json.
"""
import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import sys

import cellblock_protocol as protocol

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
# More capabilities than any kernel has: the loop that drops them stops at
# the first this kernel does not know (EINVAL).
CAPABILITY_BOUND = 64
SECCOMP_INSTRUCTION_BYTES = 8  # sizeof(struct sock_filter)

SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40

SANDBOX_UID = 1000

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
# The longest answer the server sends a fork.
ANSWER_MAX = 64


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
        report(report_sock, protocol.REPORT_USERNS)
        # B is forked while the server writes the maps (into A's /proc: A
        # lives until they are written). B waits until A has reported it and
        # heard ANSWER_MAPPED: its own reports come after, and its ids exist.
        reported, report_done = os.pipe()
        pid = os.fork()
        if pid:
            report(report_sock, f"{protocol.REPORT_INIT} {pid}")
            if report_sock.recv(ANSWER_MAX) != protocol.ANSWER_MAPPED.encode():
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
            report(report_sock, f"{protocol.REPORT_ERROR} {type(e).__name__}: {e}")
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
        fcntl.ioctl(s, SIOCSIFFLAGS,
                    struct.pack("16sh14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))


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
    for cap in range(CAPABILITY_BOUND):
        if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
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
    fprog = SockFprog(len(bpf) // SECCOMP_INSTRUCTION_BYTES, ctypes.addressof(program))
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
    if report_sock.recv(ANSWER_MAX) != protocol.ANSWER_CGROUPED.encode():
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
    report(report_sock, protocol.REPORT_READY)
    report_sock.close()
    # The session's init from now on: cellblock-shim adopts the kernel. Its
    # descriptors are moved clear of the ones they go to first, where any of
    # them may be.
    clear = protocol.ADOPTED_STDERR_FD + 1
    lifeline = fcntl.fcntl(fds["lifeline"], fcntl.F_DUPFD, clear)
    err_read = fcntl.fcntl(err_read, fcntl.F_DUPFD, clear)
    log = fcntl.fcntl(fds["log"], fcntl.F_DUPFD, clear)
    os.dup2(lifeline, protocol.LIFELINE_FD)
    os.dup2(err_read, protocol.ADOPTED_STDERR_FD)
    os.dup2(log, 2)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.closerange(clear, os.sysconf("SC_OPEN_MAX"))
    env = dict(e.split("=", 1) for e in request["env"])
    # The shim's alone (it strips CELLBLOCK_ variables from what it passes on).
    grace = int(request.get(protocol.ADOPT_GRACE_REQUEST, 0))
    if grace > 0:
        env[protocol.ADOPT_GRACE_ENV] = str(grace)
    os.execve(protocol.SHIM, [protocol.SHIM, protocol.SHIM_ADOPT_OPTION, str(kernel),
                              str(protocol.ADOPTED_STDERR_FD)], env)


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

        sys.argv = ["cellblock_ipykernel.py", "-f", protocol.CONNECTION_FILE]
        # The application and shell the zygote prepared (prewarm) are this
        # kernel's; the rest of its start is a booted kernel's.
        SandboxKernelApp.launch_instance(argv=["-f", protocol.CONNECTION_FILE],
                                         kernel_class=SandboxKernel)
        os._exit(0)
    except BaseException as e:  # noqa: B902
        try:
            os.write(2, f"cellblock-zygote: the kernel failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(1)
