"""The seeds' workload at full size, shared by test_files_heavy.py and the
benchmark of Swarm sessions' files (bench/swarm_files.py): a generated CSV
of a given size with its expected aggregate, the pandas code that aggregates
it in a session, and the code that writes a 1 GiB file with its sha256."""
import hashlib
import random

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
