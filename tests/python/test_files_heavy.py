"""The seeds' case at full size: a generated 1 GiB CSV goes up to a session with
a 3 GiB memory limit, pandas aggregates it (in chunks), the result file comes
back byte-identical, and a ~1 GiB file the session writes comes back with the
sha256 the session computed. Heavy: ~2.5 GiB of disk and minutes of CPU.
"""
import os
import pathlib
import sys

import pytest

from server_helpers import server  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python"))

import cellblock  # noqa: E402

pytestmark = pytest.mark.heavy

from gib_workload import AGGREGATE, GiB, WRITE_BIG, make_csv, sha_file  # noqa: E402


def test_one_gib_csv_up_aggregated_and_back(server, tmp_path):  # noqa: F811
    work = pathlib.Path(f"{server.state_dir}-heavy")   # the disk the server keeps sessions on
    work.mkdir()
    try:
        csv_path = work / "sales.csv"
        expected = make_csv(csv_path, GiB)
        size = csv_path.stat().st_size
        assert size >= GiB
        limits = {"memory_mb": 3072, "disk_mb": 1536, "output_mb": 1536, "exec_timeout_s": 1800}
        with cellblock.connect(state_dir=server.state_dir) as cb, cb.session(limits=limits) as s:
            # On the server's host: the descriptor goes over the local file socket,
            # the copy stays in the kernel, progress comes every 64 MiB.
            seen = []
            assert s.put("sales.csv", csv_path, progress=lambda d, t: seen.append(d),
                         timeout=300, local=True, sha256=sha_file(csv_path)) == \
                "/data/input/sales.csv"
            assert seen[-1] == size and len(seen) >= size // (64 << 20), seen
            assert seen == sorted(seen)
            r = s.run(f"import hashlib\nh = hashlib.sha256()\n"
                      f"with open('/data/input/sales.csv', 'rb') as f:\n"
                      f"    for b in iter(lambda: f.read(1 << 22), b''): h.update(b)\n"
                      f"print(h.hexdigest())", timeout=600)
            assert r.stdout.strip() == sha_file(csv_path)
            os.unlink(csv_path)

            r = s.run(AGGREGATE, timeout=1800)
            assert r.ok, r.error
            result = work / "totals.csv"
            s.get("totals.csv", result)
            assert sha_file(result) == r.stdout.strip()   # byte-identical to what the session wrote
            lines = result.read_text().splitlines()
            assert lines[0] == "category,count,sum"
            got = {c: (int(n), int(v)) for c, n, v in (line.split(",") for line in lines[1:])}
            assert got == expected

            r = s.run(WRITE_BIG, timeout=600)
            assert r.ok, r.error
            want_sha, want_size = r.stdout.split()
            # Back both ways: streamed by chunks, and by descriptor.
            for local in (False, True):
                big = work / "big.bin"
                done = []
                s.get("big.bin", big, progress=lambda d, t: done.append(d), timeout=300,
                      local=local)
                assert big.stat().st_size == int(want_size) == GiB
                assert sha_file(big) == want_sha and done[-1] == GiB
                assert len(done) > (100 if not local else 15), (local, len(done))
                big.unlink()
    finally:
        for p in work.glob("*"):
            p.unlink()
        work.rmdir()
