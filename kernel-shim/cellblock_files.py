"""Files moved over a kernel's control channel (FileTransfers), for a
session whose server has no directory of it on its own host: a Swarm task
on another node (docs/scale-out.md, "Files"). cellblock_ipykernel's
SandboxKernel answers the four cellblock_file_* requests with it, on the
control thread. Nothing here follows a link the sandbox's code may plant,
nor waits on a FIFO planted where a file is expected.

Over 500 lines with a reason: every path walk here goes through the same few
descriptor-relative helpers (_open_root, _open_parent, _open_component, _Fd),
and each of the four requests (write, read, list, abort) is checked against
them in one reading; split, a request could reach for a plain open().
"""
import errno
import hashlib
import os
import re
import stat
import time


class TransferRefused(Exception):
    """A file request answered with an error reply: a stable `ename` and a
    sentence naming the path and the numbers."""

    def __init__(self, ename, evalue):
        super().__init__(evalue)
        self.ename = ename
        self.evalue = evalue


def _refused_by_os(error, what, missing="FileError"):
    # `missing`: what a missing name is to this request (a read's
    # FileNotFound; to a write it is just a failed step).
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TransferRefused("DiskFull", f"{what}: the disk is full ({error.strerror})")
    if error.errno == errno.ENOENT:
        return TransferRefused(missing, f"{what}: no such file or directory")
    return TransferRefused("FileError", f"{what}: {error.strerror}")


def _refused_opening(error, dir_fd, name, shown, missing):
    # O_NOFOLLOW answers a link with ELOOP, or with ENOTDIR beside
    # O_DIRECTORY, as it answers a plain file: lstat says which it was.
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return TransferRefused("FileError",
                                       f"{shown} is a symbolic link, which is never followed")
        except OSError:
            pass
    return _refused_by_os(error, shown, missing)


def _shown(value):
    # A value the front sent, quoted in a message at a bounded length.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Fd:
    """An open descriptor, closed once."""

    def __init__(self, fd):
        self.fd = fd

    def close(self):
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_root(root, missing):
    # The root's own path is the operator's (the environment's), so it is
    # followed; below it nothing is.
    try:
        return _Fd(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as e:
        raise _refused_by_os(e, f"the directory {root}", missing) from None


def _open_dir(at, name, shown, missing):
    try:
        return _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
    except OSError as e:
        raise _refused_opening(e, at.fd, name, shown, missing) from None


def _open_parent(root, parts, missing, make=False):
    """The directory that holds parts[-1] under `root`, reached one component
    at a time without following a link; with `make`, missing ones are made
    (0755). A refusal names the whole path, then the component at fault."""
    try:
        at = _open_root(root, missing)
        try:
            for depth, name in enumerate(parts[:-1]):
                below = _open_component(at, name, os.path.join(root, *parts[:depth + 1]),
                                        missing, make)
                at.close()
                at = below
        except BaseException:
            at.close()
            raise
        return at
    except TransferRefused as e:
        raise TransferRefused(e.ename, f"{os.path.join(root, *parts)}: {e.evalue}") from None


def _open_component(at, name, shown, missing, make):
    try:
        return _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
    except FileNotFoundError:
        if not make:
            raise TransferRefused(missing, f"{shown} does not exist") from None
    except OSError as e:
        raise _refused_opening(e, at.fd, name, shown, missing) from None
    try:
        os.mkdir(name, 0o755, dir_fd=at.fd)
    except FileExistsError:
        pass  # made meanwhile: opened (and checked) below
    except OSError as e:
        raise _refused_by_os(e, f"making the directory {shown}") from None
    return _open_dir(at, name, shown, missing)


class _Upload:
    """One upload: its partial file, open for writing, in the partial dir."""

    def __init__(self, transfer, path, partial_dir, partial, now):
        self.transfer = transfer
        self.path = path
        self.partial_dir = partial_dir
        self.partial = partial
        self.written = 0
        self.sha256 = hashlib.sha256()
        self.touched = now

    def write(self, chunk):
        view = memoryview(chunk).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self.partial.fd, view[done:])
        self.sha256.update(view)
        self.written += len(view)

    def close(self, remove=True):
        self.partial.close()
        if remove:
            try:
                os.unlink(self.transfer, dir_fd=self.partial_dir.fd)
            except OSError:
                pass
        self.partial_dir.close()


class _Download:
    """One download: the file, open for reading, and its size at open."""

    def __init__(self, path, file, size, now):
        self.path = path
        self.file = file
        self.size = size
        self.sent = 0
        self.sha256 = hashlib.sha256()
        self.touched = now

    def close(self):
        self.file.close()


class FileTransfers:
    """Files moved between the front and this sandbox over the kernel's
    control channel, where the server has no directory of the session's on
    its own host (a Swarm task on another node, docs/scale-out.md).

    The front sends four requests on control; each is answered there with
    its `_reply`:
    - `cellblock_file_write_request` {transfer, path, offset, last} with one
      buffer (the next chunk): an upload into the input dir. Offset 0 starts
      it in `<input>/.cellblock-partial/<transfer>`; each later chunk must
      start where the last ended; the last one is synced and renamed onto
      `path` (its parent dirs made), answered with the sha256 of every byte.
    - `cellblock_file_read_request` {transfer, path, offset, length}: the
      next chunk of an output file (the buffer of the reply), never past
      its size at offset 0; the last one (`eof`) carries the sha256.
    - `cellblock_file_list_request` {max_files, max_depth}: the output
      dir's regular files (path, size, mtime).
    - `cellblock_file_abort_request` {transfer}: ends a transfer, removing
      an upload's partial file.
    An error is {status: error, ename, evalue, transfer}: InvalidPath,
    FileNotFound, FileError, DiskFull; it ends the transfer.

    Control, not shell: it is already encrypted and signed to the front, and
    it is served on its own thread, so files move while a cell runs.
    Nothing below a root is reached through a symbolic link: the code in the
    sandbox runs as this kernel's uid and may plant one anywhere, to turn a
    write or a read of the front's somewhere the front did not mean. Nor
    does an open wait: a FIFO planted where a file is expected is refused,
    not waited on (that would stop the control thread, and interrupts with
    it). Used from the control thread only."""

    MESSAGES = ("cellblock_file_write_request", "cellblock_file_read_request",
                "cellblock_file_list_request", "cellblock_file_abort_request")
    MAX_OPEN = 8
    IDLE_S = 120.0
    MAX_READ = 8 << 20
    MAX_PATH_BYTES = 4096
    LIST_MAX_FILES = 1000
    LIST_MAX_DEPTH = 8
    # Past this a listing says `truncated` rather than hold a descriptor
    # per level of a tree the sandbox's code may make as deep as it likes.
    LIST_DEPTH_LIMIT = 128
    PARTIAL_DIR = ".cellblock-partial"
    SNAPSHOT_FILE = ".cellblock-snapshot"  # the hibernation snapshot (docs/hibernation.md)
    TRANSFER_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._open = {}  # transfer id: _Upload or _Download

    @staticmethod
    def input_root():
        return os.environ.get("CELLBLOCK_INPUT_DIR", "/data/input")

    @staticmethod
    def output_root():
        return os.environ.get("CELLBLOCK_OUTPUT_DIR", "/data/output")

    def answer(self, msg_type, content, buffers):
        """(reply content, reply buffers) for one request; never raises."""
        content = content if isinstance(content, dict) else {}
        handle = {"cellblock_file_write_request": self.write_file,
                  "cellblock_file_read_request": self.read_file,
                  "cellblock_file_list_request": self.list_files,
                  "cellblock_file_abort_request": self.abort_transfer}[msg_type]
        try:
            self._drop_idle()
            return handle(content, list(buffers or []))
        except TransferRefused as e:
            refused = e
        except OSError as e:
            refused = _refused_by_os(e, f"{msg_type} for {_shown(content.get('path'))}")
        except Exception as e:
            refused = TransferRefused("FileError", f"{msg_type} for {_shown(content.get('path'))} "
                                                   f"failed: {e!r}")
        reply = {"status": "error", "ename": refused.ename, "evalue": refused.evalue}
        if msg_type != "cellblock_file_list_request":
            transfer = content.get("transfer")
            reply["transfer"] = transfer
            if isinstance(transfer, str):
                self._drop(transfer)
        return reply, []

    def open_count(self):
        return len(self._open)

    def write_file(self, content, buffers):
        transfer = self._transfer_id(content)
        path, parts = self._path(content)
        if parts[0] == self.PARTIAL_DIR:
            raise TransferRefused("InvalidPath", f"{path}: {self.PARTIAL_DIR} holds the "
                                                 "uploads being written, not a target")
        offset = self._number(content, "offset", 0, doing=f"writing {path}")
        last = content.get("last")
        if not isinstance(last, bool):
            raise TransferRefused("FileError", f"writing {path}: `last` is {_shown(last)}, "
                                               "not true or false")
        if len(buffers) != 1:
            raise TransferRefused("FileError", f"writing {path} at offset {offset}: the request "
                                               f"carries {len(buffers)} buffers, not 1")
        upload = self._at(_Upload, transfer, path, offset,
                          lambda: self._started_upload(transfer, path))
        upload.touched = self._clock()
        try:
            upload.write(buffers[0])
        except OSError as e:
            raise _refused_by_os(e, f"writing {path} at offset {offset}") from None
        reply = {"status": "ok", "transfer": transfer, "written": upload.written}
        if not last:
            return reply, []
        self._finish_upload(upload, parts)
        del self._open[transfer]
        upload.close(remove=False)
        reply.update(sha256=upload.sha256.hexdigest(), path=path)
        return reply, []

    def read_file(self, content, buffers):
        transfer = self._transfer_id(content)
        path, parts = self._path(content)
        offset = self._number(content, "offset", 0, doing=f"reading {path}")
        length = self._number(content, "length", 1, doing=f"reading {path}")
        if length > self.MAX_READ:
            raise TransferRefused("FileError", f"reading {path}: a chunk of {length} bytes asked, "
                                               f"at most {self.MAX_READ} are sent at once")
        download = self._at(_Download, transfer, path, offset,
                            lambda: self._start_download(path, parts))
        download.touched = self._clock()
        wanted = max(0, min(length, download.size - offset))
        data = b""
        try:
            while len(data) < wanted:
                more = os.pread(download.file.fd, wanted - len(data), offset + len(data))
                if not more:
                    break
                data += more
        except OSError as e:
            raise _refused_by_os(e, f"reading {path} at offset {offset}") from None
        if len(data) < wanted:
            raise TransferRefused("FileError", f"{path} changed while being read: it had "
                                               f"{download.size} bytes at the start, and ends at "
                                               f"{offset + len(data)}")
        download.sha256.update(data)
        download.sent += len(data)
        eof = offset + len(data) >= download.size
        reply = {"status": "ok", "transfer": transfer, "size": download.size, "offset": offset,
                 "eof": eof}
        if eof:
            reply["sha256"] = download.sha256.hexdigest()
            del self._open[transfer]
            download.close()
        return reply, [data]

    def list_files(self, content, buffers):
        max_files = self._number(content, "max_files", 0, self.LIST_MAX_FILES)
        max_depth = self._number(content, "max_depth", 0, self.LIST_MAX_DEPTH)
        root = self.output_root()
        try:
            at = _open_root(root, "FileNotFound")
        except TransferRefused as e:
            if e.ename == "FileNotFound":
                return {"status": "ok", "files": [], "truncated": False}, []
            raise
        listing = _Listing(max_files, min(max_depth, self.LIST_DEPTH_LIMIT),
                           skipped={self.PARTIAL_DIR, self.SNAPSHOT_FILE})
        with at:
            listing.walk(at)
        return {"status": "ok", "files": listing.files, "truncated": listing.truncated}, []

    def abort_transfer(self, content, buffers):
        transfer = self._transfer_id(content)
        ended = self._open.pop(transfer, None)
        if ended is not None:
            ended.close()
        return {"status": "ok", "transfer": transfer, "aborted": ended is not None}, []

    def _transfer_id(self, content):
        transfer = content.get("transfer")
        if not isinstance(transfer, str) or not self.TRANSFER_ID.fullmatch(transfer):
            raise TransferRefused("FileError", f"the transfer id {_shown(transfer)} is not 1 to 64 "
                                               "characters of [0-9a-zA-Z_-]")
        return transfer

    def _path(self, content):
        """(path, its components), or InvalidPath."""
        path = content.get("path")
        if not isinstance(path, str):
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is not a string")
        try:
            size = len(path.encode("utf-8"))
        except UnicodeEncodeError:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is not UTF-8") from None
        if size > self.MAX_PATH_BYTES:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} has {size} bytes, more "
                                                 f"than {self.MAX_PATH_BYTES}")
        if "\0" in path:
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} holds a NUL")
        if path.startswith("/"):
            raise TransferRefused("InvalidPath", f"the path {_shown(path)} is absolute, not "
                                                 "relative to its directory")
        parts = path.split("/")
        for part in parts:
            if part in ("", ".", ".."):
                raise TransferRefused("InvalidPath", f"the path {_shown(path)} has a "
                                                     f"{_shown(part)} component")
        return path, parts

    @staticmethod
    def _number(content, name, least, default=None, doing="listing"):
        value = content.get(name, default)
        if type(value) is not int or value < least:
            raise TransferRefused("FileError", f"{doing}: {name} is {_shown(value)}, not a "
                                               f"whole number of at least {least}")
        return value

    def _check_room(self, transfer, path):
        if len(self._open) >= self.MAX_OPEN:
            raise TransferRefused("FileError", f"{self.MAX_OPEN} file transfers are open: "
                                               f"transfer {transfer} ({path}) can start when one "
                                               "ends or is aborted")

    def _at(self, kind, transfer, path, offset, start):
        """The transfer a chunk at `offset` belongs to: started anew (`start()`)
        at offset 0, else the open one of that kind and path, where the last
        chunk ended."""
        if offset == 0:
            self._drop(transfer)
            self._check_room(transfer, path)
            going = start()
            self._open[transfer] = going
            return going
        going = self._open.get(transfer)
        upload = kind is _Upload
        what, doing = ("upload", "writing") if upload else ("download", "reading")
        if not isinstance(going, kind):
            raise TransferRefused("FileError", f"{doing} {path} at offset {offset}: no {what} "
                                               f"{transfer} is open (one starts at offset 0)")
        if going.path != path:
            raise TransferRefused("FileError", f"{doing} {path} at offset {offset}: {what} "
                                               f"{transfer} is of {going.path}")
        moved = going.written if upload else going.sent
        if offset != moved:
            raise TransferRefused("FileError", f"{doing} {path}: the chunk is at offset {offset}, "
                                               f"but {moved} bytes were "
                                               f"{'written' if upload else 'sent'} so far")
        return going

    def _started_upload(self, transfer, path):
        try:
            return self._start_upload(transfer, path)
        except TransferRefused as e:
            raise TransferRefused(e.ename, f"starting the upload of {path}: {e.evalue}") \
                from None

    def _drop(self, transfer):
        dropped = self._open.pop(transfer, None)
        if dropped is not None:
            dropped.close()

    def _drop_idle(self):
        now = self._clock()
        for transfer in [t for t, going in self._open.items() if now - going.touched > self.IDLE_S]:
            self._drop(transfer)

    def _start_upload(self, transfer, path):
        root = self.input_root()
        shown = os.path.join(root, self.PARTIAL_DIR)
        with _open_root(root, "FileError") as at:
            try:
                os.mkdir(self.PARTIAL_DIR, 0o700, dir_fd=at.fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise _refused_by_os(e, f"making {shown}") from None
            partial_dir = _open_dir(at, self.PARTIAL_DIR, shown, "FileError")
        try:
            # O_NONBLOCK: a FIFO planted here fails at once instead of
            # waiting for a reader.
            partial = _Fd(os.open(transfer, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=partial_dir.fd))
        except OSError as e:
            refused = _refused_opening(e, partial_dir.fd, transfer,
                                       os.path.join(shown, transfer), "FileError")
            # What was planted at the partial's name goes (the link, not
            # what it names), as a partial would.
            try:
                os.unlink(transfer, dir_fd=partial_dir.fd)
            except OSError:
                pass
            partial_dir.close()
            raise refused from None
        upload = _Upload(transfer, path, partial_dir, partial, self._clock())
        try:
            if not stat.S_ISREG(os.fstat(partial.fd).st_mode):
                raise TransferRefused("FileError", f"{os.path.join(shown, transfer)} is not a "
                                                   "regular file")
        except BaseException:
            upload.close()
            raise
        return upload

    def _finish_upload(self, upload, parts):
        root = self.input_root()
        target = os.path.join(root, upload.path)
        try:
            os.fsync(upload.partial.fd)
            ours = os.fstat(upload.partial.fd)
            there = os.stat(upload.transfer, dir_fd=upload.partial_dir.fd, follow_symlinks=False)
        except OSError as e:
            raise _refused_by_os(e, f"finishing {target} ({upload.written} bytes)") from None
        # The sandbox's code may swap the partial file for its own: what is
        # renamed must be what was written and hashed.
        if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
            raise TransferRefused("FileError", f"the partial file of {target} was replaced while "
                                               f"being written ({upload.written} bytes)")
        upload.partial.close()
        with _open_parent(root, parts, "FileError", make=True) as parent:
            try:
                os.replace(upload.transfer, parts[-1], src_dir_fd=upload.partial_dir.fd,
                           dst_dir_fd=parent.fd)
            except IsADirectoryError:
                raise TransferRefused("FileError", f"{target} is a directory") from None
            except OSError as e:
                raise _refused_by_os(e, f"moving {upload.written} bytes into {target}") from None

    def _start_download(self, path, parts):
        root = self.output_root()
        target = os.path.join(root, path)
        with _open_parent(root, parts, "FileNotFound") as parent:
            try:
                # O_NONBLOCK: a FIFO planted here is refused, not waited on.
                file = _Fd(os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                                   | os.O_NONBLOCK, dir_fd=parent.fd))
            except OSError as e:
                raise _refused_opening(e, parent.fd, parts[-1], target, "FileNotFound") from None
        try:
            st = os.fstat(file.fd)
            if not stat.S_ISREG(st.st_mode):
                raise TransferRefused("FileError", f"{target} is not a regular file")
        except BaseException:
            file.close()
            raise
        return _Download(path, file, st.st_size, self._clock())


class _Listing:
    """The regular files under a directory, walked in the order of their
    paths (so the first `max_files` found are the first in order), without
    following a link. `truncated`: some were left out (more files than
    `max_files`, a directory deeper than `max_depth`, or one that could not
    be read or that a JSON string cannot name)."""

    class _Full(Exception):
        pass

    def __init__(self, max_files, max_depth, skipped):
        self.max_files = max_files
        self.max_depth = max_depth
        self.skipped = skipped  # names left out at the top
        self.files = []
        self.truncated = False

    def walk(self, at):
        try:
            self._walk(at, "", 0)
        except self._Full:
            self.truncated = True

    def _walk(self, at, prefix, depth):
        try:
            with os.scandir(at.fd) as found:
                entries = [(e, e.is_dir(follow_symlinks=False)) for e in found]
        except OSError:
            self.truncated = True
            return
        # A directory sorts as "name/": its files then come where their
        # paths do among its siblings' ("a-b" before "a/c").
        entries.sort(key=lambda pair: pair[0].name + "/" if pair[1] else pair[0].name)
        for entry, is_dir in entries:
            name = entry.name
            if depth == 0 and name in self.skipped:
                continue
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                self.truncated = True
                continue
            if is_dir:
                if depth + 1 > self.max_depth:
                    self.truncated = True
                    continue
                try:
                    below = _Fd(os.open(name, _DIR_FLAGS, dir_fd=at.fd))
                except OSError:  # gone, or made a link, since it was listed
                    self.truncated = True
                    continue
                with below:
                    self._walk(below, prefix + name + "/", depth + 1)
            elif entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since it was listed
                if len(self.files) == self.max_files:
                    raise self._Full()
                self.files.append({"path": prefix + name, "size": st.st_size,
                                   "mtime": st.st_mtime})

