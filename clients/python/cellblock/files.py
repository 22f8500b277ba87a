"""A session's files: put() and get(), streamed in chunks over the manager
socket or passed by descriptor over the server's local file socket
(docs/files.md). `Session` (client.py) takes these methods from
`SessionFiles`; they use its `server` and `id`."""
import array
import hashlib
import io
import os
import shutil
import socket
import struct
import tempfile

import zmq
from jupyter_client.session import Session as WireSession

from .errors import ClientTimeout, FileError, error_for

FILE_INLINE_BYTES = 4 << 20   # put() sends up to this in one message, streams anything larger
FILE_CHUNK_BYTES = 4 << 20    # the spool's copy size (the server names the chunk size)
FILE_WINDOW = 4               # chunks in flight during a transfer
FILE_SLICE_BYTES = 256 << 10  # read (or written) and hashed together, while in the CPU's cache


def _read_hashing(f, length, digest):
    """Up to `length` bytes of `f` (fewer at its end), hashed into `digest` a
    slice at a time as they are read. A fresh buffer each time: the socket may
    still be sending the previous one without a copy."""
    if not hasattr(f, "readinto"):
        piece = f.read(length)
        digest.update(piece)
        return piece
    buf = bytearray(length)
    view, got = memoryview(buf), 0
    while got < length:
        n = f.readinto(view[got:got + FILE_SLICE_BYTES])
        if not n:
            break
        digest.update(view[got:got + n])
        got += n
    view.release()
    if got < length:
        del buf[got:]
    return buf


def _pack_frames(frames):
    """The local file socket's packing: [u32 count][u32 size, bytes]..., little-endian."""
    out = [struct.pack("<I", len(frames))]
    for f in frames:
        f = bytes(f)
        out += [struct.pack("<I", len(f)), f]
    return b"".join(out)


def _unpack_frames(data):
    (count,), at, frames = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<I", data, at)
        frames.append(data[at + 4:at + 4 + size])
        at += 4 + size
    if at != len(data) or len(frames) != count:
        raise FileError("a malformed message on the local file socket")
    return frames


def _seekable(f):
    try:
        return f.seekable()
    except Exception:
        return False


class SessionFiles:
    """put() and get() of a Session."""

    def put(self, path, data, *, progress=None, timeout=60.0, retries=3, local=None, sha256=None):
        """Writes a file to /data/input/<path>, read-only for the code; returns the path
        the code sees. `data` is bytes, a str (written as UTF-8), an os.PathLike naming
        a local file, or a binary file object (read from its position to its end).

        Anything over FILE_INLINE_BYTES is streamed in chunks with at most
        FILE_WINDOW of them in flight, so memory stays bounded whatever the size;
        the server checks the sha256 of the whole and the file appears whole or
        not at all. `progress(done, total)` is called as chunks are acknowledged.
        A connection lost mid-way is retried `retries` times: the server keeps the
        bytes it has, and the upload resumes from there.

        A local file (an os.PathLike) on the server's own host is not streamed:
        its descriptor is passed over the server's local file socket, the server
        copies it inside the kernel and hashes what landed, and the reply's sha256
        is checked against `sha256` when given. local=False always streams;
        local=True refuses to stream; None (the default) passes the descriptor
        when the server offers a local file socket this process may use."""
        if local and not isinstance(data, os.PathLike):
            raise FileError("local=True needs a file on this host (an os.PathLike)")
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray, memoryview)):
            if len(data) <= FILE_INLINE_BYTES:
                reply, _ = self.server.request("file_put_request",
                                               {"session_id": self.id, "path": path},
                                               buffers=[bytes(data)], timeout=timeout)
                if progress:
                    progress(len(data), len(data))
                return reply["path"]
            return self._put_stream(path, io.BytesIO(data), progress, timeout, retries)
        if isinstance(data, os.PathLike):
            with open(data, "rb") as f:
                if local is not False:
                    reply = self._local_copy("file_put_local_request",
                                             {"path": path, **({"sha256": sha256} if sha256 else {})},
                                             f.fileno(), progress, timeout, required=bool(local))
                    if reply is not None:
                        return reply["path"]
                return self._put_stream(path, f, progress, timeout, retries, sha256)
        if hasattr(data, "read"):
            if _seekable(data):
                return self._put_stream(path, data, progress, timeout, retries)
            # A pipe: spooled to a temporary file first (the size must be declared).
            with tempfile.TemporaryFile() as spool:
                shutil.copyfileobj(data, spool, FILE_CHUNK_BYTES)
                spool.seek(0)
                return self._put_stream(path, spool, progress, timeout, retries)
        raise TypeError("put() takes bytes, str, an os.PathLike or a binary file object, "
                        f"not {type(data).__name__}")

    def _put_stream(self, path, f, progress, timeout, retries, declared=None):
        server = self.server
        start = f.tell()
        size = f.seek(0, os.SEEK_END) - start
        for attempt in range(retries + 1):
            try:
                begin, _ = server.request("file_put_begin_request",
                                          {"session_id": self.id, "path": path, "size": size},
                                          timeout=timeout)
                upload, chunk = begin["upload_id"], begin["chunk_bytes"]
                # The digest covers the whole file: the bytes the server holds are hashed too.
                digest = hashlib.sha256()
                f.seek(start)
                offset = 0
                while offset < begin["offset"]:
                    piece = f.read(min(chunk, begin["offset"] - offset))
                    if not piece:
                        raise FileError(f"the local file shrank below {begin['offset']} bytes")
                    digest.update(piece)
                    offset += len(piece)
                in_flight = []
                while offset < size or in_flight:
                    if offset < size and len(in_flight) < FILE_WINDOW:
                        piece = _read_hashing(f, min(chunk, size - offset), digest)
                        if not piece:
                            raise FileError(f"the local file shrank below {size} bytes")
                        in_flight.append((server._send("file_put_chunk_request",
                                                       {"session_id": self.id, "upload_id": upload,
                                                        "offset": offset}, buffers=[piece]),
                                          offset + len(piece)))
                        offset += len(piece)
                        continue
                    msg_id, done = in_flight.pop(0)
                    server._wait(msg_id, "file_put_chunk_request", timeout)
                    if progress:
                        progress(done, size)
                reply, _ = server.request("file_put_commit_request",
                                          {"session_id": self.id, "upload_id": upload,
                                           "sha256": declared or digest.hexdigest()},
                                          timeout=timeout)
                if progress and size == 0:
                    progress(0, 0)
                return reply["path"]
            except (ClientTimeout, zmq.ZMQError):
                if attempt == retries:
                    raise
                server._reset_channel()   # the upload waits on the server; begin resumes it

    def get(self, path, dest=None, *, progress=None, timeout=60.0, local=None):
        """A file the code wrote to /data/output/<path>. With no `dest`, its bytes;
        with a path (str or os.PathLike), the file is written there (beside it
        first, then renamed once its sha256 matches the server's) and the path is
        returned; with a binary file object, the bytes are written to it.
        Streamed in chunks, so memory stays bounded unless the bytes are asked for.
        `progress(done, total)` is called as chunks arrive.

        To a path on the server's own host, the file is not streamed: the
        descriptor of the file beside `dest` is passed over the local file socket,
        and the server copies into it and hashes what landed (local= as for put)."""
        if dest is None:
            buf = io.BytesIO()
            self._get_stream(path, buf, progress, timeout)
            return buf.getvalue()
        if hasattr(dest, "write"):
            self._get_stream(path, dest, progress, timeout)
            return dest
        partial = f"{os.fspath(dest)}.part"
        try:
            with open(partial, "w+b") as out:
                copied = None
                if local is not False:
                    copied = self._local_copy("file_get_local_request", {"path": path},
                                              out.fileno(), progress, timeout,
                                              required=bool(local))
                if copied is None:
                    self._get_stream(path, out, progress, timeout)
            os.replace(partial, dest)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return dest

    def _local_copy(self, msg_type, content, fd, progress, timeout, required):
        """One request on the server's local file socket with `fd` passed; the reply's
        content, or None when there is no socket this process can use (and not
        `required`). `timeout` bounds the wait for each message, not the copy."""
        where = self.server.files_socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            try:
                if not where:
                    raise FileNotFoundError("the server offers no local file socket")
                sock.connect(where)
            except OSError as e:
                if required:
                    raise FileError(f"the local file socket {where}: {e}") from None
                return None
            wire = WireSession(key=self.server._key, signature_scheme=self.server._scheme,
                               username="cellblock-client")
            msg = wire.msg(msg_type, {"session_id": self.id, **content})
            sock.sendmsg([_pack_frames(wire.serialize(msg))],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            while True:
                try:
                    data = sock.recv(1 << 16)
                except socket.timeout:
                    raise ClientTimeout(f"no word in {timeout:g} s on {where}") from None
                if not data:
                    raise FileError(f"the server closed {where} without a reply")
                _, frames = wire.feed_identities(_unpack_frames(data))
                reply = wire.deserialize(frames)        # verifies the signature
                if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                    continue
                c = reply["content"]
                if reply["header"]["msg_type"] == "file_progress":
                    if progress:
                        progress(c["done"], c["size"])
                    continue
                if c.get("status") != "ok":
                    raise error_for(c.get("ename", "ServerError"), c.get("evalue", ""))
                if progress:
                    progress(c["size"], c["size"])
                want = content.get("sha256")
                if want and c.get("sha256") != want.lower():
                    raise error_for("ChecksumMismatch", f"{c.get('path')}: {c.get('sha256')}, "
                                    f"not {want}")
                return c
        finally:
            sock.close()

    def _get_stream(self, path, out, progress, timeout):
        server = self.server
        begin, _ = server.request("file_get_begin_request", {"session_id": self.id, "path": path},
                                  timeout=timeout)
        size, chunk = begin["size"], begin["chunk_bytes"]
        digest = hashlib.sha256()
        expected = begin.get("sha256")
        in_flight, requested, received = [], 0, 0
        try:
            while received < size:
                if requested < size and len(in_flight) < FILE_WINDOW:
                    in_flight.append(server._send("file_get_chunk_request",
                                                  {"session_id": self.id,
                                                   "download_id": begin["download_id"],
                                                   "offset": requested, "length": chunk}))
                    requested += min(chunk, size - requested)
                    continue
                reply, buffers = server._wait(in_flight.pop(0), "file_get_chunk_request", timeout)
                piece = memoryview(buffers[0])
                # Written and hashed a slice at a time, while the slice is in cache.
                for at in range(0, len(piece), FILE_SLICE_BYTES):
                    out.write(piece[at:at + FILE_SLICE_BYTES])
                    digest.update(piece[at:at + FILE_SLICE_BYTES])
                received += len(piece)
                expected = reply.get("sha256", expected)
                if progress:
                    progress(received, size)
        except BaseException:
            if received < size and "download_id" in begin:
                try:
                    server._send("file_get_end_request", {"session_id": self.id,
                                                          "download_id": begin["download_id"]})
                except Exception:
                    pass
            raise
        if progress and size == 0:
            progress(0, 0)
        if digest.hexdigest() != expected:
            raise error_for("ChecksumMismatch", f"/data/output/{path}: received bytes hash to "
                            f"{digest.hexdigest()}, the server's file to {expected}")
