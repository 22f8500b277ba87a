"""What an execution produced, as the client hands it back: `Execution`
(one `Session.run`), its rich outputs (`Result`) and its error (`Error`)."""
import base64

from .errors import CodeError, error_for

_BINARY_MIMES = ("image/png", "image/jpeg", "image/gif", "image/webp")


class Error:
    """An error of an execution: the code's exception, or the server's refusal."""

    def __init__(self, ename, evalue, traceback, by_server=False):
        self.ename = ename
        self.evalue = evalue
        self.traceback = list(traceback or [])
        #: True when the server sent it (policy), False when the code raised it
        self.by_server = by_server

    @property
    def text(self):
        return "\n".join(self.traceback) if self.traceback else f"{self.ename}: {self.evalue}"

    def __repr__(self):
        who = "server" if self.by_server else "code"
        return f"<Error {self.ename}: {self.evalue!r} ({who})>"


class Result:
    """One rich output (execute_result or display_data): a MIME bundle.

    Binary types (image/png, image/jpeg, ...) are decoded to bytes; `raw`
    keeps the bundle as it came (base64) for nbformat.
    """

    def __init__(self, data, metadata=None, is_main_result=False, execution_count=None):
        self.raw = dict(data)
        self.metadata = dict(metadata or {})
        self.is_main_result = is_main_result
        self.execution_count = execution_count
        self.data = {}
        for mime, value in data.items():
            if mime in _BINARY_MIMES and isinstance(value, str):
                try:
                    value = base64.b64decode(value)
                except ValueError:
                    pass
            self.data[mime] = value

    def __getitem__(self, mime):
        return self.data[mime]

    def __contains__(self, mime):
        return mime in self.data

    def formats(self):
        return list(self.data)

    text = property(lambda self: self.data.get("text/plain"))
    html = property(lambda self: self.data.get("text/html"))
    markdown = property(lambda self: self.data.get("text/markdown"))
    svg = property(lambda self: self.data.get("image/svg+xml"))
    png = property(lambda self: self.data.get("image/png"))
    jpeg = property(lambda self: self.data.get("image/jpeg"))
    json = property(lambda self: self.data.get("application/json"))

    def __repr__(self):
        return f"<Result {self.formats()}{' main' if self.is_main_result else ''}>"


class Execution:
    """What one `Session.run` produced."""

    def __init__(self, code, msg_id):
        self.code = code
        self.msg_id = msg_id
        self.stdout = ""
        self.stderr = ""
        self.results = []
        self.error = None
        self.execution_count = None
        self.status = None
        #: execute_reply metadata.cellblock: executions_left, wall_ms, cpu_ms,
        #: memory_peak_bytes, output_truncated, ...
        self.budget = {}
        #: the outputs in nbformat v4 form, in order (for writing notebooks)
        self.outputs = []
        self.duration_s = 0.0
        self.timed_out = False

    @property
    def ok(self):
        return self.status == "ok"

    @property
    def text(self):
        """text/plain of the execute_result (the cell's value), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def truncated(self):
        return bool(self.budget.get("output_truncated"))

    def raise_for_error(self):
        """Raises the error (the server's class, or CodeError for the code's own)."""
        if self.error is None:
            return
        e = self.error
        if self.timed_out and not e.by_server:
            raise error_for("ExecutionTimeout",
                            f"the execution passed its timeout of {self.budget.get('timeout_s')} s "
                            f"and was interrupted ({e.ename}); the session lives on",
                            e.traceback, execution=self)
        if e.by_server or self.timed_out:
            raise error_for(e.ename, e.evalue, e.traceback, execution=self)
        raise CodeError(e.evalue, ename=e.ename, traceback=e.traceback, execution=self)

    def __repr__(self):
        err = f" error={self.error.ename}" if self.error else ""
        return (f"<Execution [{self.execution_count}] {self.status}{err} stdout={len(self.stdout)}B "
                f"results={len(self.results)}>")
