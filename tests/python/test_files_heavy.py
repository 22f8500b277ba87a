"""The seeds' case at full size: a generated 1 GiB CSV goes up to a session with
a 3 GiB memory limit, pandas aggregates it (in chunks), the result file comes
back byte-identical, and a ~1 GiB file the session writes comes back with the
sha256 the session computed. Heavy: ~2.5 GiB of disk and minutes of CPU.
"""
import hashlib
import os
import pathlib
import random
import sys

import pytest

from server_helpers import server  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python"))

import cellblock  # noqa: E402

pytestmark = pytest.mark.heavy

GiB = 1 << 30
MiB = 1 << 20
CATEGORIES = [f"cat{i:02d}" for i in range(20)]


def make_csv(path, size):
    """A CSV of at least `size` bytes: a random block of rows repeated. Returns
    the expected per-category (row count, sum of value)."""
    rnd = random.Random(13)
    rows = [(rnd.choice(CATEGORIES), rnd.randint(-1000, 100000)) for _ in range(50_000)]
    block = "".join(f"{i},{c},{v}\n" for i, (c, v) in enumerate(rows)).encode()
    per_block = {}
    for c, v in rows:
        n, s = per_block.get(c, (0, 0))
        per_block[c] = (n + 1, s + v)
    header = b"id,category,value\n"
    blocks = -(-(size - len(header)) // len(block))
    with open(path, "wb") as f:
        f.write(header)
        for _ in range(blocks):
            f.write(block)
    return {c: (n * blocks, s * blocks) for c, (n, s) in per_block.items()}


def sha_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MiB), b""):
            h.update(block)
    return h.hexdigest()


AGGREGATE = """
import hashlib, pandas as pd
parts = [chunk.groupby('category')['value'].agg(['count', 'sum'])
         for chunk in pd.read_csv('/data/input/sales.csv', chunksize=2_000_000,
                                  dtype={'id': 'int64', 'category': 'category', 'value': 'int64'})]
total = pd.concat(parts).groupby(level=0).sum().sort_index()
total.to_csv('/data/output/totals.csv')
print(hashlib.sha256(open('/data/output/totals.csv', 'rb').read()).hexdigest())
"""

WRITE_BIG = """
import hashlib, os
h = hashlib.sha256()
with open('/data/output/big.bin', 'wb') as f:
    for i in range(1024):
        block = hashlib.sha256(str(i).encode()).digest() * (1 << 15)   # 1 MiB
        f.write(block)
        h.update(block)
print(h.hexdigest(), os.path.getsize('/data/output/big.bin'))
"""


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
