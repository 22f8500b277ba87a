"""A first probe of hibernation (docs/hibernation.md), not yet a bench figure:
a session holding a 100 MB DataFrame hibernates, then its client runs a
cell; prints the hibernate time, the snapshot size and the time to the
first reply after the wake. Run from a build: JUPYTER_PATH, CELLBLOCK_BIN
and CELLBLOCK_SOURCE_DIR as for the tests."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import server_helpers as sh
srv = sh.start_server()
try:
    sid, kc, _ = srv.open_session(limits={"memory_mb": 2048, "output_mb": 1024})
    sh.run_ok(kc, "import numpy as np, pandas as pd\ndf = pd.DataFrame(np.random.rand(1_600_000, 8))\nprint(df.memory_usage().sum())", timeout=120)
    t = time.monotonic()
    r = srv.ok("session_hibernate_request", {"session_id": sid}, timeout=300)["content"]
    hib = time.monotonic() - t
    t = time.monotonic()
    reply, msgs = sh.execute(kc, "print(df.shape)", timeout=300)
    first = time.monotonic() - t
    print("hibernate_s", round(hib, 3), "snapshot_bytes", r["snapshot_bytes"], r.get("detail"))
    print("first reply after wake_s", round(first, 3), "resumed_ms", reply["metadata"]["cellblock"].get("resumed_ms"), sh.stream_text(msgs).strip())
finally:
    print(srv.shutdown())
