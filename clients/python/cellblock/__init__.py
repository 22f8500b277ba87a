"""cellblock: a Python client for cellblock's session server.

    import cellblock
    with cellblock.connect() as server:             # finds /var/lib/cellblock/server.json
        with server.session(limits={"max_executions": 20}) as s:
            r = s.run("21 * 2")
            print(r.text, r.budget["executions_left"])

Also `python3 -m cellblock.eval` (what `cellblock eval` runs): notebooks as tests.
"""
from .client import (Error, Execution, Result, Server, Session, connect, server_file)
from .errors import *  # noqa: F401,F403  (the exception classes, named after the server's enames)
from .errors import CellblockError, POLICY_ENAMES, error_for

__version__ = "0.1.0"
__all__ = ["connect", "server_file", "Server", "Session", "Execution", "Result", "Error",
           "CellblockError", "POLICY_ENAMES", "error_for"]
