"""Boot memory that the kernels of one image on one node can share.

A Swarm task boots its own interpreter: unlike a runc session forked from
its image's zygote, it shares none of what it imported with its neighbours.
With `serve --swarm-share-boot-memory` the shim starts the kernel with a
fixed address layout (personality ADDR_NO_RANDOMIZE) and the server gives a
fixed hash seed, so every kernel of the image on the node builds the same
boot pages at the same addresses; marking them MADV_MERGEABLE lets the
node's KSM keep one copy of each (docs/scale-out.md, "Density").

What is marked is the memory mapped before the session's code runs: at the
kernel's start and after the server's warm-up (every execution before the
first one kept in the history). A mapping made later (a large array, a new
arena) is never marked, so the bulk of a session's data is never compared
with a neighbour's; what the session later writes into the marked pages can
be (the trade-off, in docs/security.md). Nothing happens where the layout is
random (the engine refused the personality, or any other sandbox): merging
would find little there.
"""
import ctypes

ADDR_NO_RANDOMIZE = 0x0040000
MADV_MERGEABLE = 12
# Mappings the kernel will not merge, or that change too often to be worth it.
_SKIPPED = ("[stack]", "[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]")


def fixed_layout(personality_path="/proc/self/personality"):
    """True when this process runs without address randomization."""
    try:
        with open(personality_path) as f:
            return bool(int(f.read().strip(), 16) & ADDR_NO_RANDOMIZE)
    except (OSError, ValueError):
        return False


def mergeable_ranges(maps_text):
    """The (start, end) of every private writable mapping in a
    /proc/PID/maps text, but the kernel's special ones and the stack."""
    ranges = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 5:
            continue
        perms = fields[1]
        if len(perms) < 4 or perms[1] != "w" or perms[3] != "p":
            continue
        if len(fields) == 6 and fields[5].strip() in _SKIPPED:
            continue
        start, _, end = fields[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def mark_mergeable(maps_path="/proc/self/maps"):
    """MADV_MERGEABLE over this process's private writable mappings; returns
    the bytes marked. A range another thread unmapped meanwhile is skipped."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    with open(maps_path) as f:
        ranges = mergeable_ranges(f.read())
    marked = 0
    for start, end in ranges:
        if madvise(start, end - start, MADV_MERGEABLE) == 0:
            marked += end - start
    return marked


class BootMemory:
    """Marks the kernel's boot memory mergeable, once at its start and after
    each execution until the first one kept in the history begins."""

    def __init__(self, enabled=None):
        self.enabled = fixed_layout() if enabled is None else enabled
        self.booting = True
        self.marked = 0

    def mark(self):
        if self.enabled and self.booting:
            self.marked = mark_mergeable()

    def before_execute(self, store_history):
        if store_history:
            self.booting = False

