"""What one testbed instance leaves on the host, found and removed by its own marks.

An instance is known by two strings only it uses: its directory and its tag
(`cbsw` + 6 hex digits, in its bridge, cgroup, containerd-namespace and
container names). Everything here selects by those marks or by descent from a
process that carried them, never by a program's name: other people's Docker
daemons run on the same host.
"""

import hashlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
SHIM_SOCKET_DIR = "/run/containerd/s"  # containerd's, fixed whatever its --state dir


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    start: int  # clock ticks since boot: tells a pid from its reuse
    cmdline: str


def process_table() -> dict:
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # The command name in parentheses may itself hold spaces and ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = Process(int(entry), int(fields[1]), int(fields[19]), cmdline)
    return table


def descendants(table: dict, roots: set) -> set:
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for proc in table.values():
            if proc.ppid in found and proc.pid not in found:
                found.add(proc.pid)
                grew = True
    return found


def cgroup_dirs(tag: str) -> list:
    """The instance's cgroups (`TAG-outer`, `TAG-w1`, ...) in every hierarchy, deepest first."""
    found = []
    if not os.path.isdir(CGROUP_ROOT):
        return found
    hierarchies = [CGROUP_ROOT] + [os.path.join(CGROUP_ROOT, h) for h in sorted(os.listdir(CGROUP_ROOT))]
    for hierarchy in hierarchies:
        if not os.path.isdir(hierarchy) or os.path.islink(hierarchy):
            continue
        try:
            names = os.listdir(hierarchy)
        except OSError:
            continue
        for name in names:
            top = os.path.join(hierarchy, name)
            if name.startswith(tag + "-") and os.path.isdir(top):
                for root, dirs, _ in os.walk(top, topdown=False):
                    found.extend(os.path.join(root, d) for d in dirs)
                found.append(top)
    return found


def cgroup_pids(tag: str) -> set:
    pids = set()
    for group in cgroup_dirs(tag):
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                pids.update(int(line) for line in f if line.strip())
        except OSError:
            pass
    return pids


def instance_pids(marks: list, tag: str, roots: set = frozenset()) -> set:
    """Processes whose command line holds one of the instance's marks (its directory, its
    tag, its bridge's subnet as a docker-proxy's target), sit in its cgroups, or descend
    from them."""
    table = process_table()
    marked = {p.pid for p in table.values()
              if p.pid != os.getpid() and any(mark in p.cmdline for mark in marks)}
    marked |= {pid for pid in cgroup_pids(tag) if pid in table}
    marked |= {pid for pid in roots if pid in table}
    return descendants(table, marked) - _ancestors_and_self(table)


def _ancestors_and_self(table: dict) -> set:
    # The command that tears down names the directory too, and so may its shell.
    chain, pid = set(), os.getpid()
    while pid in table and pid not in chain:
        chain.add(pid)
        pid = table[pid].ppid
    return chain


def kill_pids(pids: set, grace: float = 0.0) -> None:
    table = process_table()
    targets = {pid: table[pid].start for pid in pids if pid in table}
    if grace > 0:
        _signal_all(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(targets):
            time.sleep(0.1)
    _signal_all(targets, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(targets):
        time.sleep(0.1)


def _signal_all(targets: dict, sig: int) -> None:
    for pid, start in targets.items():
        if _same_process(pid, start):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _alive(targets: dict) -> bool:
    # A zombie has been killed already; its parent's reaping is not ours to wait for.
    return any(_same_process(pid, start) and not _zombie(pid) for pid, start in targets.items())


def _same_process(pid: int, start: int) -> bool:
    proc = process_table_entry(pid)
    return proc is not None and proc.start == start


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] in "ZX"
    except OSError:
        return True


def process_table_entry(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return Process(pid, int(fields[1]), int(fields[19]), "")


def _unescape_mount_path(path: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    out, i = [], 0
    while i < len(path):
        code = path[i + 1:i + 4]
        if path[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def mounts_under(directory: str) -> list:
    """Mount points at or below `directory` in this mount namespace, deepest first."""
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape_mount_path(line.split()[4])
            if point.rstrip("/") + "/" == prefix or point.startswith(prefix):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(directory: str) -> list:
    """Unmounts what is left below `directory`; returns the mount points it could not remove."""
    for _ in range(3):
        left = mounts_under(directory)
        if not left:
            return []
        for point in left:
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", point], capture_output=True)
    return mounts_under(directory)


def remove_cgroups(tag: str) -> list:
    """Removes the instance's (empty) cgroups; returns those that would not go."""
    for _ in range(20):
        left = []
        for group in cgroup_dirs(tag):
            try:
                os.rmdir(group)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(group)
        if not left:
            return []
        time.sleep(0.25)  # a killed process leaves its cgroup a moment after it dies
    return left


def shim_sockets(containerd_address: str, namespace: str, container_ids: set) -> list:
    """The host-wide sockets of the instance's containerd-shims that are still there.
    containerd names each sha256(address/namespace/id): a shim killed with SIGKILL leaves it."""
    found = []
    for cid in sorted(container_ids):
        digest = hashlib.sha256(os.path.join(containerd_address, namespace, cid).encode()).hexdigest()
        path = os.path.join(SHIM_SOCKET_DIR, digest)
        if os.path.lexists(path):
            found.append(path)
    return found


def links_with_tag(tag: str) -> list:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [name for name in names if name.startswith(tag)]


def find_residue(directory: str, tag: str, marks: list, shim_socket_paths=()) -> list:
    """Everything of the instance still on the host, as human-readable lines (empty: clean)."""
    residue = [f"shim socket {path}" for path in shim_socket_paths if os.path.lexists(path)]
    table = process_table()
    for pid in sorted(instance_pids(marks, tag)):
        if pid in table:
            residue.append(f"process {pid}: {table[pid].cmdline[:160]}")
    residue += [f"mount {point}" for point in mounts_under(directory)] if os.path.exists(directory) else []
    residue += [f"link {name}" for name in links_with_tag(tag)]
    residue += [f"cgroup {group}" for group in cgroup_dirs(tag)]
    if os.path.exists(directory):
        residue.append(f"directory {directory}")
    return residue
