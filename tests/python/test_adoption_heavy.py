"""Twenty sessions through a crash (docs/restarts.md, phase 2), as operators
and their users would see it: each with state and a client of its own,
five of each kind (jupyter_client, `jupyter console --existing`, the Python
client, a kernel of the cellblock provisioner through jupyter_client's
KernelManager). `kill -9` of the server, a request sent during the outage,
a new start: all twenty answer with their variables through the connection
info they had, and the request sent during the outage is answered after it.
Real servers, runc sandboxes, zygote forks, consoles in a pty."""
import json
import os
import shutil
import sys
import tempfile
import time

import pytest

import server_helpers as sh
from server_helpers import send_execute
from test_console import JUPYTER_CONSOLE, Terminal
from test_provisioner import Provisioned

sys.path.insert(0, os.path.join(sh.SOURCE_DIR, "clients", "python"))
import cellblock  # noqa: E402

EACH = 5


@pytest.fixture
def provisioned():
    root = tempfile.mkdtemp(prefix="cellblock-adoption-")
    p = Provisioned(root)
    sys.path.insert(0, p.site)
    yield p, root
    sys.path.remove(p.site)
    p.server.close_clients()
    problems = p.server.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    assert not problems, "\n".join(problems)


def session_lines(log, session_id):
    """What the server's log says of one session (a failure's evidence)."""
    return "\n".join(line for line in log.splitlines() if session_id in line)


def test_twenty_sessions_with_four_kinds_of_client_survive_kill_9(provisioned):
    p, root = provisioned
    srv = p.server
    jc, pyc, prov, consoles = [], [], [], []
    client = cellblock.connect(state_dir=srv.state_dir)
    try:
        for i in range(EACH):
            sid, kc, _ = srv.open_session()
            sh.run_ok(kc, f"v = {i}")
            jc.append((sid, kc))

            s = client.session()
            assert s.run(f"v = {100 + i}").ok
            pyc.append(s)

            km = p.kernel_manager()
            km.start_kernel()
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=120)
            sh.run_ok(kc, f"v = {200 + i}")
            prov.append((km, kc))

            reply = srv.create()
            path = os.path.join(root, f"console-{i}.json")
            with open(path, "w") as f:
                json.dump(reply["connection"], f)
            term = Terminal([JUPYTER_CONSOLE, "--existing", path],
                            dict(os.environ, TERM="xterm-256color"))
            consoles.append(term)
            term.prompt(1, timeout=90)
            mark = term.type_line(f"v = {300 + i}")
            term.prompt(2, mark)
        sessions = srv.ok("session_list_request", {"open_only": True})["content"]["sessions"]
        assert len(sessions) == 4 * EACH, sessions

        watch = sh.ShellWatch(jc[0][1])
        srv.kill9()
        # Sent once the client's libzmq has seen the connection close: one
        # written in the instant the server dies goes into the dead socket,
        # and jupyter_client never sends it again (docs/restarts.md).
        assert watch.wait_closed(timeout=60)
        during = send_execute(jc[0][1], "print(v + 1000)")
        srv.start(timeout=120)
        started = time.monotonic()
        log = srv.log()
        for s in sessions:
            assert f"session {s['session_id']}: adopted" in log, log[-3000:]

        reply, iopub, _ = sh.collect_execution(jc[0][1], during, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert sh.stream_text(iopub).strip() == "1000"
        for i, (sid, kc) in enumerate(jc):
            assert sh.run_ok(kc, "print(v)").strip() == str(i), sid
        for i, s in enumerate(pyc):
            ex = s.run("print(v)")
            assert ex.stdout == f"{100 + i}\n", (s.id, ex.status, ex.error, ex.budget,
                                                 session_lines(srv.log(), s.id))
        for i, (km, kc) in enumerate(prov):
            assert sh.run_ok(kc, "print(v)").strip() == str(200 + i)
            assert km.is_alive()
        # jupyter console looks at its heartbeat once a second, and shows no
        # output of a cell typed while it has not heard one (its run_cell
        # stops waiting): a person's pause after the outage (docs/client.md).
        time.sleep(max(0.0, started + 2.5 - time.monotonic()))
        for i, term in enumerate(consoles):
            mark = term.type_line("print(v)")
            term.expect(rf"^{300 + i}$", mark, timeout=120)
            term.prompt(3, mark)
        infos = [srv.info_of(s["session_id"]) for s in sessions]
        assert all(info["state"] == "idle" for info in infos), infos
    finally:
        for term in consoles:
            term.kill()
        for km, kc in prov:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        for s in pyc:
            s.close()
        client.close()
