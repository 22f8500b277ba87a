"""A session's portable snapshot, taken and restored inside its own sandbox.

The relay runs `save` as a silent execute before it destroys a hibernating
session's sandbox, and `restore` in the fresh sandbox that resumes it
(docs/hibernation.md). Everything here runs as the session's own code, with
its own rights: the snapshot is the session's data and only ever goes back to
the same session, so nothing in it is trusted beyond what the session could
do anyway.

What cannot be carried is never dropped silently: `save` names each value
dill refuses, `restore` each one that fails to load or import, with why. The
report is the value of `report()`, whose JSON form (`_repr_json_`) reaches
the relay through the execute's `user_expressions`.
"""
import importlib
import io
import json
import os
import re
import sys
import tarfile
import threading
import time
import types

# 2: the execution count, the input history (In, _iN) and the output cache
# (Out, _N) are carried too.
# 3: NumPy arrays' data (a DataFrame's blocks too) leave the pickle as
# out-of-band buffers (pickle protocol 5), one tar member each, written from
# the array's own memory and read straight into the new array's
# (docs/hibernation.md). Format 2 snapshots are still read.
FORMAT = 3
READS = (2, 3)

# Smaller arrays stay in the pickle: a member each would cost more than the copy.
_OUT_OF_BAND_MIN = 64 << 10
# How much tarfile copies per write from a buffer's memory.
_COPY_CHUNK = 8 << 20

# Buffers from this size on are read by two threads (_read_buffer).
_SPLIT_READ_MIN = 32 << 20

# How long a restore waits on a snapshot that stopped growing (_Growing).
_PATIENCE_S = 60.0

# IPython's own names in the user namespace: its history and output caches.
_INTERNAL = re.compile(r"^(_+|_i+\d*|_\d+|__\w+__|_oh|_ih|_dh|In|Out|exit|quit|get_ipython)$")

_report = {"lost": [], "saved": 0, "bytes": 0}

# Files the running kernel holds open and rewrites: IPython's input history
# (SQLite). Written back under a live connection it turns read-only; the
# new kernel keeps its own history instead (docs/hibernation.md).
_NOT_CARRIED = (".ipython/profile_default/history.sqlite",)


class Report(dict):
    """The last save's or restore's report, as JSON for user_expressions."""

    def _repr_json_(self):
        return dict(self)


def report():
    return Report(_report)


class _Discard(io.RawIOBase):
    """A file that keeps nothing: what a value's pickle costs, without its bytes."""

    def writable(self):
        return True

    def write(self, data):
        return len(data)


class _View(io.RawIOBase):
    """A buffer read as a file without copying it: tarfile writes its slices."""

    def __init__(self, data):
        super().__init__()
        self._data, self._at = data, 0

    def readable(self):
        return True

    def read(self, n=-1):
        end = len(self._data) if n is None or n < 0 else min(len(self._data), self._at + n)
        piece = self._data[self._at:end]
        self._at = end
        return piece


_pickler = None


def _pickler_class():
    """dill's pickler, with plain NumPy arrays reduced the way protocol 5
    lets them be: their data as an out-of-band buffer. (dill pickles every
    ndarray in-band itself, copying its data twice on the way.) Made once."""
    global _pickler
    if _pickler is not None:
        return _pickler
    import dill

    class Pickler(dill.Pickler):
        def reducer_override(self, obj):
            numpy = sys.modules.get("numpy")
            if (numpy is not None and type(obj) is numpy.ndarray
                    and obj.nbytes >= _OUT_OF_BAND_MIN):
                return obj.__reduce_ex__(self.proto)
            return NotImplemented

    _pickler = Pickler
    return Pickler


def _dump(value, file, buffers):
    """Pickles `value` into `file`; its buffers go to `buffers` (a list), or
    nowhere when it is None (a trial: what it costs to say no). Every buffer
    goes out of band: Python 3.11's pure pickler, which dill's is, memoizes
    a temporary copy of an in-band one and can fail on its reused id."""
    def out_of_band(buffer):
        if buffers is not None:
            buffers.append(buffer)
        return False

    _pickler_class()(file, protocol=5, buffer_callback=out_of_band).dump(value)


def _ms(since):
    return round((time.perf_counter() - since) * 1000, 1)


def _why(error):
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:300]


def _user_names(shell):
    hidden = getattr(shell, "user_ns_hidden", {})
    for name, value in list(shell.user_ns.items()):
        if name in hidden and hidden[name] is value:
            continue
        if _INTERNAL.match(name):
            continue
        yield name, value


def _dirs():
    # The session's writable directories. /data/output is written back by
    # the restore too: the next sandbox's output directory starts empty.
    home = os.environ.get("HOME") or "/root"
    tmp = os.environ.get("TMPDIR") or "/tmp"
    output = os.environ.get("CELLBLOCK_OUTPUT_DIR") or "/data/output"
    return {"home": home, "tmp": tmp, "output": output}


def save(shell, path):
    """Writes the snapshot of `shell`'s namespace and the session's writable
    directories to `path` (a new file); returns the report."""
    import dill

    modules, values, lost = {}, {}, []
    for name, value in _user_names(shell):
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            values[name] = value
    # IPython's output cache (Out, _N): the values the prompts numbered.
    history = shell.history_manager
    outputs = dict(history.output_hist) if history is not None else {}
    # One dump keeps shared references (b = a, Out[3] is df, stay one
    # object); only when it fails is each value tried alone, to name what
    # cannot go.
    started = time.perf_counter()
    pickled, buffers = io.BytesIO(), []
    try:
        _dump({"names": values, "outputs": outputs}, pickled, buffers)
    except Exception:
        def carried(items, label):
            keep = {}
            for key, value in items.items():
                try:
                    _dump(value, _Discard(), None)
                    keep[key] = value
                except Exception as error:  # noqa: BLE001 - any refusal is reported
                    lost.append([label(key), _why(error)])
            return keep
        values = carried(values, str)
        outputs = carried(outputs, lambda n: f"Out[{n}]")
        pickled, buffers = io.BytesIO(), []
        _dump({"names": values, "outputs": outputs}, pickled, buffers)
    buffers = [b.raw() for b in buffers]
    ms = {"namespace": _ms(started)}
    started = time.perf_counter()
    dirs = _dirs()
    manifest = {
        "format": FORMAT,
        "python": "%d.%d" % sys.version_info[:2],
        "dill": getattr(dill, "__version__", ""),
        "taken_at": time.time(),
        "modules": modules,
        "lost": lost,
        "execution_count": shell.execution_count,
        "input_parsed": list(history.input_hist_parsed) if history is not None else [],
        "input_raw": list(history.input_hist_raw) if history is not None else [],
        "dirs": dirs,
        "buffers": [b.nbytes for b in buffers],
    }
    out = os.path.abspath(path)
    try:
        os.unlink(out)  # a save that failed before left it
    except FileNotFoundError:
        pass
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f, \
                tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT,
                             copybufsize=_COPY_CHUNK) as tar:
            _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
            _add_bytes(tar, "namespace.dill", pickled.getbuffer())
            for n, buffer in enumerate(buffers):
                _add_bytes(tar, f"buffers/{n}", buffer)
            for key, root in dirs.items():
                if os.path.isdir(root):
                    _add_tree(tar, root, "files/" + key, skip=out)
    except BaseException:
        os.unlink(out)  # a full disk: no half snapshot left in the session's files
        raise
    ms["write"] = _ms(started)
    _report.update(lost=lost, saved=len(values) + len(modules), bytes=os.path.getsize(out),
                   ms=ms)
    return report()


def _add_bytes(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, _View(memoryview(data).cast("B")))


def _add_tree(tar, root, arcroot, skip):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            if full == skip:
                continue
            rel = os.path.relpath(full, root)
            if rel.startswith(_NOT_CARRIED):
                continue
            info = tar.gettarinfo(full, arcname=arcroot + "/" + rel)
            if info is None:  # a socket or a device: nothing to carry
                continue
            if info.islnk():  # a second name of a file: carried as a copy
                info.type = tarfile.REGTYPE
                info.size = os.lstat(full).st_size
            if info.isreg():
                with open(full, "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)


class SnapshotRefused(Exception):
    """A snapshot this kernel will not load, with why."""


class _Growing(io.RawIOBase):
    """The snapshot as the server still writes it into /data/input: a read
    waits for the bytes it asks for, up to the final `size` the server named
    (it writes whole checked chunks in order, so what stands in the file is
    always a prefix of the snapshot). A file that stops growing for
    `patience` seconds is refused: the server closes a session whose opening
    failed, so that only a server gone astray leaves a kernel waiting."""

    def __init__(self, path, size, patience=None):
        super().__init__()
        patience = _PATIENCE_S if patience is None else patience
        self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        self._size, self._at, self._patience = size, 0, patience
        self.waited = 0.0  # seconds spent waiting for the writer

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._at

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def read_at(self, view, offset):
        """Fills `view` from `offset` on, as far as the final size, waiting for
        the writer; returns the bytes read. Safe from several threads."""
        want = max(0, min(len(view), self._size - offset))
        done, waited_since = 0, None
        while done < want:
            n = os.preadv(self._fd, [view[done:want]], offset + done)
            if n:
                done, waited_since = done + n, None
                continue
            now = time.monotonic()
            if waited_since is None:
                waited_since = now
            elif now - waited_since > self._patience:
                raise SnapshotRefused(f"the snapshot stopped at {os.fstat(self._fd).st_size}"
                                      f" of {self._size} bytes")
            time.sleep(0.0005)
            self.waited += time.monotonic() - now
        return done

    def readinto(self, buffer):
        done = self.read_at(memoryview(buffer).cast("B"), self._at)
        self._at += done
        return done

    def read(self, n=-1):
        if n is None or n < 0:
            n = self._size - self._at
        data = bytearray(max(0, min(n, self._size - self._at)))
        return bytes(data[:self.readinto(data)])

    def close(self):
        if not self.closed:
            os.close(self._fd)
        super().close()


def restore(shell, path, size=None):
    """Restores the snapshot at `path` into `shell` and the session's
    directories; returns the report (what was lost at the save and now).
    Given `size`, the snapshot is still being written (the server opens it
    while this reads): it is read in its own order, as far as `size`."""
    import dill

    started = time.perf_counter()
    ms = {}
    if size is None:
        size = os.path.getsize(path)
    # In the archive's order, member by member (never getmembers(), which
    # walks every header to the end first): the manifest, the namespace,
    # its buffers, then the session's files.
    with _Growing(path, size) as source, tarfile.open(fileobj=source, mode="r:") as tar:
        members = iter(tar)
        first = next(members, None)
        if first is None or first.name != "manifest.json":
            raise SnapshotRefused("the snapshot does not begin with its manifest")
        manifest = json.loads(tar.extractfile(first).read())
        if manifest.get("format") not in READS:
            raise SnapshotRefused(
                f"snapshot format {manifest.get('format')}, this kernel reads "
                + " and ".join(str(n) for n in READS))
        python = "%d.%d" % sys.version_info[:2]
        if manifest.get("python") != python:
            raise SnapshotRefused(
                f"snapshot taken under Python {manifest.get('python')}, this kernel runs {python}")
        lost = [list(x) for x in manifest.get("lost", [])]
        sizes = manifest.get("buffers", [])
        pickled, buffers, unread = None, [None] * len(sizes), None
        dirs = _dirs()
        modes = []  # directories' modes, set last: a read-only one still takes its files
        files_started = None

        def files_start():
            """The read (manifest, namespace, buffers) ends where the files begin."""
            ms["read"] = _ms(started)
            ms["waited"] = round(source.waited * 1000, 1)
            return time.perf_counter()

        for member in members:
            name = member.name
            if name == "namespace.dill" or name.startswith("buffers/"):
                if unread is not None:
                    continue  # the namespace is lost already: its other parts are not read
                try:
                    # Read whole first: dill.load through tarfile's member
                    # stream makes many small reads and took 4x as long
                    # (measured: 6.2 s against 1.5 s for a 100 MB DataFrame).
                    if name == "namespace.dill":
                        pickled = tar.extractfile(member).read()
                    else:
                        n = int(name.split("/", 1)[1])
                        if not 0 <= n < len(sizes):
                            raise SnapshotRefused(f"{name}: the manifest names no such buffer")
                        buffers[n] = _read_buffer(source, member, sizes[n])
                except Exception as error:  # noqa: BLE001
                    unread = error
                continue
            parts = name.split("/")
            if len(parts) < 3 or parts[0] != "files" or parts[1] not in dirs:
                continue
            if files_started is None:
                files_started = files_start()
            rel = "/".join(parts[2:])
            if rel.startswith("/") or ".." in rel.split("/"):
                lost.append([name, "refused: a path outside its directory"])
                continue
            target = os.path.join(dirs[parts[1]], rel)
            try:
                _extract(tar, member, target, modes)
            except OSError as error:
                lost.append([name, _why(error)])
        for target, mode in reversed(modes):
            os.chmod(target, mode)
        if files_started is None:
            files_started = files_start()
    ms["files"] = _ms(files_started)
    started = time.perf_counter()
    for name, module in manifest.get("modules", {}).items():
        try:
            shell.user_ns[name] = importlib.import_module(module)
        except Exception as error:  # noqa: BLE001
            lost.append([name, f"import {module}: {_why(error)}"])
    ms["imports"] = _ms(started)
    started = time.perf_counter()
    values, outputs = {}, {}
    try:
        if unread is not None:
            raise unread
        if pickled is None:
            raise SnapshotRefused("the snapshot holds no namespace")
        missing = [n for n, buffer in enumerate(buffers) if buffer is None]
        if missing:
            raise SnapshotRefused(f"buffers/{missing[0]} is missing from the snapshot")
        loaded = dill.loads(pickled, buffers=buffers)
        values, outputs = loaded["names"], loaded["outputs"]
    except Exception as error:  # noqa: BLE001
        lost.append(["*", f"the namespace did not load: {_why(error)}"])
    ms["namespace"] = _ms(started)
    shell.user_ns.update(values)
    _restore_history(shell, manifest, outputs)
    importlib.invalidate_caches()
    _report.update(lost=lost, saved=len(values) + len(manifest.get("modules", {})),
                   bytes=size, ms=ms)
    # Read: it leaves the session's /data/input. Where the server writes that
    # dir (runc: read-only here) the server removes it; in a Swarm task the
    # kernel placed it itself and removes it here.
    try:
        os.unlink(path)
    except OSError:
        pass
    return report()


def _read_buffer(source, member, size):
    """An array's data, read from the archive straight into its new memory."""
    if not member.isreg() or member.size != size:
        raise SnapshotRefused(
            f"{member.name}: {member.size} bytes where the manifest says {size}")
    try:
        # NumPy asks for huge pages for big arrays: filling 100 MB takes a
        # third of the time it takes in a bytearray (page faults).
        import numpy
        data = numpy.empty(size, dtype=numpy.uint8)
    except ImportError:
        data = bytearray(size)
    view = memoryview(data).cast("B")
    at = member.offset_data
    if size >= _SPLIT_READ_MIN and len(os.sched_getaffinity(0)) > 1:
        # Two threads, half each (preadv lets go of the GIL): the first
        # touch of fresh memory is most of a big read where a VM's memory
        # is backed by its host only when first used (here 100 MB took
        # ~215 ms on one thread, ~130 ms on two, ~16 ms once backed:
        # docs/hibernation.md).
        half = (size // 2) & ~4095
        second = {}

        def read_second_half():
            try:
                second["done"] = source.read_at(view[half:], at + half)
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
                second["error"] = error

        helper = threading.Thread(target=read_second_half, name="cellblock-restore")
        helper.start()
        try:
            done = source.read_at(view[:half], at)
        finally:
            helper.join()
        if "error" in second:
            raise second["error"]
        done += second["done"] if done == half else 0
    else:
        done = source.read_at(view, at)
    if done < size:
        raise SnapshotRefused(f"{member.name}: the archive ends {size - done} bytes early")
    return data


def _restore_history(shell, manifest, outputs):
    """The prompts go on where they were: the execution count, In and _iN,
    Out and _N (the same list and dict objects IPython keeps, refilled)."""
    shell.execution_count = int(manifest.get("execution_count", shell.execution_count))
    history = shell.history_manager
    if history is None:
        return
    parsed, raw = manifest.get("input_parsed", []), manifest.get("input_raw", [])
    history.input_hist_parsed[:] = parsed
    history.input_hist_raw[:] = raw
    history.output_hist.clear()
    history.output_hist.update(outputs)
    ns = shell.user_ns
    for n, source in enumerate(parsed):
        if n:
            ns[f"_i{n:d}"] = source
    for name, offset in (("_i", 1), ("_ii", 2), ("_iii", 3)):
        ns[name] = parsed[-offset] if len(parsed) > offset else ""
    for n, value in outputs.items():
        ns[f"_{n}"] = value
    last = [outputs[n] for n in sorted(outputs)][-3:]
    for name, value in zip(("_", "__", "___"), reversed(last)):
        ns[name] = value


def _extract(tar, member, target, modes):
    if member.isdir():
        os.makedirs(target, exist_ok=True)
        modes.append((target, member.mode & 0o7777))
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target) and not os.path.isdir(target):
        os.unlink(target)
    if member.issym():
        os.symlink(member.linkname, target)
    elif member.isreg():
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     member.mode & 0o7777)
        with os.fdopen(fd, "wb") as out:
            src = tar.extractfile(member)
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
    os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
