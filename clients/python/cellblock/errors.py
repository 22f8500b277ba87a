"""Exceptions named after the enames cellblock's server sends.

The server's catalogue of names is include/cellblock/error_names.hpp
(`cellblock errors --json`); tests/python/test_error_names.py checks this
module against it.

A manager request that fails raises the class named by the reply's `ename`;
an execution the server stopped or refused (its policy, not the code) raises
the class named by the error the server put in the execute_reply. An
exception raised by the code itself is not raised here: it is data, in
`Execution.error` (an agent reads the traceback and writes the fix).
"""


class CellblockError(Exception):
    """Any error reported by a cellblock server (or the client's own)."""

    ename = "CellblockError"

    def __init__(self, evalue="", ename=None, traceback=None, execution=None):
        super().__init__(evalue)
        if ename is not None:
            self.ename = ename
        self.evalue = evalue
        self.traceback = list(traceback or [])
        #: the Execution the error ended, for errors raised by Session.run
        self.execution = execution

    def __str__(self):
        return f"{self.ename}: {self.evalue}"


class ServerNotFound(CellblockError):
    """No running server: no server.json, or nobody answers on its manager socket."""

    ename = "ServerNotFound"


class ClientTimeout(CellblockError):
    """The server did not answer in time (the client's own deadline, not the server's)."""

    ename = "ClientTimeout"


class CodeError(CellblockError):
    """The code raised an exception (only from Execution.raise_for_error)."""

    ename = "CodeError"


# ---- errors of the session's policy, sent in execute replies
class PolicyError(CellblockError):
    """The server stopped or refused an execution."""


class ExecutionLimitExceeded(PolicyError):
    """The session's max_executions are used; the code never ran."""


class ExecutionTimeout(PolicyError):
    """The execution passed its timeout. If the kernel stopped when interrupted
    (a KeyboardInterrupt at the deadline) the session lives on; otherwise the
    server killed the sandbox and the session is closed."""


class InterruptIgnored(PolicyError):
    """The code did not stop within the session's interrupt_grace_s of an
    interrupt (it ignores SIGINT): the server killed the kernel and the
    session is closed."""


class SessionClosed(PolicyError):
    """The session is closed (idle timeout, lifetime, a kill, a close request)."""


class MemoryLimitExceeded(PolicyError):
    """The kernel was killed at the session's memory limit; the session is closed."""


class KernelDied(PolicyError):
    """The kernel exited without a memory kill; the session is closed."""


class SessionBusy(PolicyError):
    """Too many requests are queued on the session."""


# ---- errors of manager requests
class ManagerError(CellblockError):
    """A manager request failed."""


class UnknownImage(ManagerError):
    pass


class UnknownRuntime(ManagerError):
    pass


class LimitAboveMaximum(ManagerError, PolicyError):
    pass


class InvalidLimits(ManagerError, PolicyError):
    pass


class TooManySessions(ManagerError):
    """The server holds --max-sessions open and starting sessions."""


class ServerBusy(ManagerError):
    """A session_create waited past the server's bound (or the request's timeout_s)
    in the queue of creates; evalue gives the wait and the queue's length."""


class ImageNotBuilt(ManagerError):
    """The image is defined but `cellblock image build NAME` never ran."""


class InvalidRequest(ManagerError):
    """A required field of the request is missing or mistyped."""


class SandboxStartFailed(ManagerError):
    pass


class NoSuchSession(ManagerError):
    pass


class InvalidPath(ManagerError):
    pass


class FileNotFound(ManagerError, FileNotFoundError):
    pass


class FileTooLarge(ManagerError):
    pass


class FileError(ManagerError):
    pass


class ChecksumMismatch(ManagerError):
    """An upload's bytes do not hash to the sha256 it declared; the upload is discarded."""


class FileChanged(ManagerError):
    """The sandbox changed the file while it was being downloaded: get it again."""


class TransferNotFound(ManagerError):
    """No open transfer of that id (finished, aborted, or expired after 120 s untouched)."""


class TooManyTransfers(ManagerError):
    """The session's (4) or the server's (16) open transfers are at their cap."""


class InvalidOffset(ManagerError):
    """A chunk's offset is not where the transfer stands."""


class MessageTooLarge(ManagerError):
    """A manager message is over the frame limit; large files are streamed in chunks."""


class UnknownRequest(ManagerError, PolicyError):
    """The manager does not know the message type; or, on a session, a client
    sent one of the server's own messages to its kernel (cellblock_*)."""


class ServerError(ManagerError):
    pass


class HibernateFailed(ManagerError):
    """The session did not hibernate (busy, or its snapshot could not be taken
    or kept); it stays awake with everything; evalue says why."""


class StorageFull(HibernateFailed):
    """A snapshot would pass the session's or the server's snapshot cap or the
    disk's free space; evalue has the numbers; the session stays awake with
    everything."""


class ServerShuttingDown(ManagerError, PolicyError):
    """The server is stopping (a signal): a request in flight was not carried
    out, or its session closed with it; evalue names the signal."""


class ServerRestarting(ManagerError, PolicyError):
    """The server is handing its sessions to its next start (SIGHUP, an
    upgrade): the request was not carried out; send it again. Server.request
    does so by itself until its timeout. On a session's reply: the server
    restarted after a crash while the request ran, and the kernel's reply was
    lost with it (what the request did to the kernel's state is kept)."""


#: the class of each ename the server sends (its catalogue, and nothing else)
_BY_NAME = {cls.__name__: cls for cls in (
    ExecutionLimitExceeded, ExecutionTimeout, InterruptIgnored, SessionClosed, MemoryLimitExceeded, KernelDied,
    SessionBusy, UnknownImage, ImageNotBuilt, UnknownRuntime, LimitAboveMaximum, InvalidLimits,
    TooManySessions, ServerBusy, SandboxStartFailed, NoSuchSession, InvalidRequest, InvalidPath,
    FileNotFound, FileTooLarge, FileError, ChecksumMismatch, FileChanged, TransferNotFound,
    TooManyTransfers, InvalidOffset, MessageTooLarge, UnknownRequest, ServerError,
    ServerShuttingDown, ServerRestarting, HibernateFailed, StorageFull)}

#: enames the server itself sends on execute replies (not the code's exceptions)
POLICY_ENAMES = frozenset({"ExecutionLimitExceeded", "ExecutionTimeout", "InterruptIgnored",
                           "SessionClosed", "MemoryLimitExceeded", "KernelDied", "SessionBusy",
                           "InvalidLimits", "LimitAboveMaximum", "ServerShuttingDown",
                           "ServerRestarting", "UnknownRequest"})


def error_for(ename, evalue="", traceback=None, execution=None, default=CellblockError):
    """An exception instance of the class named `ename` (or `default`, keeping the name)."""
    cls = _BY_NAME.get(ename, default)
    return cls(evalue, ename=ename, traceback=traceback, execution=execution)
