"""Heavy: 300 sandboxes on one host at once, each with a host id range of its
own. With one shared range the box held about 200 (runc's session keyring per
container is charged to the container root's host uid, kernel.keys.maxkeys
200 by default); then every range is released and nothing is left.

CELLBLOCK_HEAVY_SESSIONS sets the count (default 300)."""
import os

import pytest

import server_helpers as sh
from server_helpers import server_factory  # noqa: F401
from test_host_ids import assert_range_free, run

pytestmark = pytest.mark.heavy

SESSIONS = int(os.environ.get("CELLBLOCK_HEAVY_SESSIONS", "300"))
BATCH = 6


def test_hundreds_of_sessions_each_with_their_own_host_ids(server_factory):  # noqa: F811
    srv = server_factory(["--pool", "host=0", "--max-sessions", str(SESSIONS + 10)])
    limits = {"memory_mb": 128}
    sids = []
    connections = {}
    for start in range(0, SESSIONS, BATCH):
        n = min(BATCH, SESSIONS - start)
        replies = srv.call_many([("session_create_request", {"limits": limits})] * n, timeout=600)
        for reply in replies:
            assert reply["content"]["status"] == "ok", (len(sids), reply["content"])
            sids.append(reply["content"]["session_id"])
            connections[sids[-1]] = reply["content"]["connection"]
            srv.session_ids.add(sids[-1])
    ranges = {sid: srv.info_of(sid)["host_ids"] for sid in sids}
    bases = sorted(r["base"] for r in ranges.values())
    assert len(set(bases)) == SESSIONS, "two sessions got the same host ids"
    assert all(b - a >= 65536 for a, b in zip(bases, bases[1:]))
    # They work: a sample over the whole order of starts, the last one included.
    for sid in sids[:: max(1, SESSIONS // 10)] + sids[-1:]:
        kc = srv.connect(connections[sid])
        assert run(kc, "print(6 * 7)").strip() == "42", sid
    srv.close_clients()
    for start in range(0, SESSIONS, 32):
        replies = srv.call_many([("session_close_request", {"session_id": sid})
                                 for sid in sids[start:start + 32]], timeout=600)
        assert all(r["content"]["status"] == "ok" for r in replies)
    for sid in sids:
        sh.assert_session_gone(srv.state_dir, sid, timeout=120)
    for sid, r in ranges.items():
        assert_range_free(srv.state_dir, sid, r["base"], r["count"])
