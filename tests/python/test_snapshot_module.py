"""The portable snapshot (kernel-shim/cellblock_snapshot.py) with real IPython
shells and real dill: a namespace saved in one interpreter is restored in
another, with what could not be carried named. Each side runs in its own
/usr/bin/python3 process, as a hibernated session's two kernels do."""
import json
import os
import subprocess
import tarfile
import textwrap

import pytest

SOURCE = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SHIM = os.path.join(SOURCE, "kernel-shim")

# A shell like a kernel's: IPython's InteractiveShell, cells run through it.
PRELUDE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, %r)
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    def cell(code, store_history=False):
        result = shell.run_cell(code, store_history=store_history)
        if not result.success:
            raise SystemExit("cell failed: " + repr(code) + ": " + repr(result.error_in_exec or result.error_before_exec))
    import cellblock_snapshot
""" % SHIM)


def run(body, home, tmp):
    output = os.path.join(os.path.dirname(str(home)), "output")
    os.makedirs(output, exist_ok=True)
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp), MPLBACKEND="Agg",
               CELLBLOCK_OUTPUT_DIR=output)
    proc = subprocess.run(["/usr/bin/python3", "-c", PRELUDE + textwrap.dedent(body)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def dirs(tmp_path):
    out = {}
    for side in ("before", "after"):
        for d in ("home", "tmp"):
            (tmp_path / side / d).mkdir(parents=True)
        out[side] = (tmp_path / side / "home", tmp_path / side / "tmp")
    out["snapshot"] = tmp_path / "snapshot.tar"
    return out


def test_round_trip_keeps_values_functions_classes_and_files(dirs):
    home, tmp = dirs["before"]
    saved = run("""
        cell("import numpy as np\\nimport pandas as pd\\nimport math as m")
        cell("n = 42\\ns = 'héllo'\\nrows = [1, 2, 3]\\nalias = rows")
        cell("arr = np.arange(12).reshape(3, 4)")
        cell("df = pd.DataFrame({'a': range(1000), 'b': [str(i) for i in range(1000)]})")
        cell("def double(x):\\n    return 2 * x + n")
        cell("class Point:\\n    def __init__(self, x): self.x = x\\n    def norm(self): return abs(self.x)")
        cell("p = Point(-3)")
        cell("def counter():\\n    c = [0]\\n    def inc():\\n        c[0] += 1\\n        return c[0]\\n    return inc\\ninc = counter(); inc(); inc()")
        cell("import matplotlib.pyplot as plt\\nfig, ax = plt.subplots(); ax.plot([1, 2, 3])")
        cell("gen = (i for i in range(3))")
        cell("import socket\\nsock = socket.socket()")
        cell("import os\\nopen(os.environ['TMPDIR'] + '/note.txt', 'w').write('in tmp')")
        cell("open(os.environ['CELLBLOCK_OUTPUT_DIR'] + '/plot.txt', 'w').write('an output')")
        cell("import os\\nos.makedirs(os.path.expanduser('~/work'), exist_ok=True)\\nopen(os.path.expanduser('~/work/data.csv'), 'w').write('a,b\\\\n1,2\\\\n')")
        cell("n * 2", store_history=True)
        cell("rows", store_history=True)
        r = cellblock_snapshot.save(shell, %r)
        print(json.dumps(r))
    """ % str(dirs["snapshot"]), home, tmp)
    lost = {name for name, why in saved["lost"]}
    assert lost == {"gen", "sock"}, saved
    home2, tmp2 = dirs["after"]
    restored = run("""
        r = cellblock_snapshot.restore(shell, %r)
        ns = shell.user_ns
        checks = {
            "n": ns["n"] == 42, "s": ns["s"] == "héllo",
            "alias": ns["alias"] is ns["rows"],
            "arr": ns["arr"].sum() == 66 and ns["np"].__name__ == "numpy",
            "df": len(ns["df"]) == 1000 and ns["df"]["b"][999] == "999",
            "double": ns["double"](1) == 44,
            "instance": isinstance(ns["p"], ns["Point"]) and ns["p"].norm() == 3,
            "closure": ns["inc"]() == 3,
            "figure": len(ns["fig"].axes) == 1,
            "module": ns["m"].sqrt(16) == 4,
            "tmp": open(__import__('os').environ['TMPDIR'] + '/note.txt').read() == 'in tmp',
            "output": open(__import__('os').environ['CELLBLOCK_OUTPUT_DIR'] + '/plot.txt').read() == 'an output',
            "home": open(__import__('os').path.expanduser('~/work/data.csv')).read() == 'a,b\\n1,2\\n',
            # The prompts go on: the count, In and Out, _N and _iN.
            "count": shell.execution_count == 3,
            "In": ns["In"][1].strip() == "n * 2" and ns["_i2"].strip() == "rows",
            "Out": ns["Out"][1] == 84 and ns["_2"] is ns["rows"] and ns["_"] is ns["rows"],
        }
        # A function restored sees the live namespace: a global changed later is seen.
        cell("n = 100")
        checks["globals"] = ns["double"](1) == 102
        print(json.dumps({"report": r, "checks": checks}))
    """ % str(dirs["snapshot"]), home2, tmp2)
    failed = [k for k, ok in restored["checks"].items() if not ok]
    assert not failed, restored
    assert {name for name, why in restored["report"]["lost"]} == {"gen", "sock"}
    whys = dict(restored["report"]["lost"])
    assert "generator" in whys["gen"] and "socket" in whys["sock"], whys


def test_big_arrays_leave_the_pickle_as_buffers_and_come_back_exact(dirs):
    """Format 3: an array's data is a tar member of its own, written from the
    array's memory and read into the new one; sharing, memory order,
    read-only flags and views survive, and the restored arrays are writable."""
    home, tmp = dirs["before"]
    saved = run("""
        cell("import numpy as np\\nimport pandas as pd")
        cell("big = np.arange(1_000_000, dtype=np.float64)\\nsame = big\\nholder = {'arr': big}")
        cell("fort = np.asfortranarray(np.arange(200_000.0).reshape(400, 500))")
        cell("view = big[::2]")
        cell("ro = np.ones(100_000)\\nro.flags.writeable = False")
        cell("frame = pd.DataFrame({'a': np.arange(200_000), 'b': np.arange(200_000) * 0.5})")
        cell("small = np.arange(10)")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % str(dirs["snapshot"]), home, tmp)
    assert saved["lost"] == [], saved
    with tarfile.open(dirs["snapshot"]) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        members = {m.name: m.size for m in tar.getmembers()}
    assert manifest["format"] == 3
    sizes = manifest["buffers"]
    # big once (shared three ways), fort, ro, the frame's two blocks; not the
    # view (not contiguous) nor the small array.
    assert 8_000_000 in sizes and sizes.count(8_000_000) == 1, sizes
    assert 1_600_000 in sizes and 800_000 in sizes, sizes
    assert all(size >= 64 << 10 for size in sizes), sizes
    assert [members[f"buffers/{n}"] for n in range(len(sizes))] == sizes
    # The pickle itself holds the view's data, not the big arrays'.
    assert members["namespace.dill"] < 8_000_000, members
    home2, tmp2 = dirs["after"]
    restored = run("""
        r = cellblock_snapshot.restore(shell, %r)
        ns = shell.user_ns
        np = ns["np"]
        checks = {
            "big": float(ns["big"].sum()) == 499999500000.0 and ns["big"].dtype == np.float64,
            "shared": ns["same"] is ns["big"] and ns["holder"]["arr"] is ns["big"],
            "fortran": ns["fort"].flags.f_contiguous and float(ns["fort"][399, 499]) == 199999.0,
            "view": ns["view"].shape == (500_000,) and float(ns["view"][1]) == 2.0,
            "readonly": ns["ro"].flags.writeable is False and float(ns["ro"].sum()) == 100000.0,
            "frame": int(ns["frame"]["a"].sum()) == 19999900000 and float(ns["frame"]["b"][3]) == 1.5,
            "small": ns["small"].tolist() == list(range(10)),
        }
        cell("big[0] = 7.0\\nframe.loc[0, 'b'] = 9.0")
        checks["writable"] = float(ns["same"][0]) == 7.0 and float(ns["frame"]["b"][0]) == 9.0
        print(json.dumps({"report": r, "checks": checks}))
    """ % str(dirs["snapshot"]), home2, tmp2)
    failed = [k for k, ok in restored["checks"].items() if not ok]
    assert not failed, restored
    assert restored["report"]["lost"] == []
    assert set(restored["report"]["ms"]) == {"read", "waited", "files", "imports", "namespace"}


def test_a_format_2_snapshot_still_restores(dirs):
    """What a server before format 3 kept (one in-band dill pickle) wakes
    under this one."""
    body = """
        import dill, io, tarfile, time
        cell("import numpy as np")
        cell("arr = np.arange(100_000)\\nname = 'kept'\\ndef f(x):\\n    return x + 1")
        values = {k: shell.user_ns[k] for k in ("arr", "name", "f")}
        manifest = {"format": 2, "python": "%%d.%%d" %% sys.version_info[:2], "dill": dill.__version__,
                    "taken_at": time.time(), "modules": {"np": "numpy"}, "lost": [],
                    "execution_count": 3, "input_parsed": ["", "import numpy as np", "arr = 1"],
                    "input_raw": ["", "import numpy as np", "arr = 1"], "dirs": {}}
        with tarfile.open(%r, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in (("manifest.json", json.dumps(manifest).encode()),
                               ("namespace.dill", dill.dumps({"names": values, "outputs": {}}))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        print(json.dumps({}))
    """
    home, tmp = dirs["before"]
    run(body % str(dirs["snapshot"]), home, tmp)
    home2, tmp2 = dirs["after"]
    restored = run("""
        r = cellblock_snapshot.restore(shell, %r)
        ns = shell.user_ns
        print(json.dumps({"report": r, "sum": int(ns["arr"].sum()), "name": ns["name"],
                          "f": ns["f"](1), "count": shell.execution_count}))
    """ % str(dirs["snapshot"]), home2, tmp2)
    assert restored["report"]["lost"] == [], restored
    assert (restored["sum"], restored["name"], restored["f"], restored["count"]) == \
        (4999950000, "kept", 2, 3)


def test_a_module_that_no_longer_imports_is_named(dirs, tmp_path):
    home, tmp = dirs["before"]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "vanishing.py").write_text("X = 1\n")
    run("""
        sys.path.insert(0, %r)
        cell("import vanishing")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % (str(pkg), str(dirs["snapshot"])), home, tmp)
    (pkg / "vanishing.py").unlink()
    home2, tmp2 = dirs["after"]
    restored = run("""
        sys.path.insert(0, %r)
        print(json.dumps(cellblock_snapshot.restore(shell, %r)))
    """ % (str(pkg), str(dirs["snapshot"])), home2, tmp2)
    assert restored["lost"] and restored["lost"][0][0] == "vanishing", restored
    assert "import vanishing" in restored["lost"][0][1]


def test_another_format_is_refused_with_a_reason(dirs):
    home, tmp = dirs["before"]
    run("""
        cell("x = 1")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % str(dirs["snapshot"]), home, tmp)
    # Rewrite the manifest as a later format would.
    with tarfile.open(dirs["snapshot"]) as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]
    newer = dirs["snapshot"].with_name("newer.tar")
    with tarfile.open(newer, "w") as tar:
        for m, data in members:
            if m.name == "manifest.json":
                manifest = json.loads(data)
                manifest["format"] = 4
                data = json.dumps(manifest).encode()
                m.size = len(data)
            tar.addfile(m, __import__("io").BytesIO(data) if data is not None else None)
    home2, tmp2 = dirs["after"]
    out = run("""
        try:
            cellblock_snapshot.restore(shell, %r)
            print(json.dumps({"refused": None}))
        except cellblock_snapshot.SnapshotRefused as e:
            print(json.dumps({"refused": str(e), "x": "x" in shell.user_ns}))
    """ % str(newer), home2, tmp2)
    assert out["refused"] == "snapshot format 4, this kernel reads 2 and 3", out
    assert out["x"] is False


def test_paths_outside_the_directories_are_refused(dirs, tmp_path):
    home, tmp = dirs["before"]
    run("""
        cell("x = 1")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % str(dirs["snapshot"]), home, tmp)
    with tarfile.open(dirs["snapshot"], "a") as tar:
        info = tarfile.TarInfo("files/tmp/../escaped.txt")
        data = b"out"
        info.size = len(data)
        tar.addfile(info, __import__("io").BytesIO(data))
    home2, tmp2 = dirs["after"]
    out = run("""
        print(json.dumps(cellblock_snapshot.restore(shell, %r)))
    """ % str(dirs["snapshot"]), home2, tmp2)
    assert ["files/tmp/../escaped.txt", "refused: a path outside its directory"] in out["lost"]
    assert not (tmp2.parent / "escaped.txt").exists()
    assert out["saved"] >= 1


# Copies the saved snapshot into the restore's path in 256 KiB pieces, 5 ms
# apart, on a thread, as a wake's server opens it while the kernel reads.
GROWING = """
    import threading, time
    whole = open(%(saved)r, "rb").read()
    progress = {"written": 0, "first_read_at": None}
    out = open(%(target)r, "wb", buffering=0)
    def write_slowly(stop_at):
        for at in range(0, stop_at, 256 << 10):
            out.write(whole[at:min(at + (256 << 10), stop_at)])
            progress["written"] = min(at + (256 << 10), stop_at)
            time.sleep(0.005)
    original = cellblock_snapshot._Growing.readinto
    def watched(self, buffer):
        if progress["first_read_at"] is None:
            progress["first_read_at"] = progress["written"]
        return original(self, buffer)
    cellblock_snapshot._Growing.readinto = watched
"""


def growing(saved, target, body):
    """A restoring process's code: GROWING, then `body`."""
    return textwrap.dedent(GROWING % {"saved": saved, "target": target}) + textwrap.dedent(body)


def test_a_snapshot_is_restored_while_it_is_still_being_written(dirs):
    """A wake's server opens the snapshot into /data/input while the kernel
    already reads it (docs/hibernation.md, "The wake's kernel reads while
    the server opens"): given the final size, the restore reads in the
    archive's order and waits for each byte it needs (a big array's two
    halves on two threads), and ends with everything the snapshot holds."""
    home, tmp = dirs["before"]
    saved = run("""
        cell("import numpy as np")
        cell("big = np.arange(1_000_000, dtype=np.float64)\\nword = 'kept'\\ndef f(x):\\n    return x + 1")
        import os
        open(os.path.join(os.environ["TMPDIR"], "note.txt"), "w").write("in tmp")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % str(dirs["snapshot"]), home, tmp)
    assert saved["lost"] == [], saved
    total = os.path.getsize(dirs["snapshot"])
    home2, tmp2 = dirs["after"]
    target = str(dirs["snapshot"]) + ".placed"
    out = run(growing(str(dirs["snapshot"]), target, """
        # The 8 MB array is read by two threads, as one of 32 MB or more is.
        cellblock_snapshot._SPLIT_READ_MIN = 1 << 20
        import types
        started = []
        class Recorded(threading.Thread):
            def start(self):
                started.append(self.name)
                super().start()
        cellblock_snapshot.threading = types.SimpleNamespace(Thread=Recorded)
        writer = threading.Thread(target=write_slowly, args=(len(whole),))
        writer.start()
        r = cellblock_snapshot.restore(shell, %(target)r, size=len(whole))
        writer.join()
        ns = shell.user_ns
        import os
        print(json.dumps({"report": r, "first_read_at": progress["first_read_at"],
                          "total": len(whole), "threads": started,
                          "big": float(ns["big"].sum()), "word": ns["word"], "f": ns["f"](1),
                          "exact": bool((ns["big"] == ns["np"].arange(1_000_000, dtype="float64")).all()),
                          "note": open(os.path.join(os.environ["TMPDIR"], "note.txt")).read()}))
    """ % {"target": target}), home2, tmp2)
    assert out["total"] == total
    # It began reading long before the file was whole, and got all of it.
    assert out["first_read_at"] < total // 2, out
    assert out["report"]["lost"] == [], out
    assert out["big"] == 499999500000.0 and out["exact"], out
    assert out["threads"] == ["cellblock-restore"], out
    assert out["word"] == "kept" and out["f"] == 2
    assert out["note"] == "in tmp"


def test_a_snapshot_that_stops_growing_is_refused_with_where_it_stopped(dirs):
    """A server that stopped writing (its opening failed, and it closes the
    session) never leaves the restore waiting for ever, nor restoring half."""
    home, tmp = dirs["before"]
    run("""
        cell("x = list(range(200_000))")
        print(json.dumps(cellblock_snapshot.save(shell, %r)))
    """ % str(dirs["snapshot"]), home, tmp)
    home2, tmp2 = dirs["after"]
    target = str(dirs["snapshot"]) + ".placed"
    out = run(growing(str(dirs["snapshot"]), target, """
        cellblock_snapshot._PATIENCE_S = 0.5
        half = (len(whole) // 2) & ~511
        write_slowly(half)
        try:
            cellblock_snapshot.restore(shell, %(target)r, size=len(whole))
            print(json.dumps({"refused": None}))
        except cellblock_snapshot.SnapshotRefused as e:
            print(json.dumps({"refused": str(e), "half": half, "total": len(whole),
                              "x": "x" in shell.user_ns}))
    """ % {"target": target}), home2, tmp2)
    assert out["refused"] == f"the snapshot stopped at {out['half']} of {out['total']} bytes", out
    assert out["x"] is False
