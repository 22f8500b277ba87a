"""`cellblock eval` on real notebooks, real sessions, real sandboxes.

The notebooks of notebooks/ declare what each cell must produce; this test
runs them all (on an embedded server, as `make test` would without one
running) and fails on any verdict that is not the declared one. It then
checks the report files themselves, and that the evaluator is honest: a
deliberately wrong expectation, an undeclared limit and hostile output are
reported as what they are.
"""
import base64
import glob
import hashlib
import json
import os
import re
import subprocess

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from server_helpers import CELLBLOCK_BIN, server  # noqa: F401

SOURCE_DIR = os.environ.get(
    "CELLBLOCK_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NOTEBOOKS = os.path.join(SOURCE_DIR, "notebooks")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_eval(*args, timeout=600):
    proc = subprocess.Popen([CELLBLOCK_BIN, "eval", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return proc, out, err


def notebook(path, cells, **cellblock):
    nb = new_notebook(cells=[])
    for source, expect in cells:
        cell = new_code_cell(source)
        if expect is not None:
            cell.metadata["cellblock"] = {"expect": expect}
        nb.cells.append(cell)
    if cellblock:
        nb.metadata["cellblock"] = cellblock
    nbformat.write(nb, str(path))
    return str(path)


@pytest.fixture(scope="module")
def repo_run(tmp_path_factory):
    """All of notebooks/ through `cellblock eval --embedded`, once for the module."""
    report = tmp_path_factory.mktemp("eval-report")
    proc, out, err = run_eval(NOTEBOOKS, "--parallel", "6", "--embedded", "--report", str(report))
    return proc, err, str(report)


def test_every_notebook_gets_its_declared_verdict(repo_run):
    proc, err, report = repo_run
    assert proc.returncode == 0, err
    data = json.load(open(os.path.join(report, "report.json")))
    names = sorted(os.path.splitext(os.path.basename(p))[0]
                   for p in glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))
    assert sorted(nb["name"] for nb in data["notebooks"]) == names
    for nb in data["notebooks"]:
        failing = [(c["index"] + 1, c["mismatches"]) for c in nb["cells"] if not c["passed"]]
        assert nb["as_declared"], (nb["name"], nb["verdict"], nb["error"], failing)
        assert nb["cells_total"] > 0 and nb["cells_passed"] == nb["cells_total"]
    assert data["summary"]["not_as_declared"] == 0
    assert data["server"]["embedded"] is True
    # The embedded server stopped and took its state dir with it.
    assert glob.glob(f"/run/cellblock-eval-{proc.pid}-*") == []
    # Progress went to the terminal (stderr) while it ran.
    assert "6/6 notebooks as declared" in err or f"{len(names)}/{len(names)} notebooks as declared" in err


def test_adversarial_cells_got_the_errors_they_declare(repo_run):
    _, _, report = repo_run
    nb = {n["name"]: n for n in json.load(open(os.path.join(report, "report.json")))["notebooks"]}
    cells = nb["adversarial"]["cells"]
    outcomes = [(c["outcome"], c["ename"]) for c in cells]
    assert ("error", "PermissionError") in outcomes
    assert ("limit", "MemoryLimitExceeded") in outcomes
    assert outcomes[-1] == ("closed", "SessionClosed")
    assert any(c["outcome"] == "timeout" for c in cells)
    assert any(c["truncated"] for c in cells)
    # Every escape attempt failed: only the identity probe, the routing tables'
    # listing, the output flood and the cell after the interrupt ran without error.
    assert sum(c["outcome"] == "ok" for c in cells) == 4, outcomes


def test_walkthrough_files_are_fetched_byte_identical(repo_run):
    _, _, report = repo_run
    nb = {n["name"]: n for n in json.load(open(os.path.join(report, "report.json")))["notebooks"]}
    walk = nb["walkthrough"]
    printed = dict(re.findall(r"^(\S+) \d+ ([0-9a-f]{64})$", walk["cells"][5]["text"], re.MULTILINE))
    assert set(printed) == {"region_summary.csv", "revenue_by_month.png"}, walk["cells"][5]["text"]
    for f in walk["fetched"]:
        data = open(os.path.join(report, f["local"]), "rb").read()
        assert hashlib.sha256(data).hexdigest() == f["sha256"] == printed[f["path"]]
    csv = open(os.path.join(report, "files", "walkthrough", "region_summary.csv")).read()
    assert "East,28,585,6558.56" in csv
    png = open(os.path.join(report, "files", "walkthrough", "revenue_by_month.png"), "rb").read()
    assert png.startswith(PNG_MAGIC)


def test_executed_notebooks_and_the_html_report(repo_run):
    _, _, report = repo_run
    data = json.load(open(os.path.join(report, "report.json")))
    html = open(os.path.join(report, "report.html")).read()
    for nb in data["notebooks"]:
        executed = nbformat.read(os.path.join(report, nb["executed"]), as_version=4)
        nbformat.validate(executed)
        assert executed.metadata["cellblock"]["eval"]["verdict"] == nb["verdict"]
        code = [c for c in executed.cells if c.cell_type == "code"]
        assert all("result" in c.metadata["cellblock"] for c in code)
        assert f"id='{nb['name']}'" in html
    walk = nbformat.read(os.path.join(report, "notebooks", "walkthrough.ipynb"), as_version=4)
    pngs = [base64.b64decode(o["data"]["image/png"]) for c in walk.cells if c.cell_type == "code"
            for o in c.outputs if "image/png" in o.get("data", {})]
    assert pngs and all(p.startswith(PNG_MAGIC) for p in pngs)
    # The report is one self-contained file: plots inline, nothing fetched from elsewhere.
    inline = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert len(inline) >= 10 and base64.b64decode(inline[0]).startswith(PNG_MAGIC)
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", html)
    assert "<script" not in html.lower()


def test_a_wrong_expectation_and_an_undeclared_limit_fail_and_nothing_else(server, tmp_path):  # noqa: F811
    wrong = notebook(tmp_path / "wrong.ipynb", [
        ("x = 1 + 1\nprint(x)", {"output_contains": "2"}),
        ("x * 10", {"error": "ZeroDivisionError"}),             # deliberately wrong
        ("print('<script>alert(1)</script>')", {"output_contains": "nothing like this"}),
        ("print('typo')", {"output_contain": "typo"}),            # a typo cannot pass silently
    ])
    declared_fail = notebook(tmp_path / "declared_fail.ipynb", [
        ("1 / 0", None),                                       # an error nobody declared...
    ], expect_verdict="fail")                                  # ...in a notebook that says it fails
    hog = notebook(tmp_path / "hog.ipynb", [
        ("hog = b'x' * (512 << 20)", None),                    # hits a limit it does not declare
        ("print('after')", None),
    ], limits={"memory_mb": 128})
    fine = notebook(tmp_path / "fine.ipynb", [("print(sum(range(10)))", {"output_contains": "45"})])
    report = tmp_path / "report"
    proc, out, err = run_eval(wrong, declared_fail, hog, fine, "--parallel", "4", "--state-dir",
                              server.state_dir, "--no-embedded", "--report", str(report))
    assert proc.returncode == 1, err
    data = json.load(open(report / "report.json"))
    assert data["server"]["embedded"] is False
    nb = {n["name"]: n for n in data["notebooks"]}
    assert (nb["wrong"]["verdict"], nb["wrong"]["as_declared"]) == ("fail", False)
    assert [c["passed"] for c in nb["wrong"]["cells"]] == [True, False, False, False]
    assert nb["wrong"]["cells"][1]["mismatches"] == ["expected error ZeroDivisionError, got ok"]
    assert nb["wrong"]["cells"][3]["mismatches"][0].startswith("unknown expectation output_contain")
    assert (nb["declared_fail"]["verdict"], nb["declared_fail"]["as_declared"]) == ("fail", True)
    assert (nb["hog"]["verdict"], nb["hog"]["as_declared"]) == ("fail", False)
    assert [(c["outcome"], c["ename"]) for c in nb["hog"]["cells"]] == \
        [("limit", "MemoryLimitExceeded"), ("closed", "SessionClosed")]
    # The notebook that hit a limit failed alone: its neighbour in the same run passed.
    assert (nb["fine"]["verdict"], nb["fine"]["as_declared"]) == ("pass", True)
    assert data["summary"]["not_as_declared"] == 2
    html = open(report / "report.html").read()
    assert "expected error ZeroDivisionError, got ok" in html
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "FAIL" in err and "wrong" in err
    # Every session of the run is closed again.
    open_now = server.ok("session_list_request", {"open_only": True})["content"]["sessions"]
    assert [s for s in open_now if s["session_id"] in {n["session_id"] for n in nb.values()}] == []


def test_without_a_server_and_without_embedding_it_says_so(tmp_path):
    nb = notebook(tmp_path / "one.ipynb", [("1", None)])
    proc, out, err = run_eval(nb, "--state-dir", str(tmp_path), "--no-embedded",
                              "--report", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "no server connection file" in err


def test_a_global_log_level_before_eval_is_accepted(tmp_path):
    """`cellblock --log-level debug eval ...` runs the evaluator, as
    `cellblock eval ...` does (the global option has nothing to set there)."""
    nb = notebook(tmp_path / "one.ipynb", [("1", None)])
    for prefix in (["--log-level", "debug"], ["--log-level=warn"]):
        proc = subprocess.run([CELLBLOCK_BIN, *prefix, "eval", str(nb), "--state-dir",
                               str(tmp_path), "--no-embedded", "--report", str(tmp_path / "r")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "no server connection file" in proc.stderr, proc.stderr
    # Anything else before `eval` is still the C++ parser's to refuse.
    proc = subprocess.run([CELLBLOCK_BIN, "--bogus", "eval"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "usage: cellblock eval" not in proc.stdout + proc.stderr
