"""cellblock eval: run notebooks in fresh sandboxed sessions, as tests, with a report.

    cellblock eval NOTEBOOK_OR_DIR... [--parallel N] [--image I] [--limit k=v]
                   [--timeout S] [--report DIR] [--state-dir DIR | --embedded]

(`cellblock eval` execs `python3 -m cellblock.eval`.) Each notebook runs in
its own session; every code cell is executed in order, and each outcome is
checked against what the cell declares in `metadata.cellblock.expect`
(default: the cell runs without error). A notebook's verdict is `pass` when
every cell got what it declared, else `fail` (`error` when it could not run
at all). The exit code is 0 when every verdict is the one the notebook
declares (`metadata.cellblock.expect_verdict`, default `pass`), 1 otherwise,
2 on bad usage or when no server could be reached or started.

See docs/eval.md for the metadata a notebook and its cells may carry.
"""
import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import sys
import threading
import time

import nbformat

from . import client as cb
from .errors import CellblockError, ClientTimeout, ServerNotFound
from .eval_report import json_default, write_html
from .eval_server import EmbeddedServer, find_binary

OUTCOME_KEYS = ("ok", "error", "limit", "timeout", "outcome")
EXPECT_KEYS = OUTCOME_KEYS + ("output_contains", "output_not_contains", "output_matches",
                              "display", "max_wall_ms", "max_memory_mb")
LIMIT_ENAMES = ("ExecutionLimitExceeded", "MemoryLimitExceeded", "SessionBusy", "InvalidLimits",
                "LimitAboveMaximum")


# ---------------------------------------------------------------- outcomes and expectations

def classify(ex):
    """(outcome, ename) of an Execution: ok, error, timeout, limit or closed."""
    if ex.error is None:
        return "ok", None
    e = ex.error
    if ex.timed_out:
        return "timeout", e.ename
    if e.by_server and e.ename in LIMIT_ENAMES:
        return "limit", e.ename
    if e.by_server and e.ename == "SessionClosed":
        return "closed", e.ename
    return "error", e.ename


def output_text(ex_outputs):
    """Everything textual a cell showed: streams, text/plain, error name and value."""
    parts = []
    for o in ex_outputs:
        kind = o.get("output_type")
        if kind == "stream":
            parts.append(o.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text = o.get("data", {}).get("text/plain", "")
            parts.append("".join(text) if isinstance(text, list) else text)
        elif kind == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(parts)


def _names(value):
    return [value] if isinstance(value, str) else list(value)


def check_expect(expect, rec):
    """The ways cell record `rec` differs from `expect` (empty: as declared)."""
    if expect is None:
        expect = {}
    if not isinstance(expect, dict):
        return [f"metadata.cellblock.expect must be an object, got {expect!r}"]
    unknown = sorted(set(expect) - set(EXPECT_KEYS))
    if unknown:
        return [f"unknown expectation {', '.join(unknown)} (known: {', '.join(EXPECT_KEYS)})"]
    if not any(k in expect for k in OUTCOME_KEYS):
        expect = dict(expect, ok=True)
    got = rec["outcome"] + (f" {rec['ename']}" if rec.get("ename") else "")
    bad = []
    if "ok" in expect and (rec["outcome"] == "ok") != bool(expect["ok"]):
        bad.append(f"expected {'ok' if expect['ok'] else 'not ok'}, got {got}")
    if "outcome" in expect and rec["outcome"] not in _names(expect["outcome"]):
        bad.append(f"expected outcome {expect['outcome']}, got {got}")
    if "error" in expect:
        want = expect["error"]
        if rec["outcome"] == "ok":
            bad.append(f"expected error {want}, got ok")
        elif want is not True and rec.get("ename") not in _names(want):
            bad.append(f"expected error {want}, got {got}")
    if "limit" in expect:
        want = expect["limit"]
        hit = [rec["ename"]] if rec["outcome"] == "limit" else []
        if rec.get("truncated"):
            hit.append("output")
        if not hit if want is True else not set(hit) & set(_names(want)):
            bad.append(f"expected limit {want}, got {got}{' (output truncated)' if rec.get('truncated') else ''}")
    if "timeout" in expect and (rec["outcome"] == "timeout") != bool(expect["timeout"]):
        bad.append(f"expected {'a' if expect['timeout'] else 'no'} timeout, got {got}")
    text = rec.get("text", "")
    for needle in _names(expect.get("output_contains", [])):
        if needle not in text:
            bad.append(f"output does not contain {needle!r}")
    for needle in _names(expect.get("output_not_contains", [])):
        if needle in text:
            bad.append(f"output contains {needle!r}")
    for pattern in _names(expect.get("output_matches", [])):
        if not re.search(pattern, text, re.MULTILINE):
            bad.append(f"output does not match /{pattern}/")
    for mime in _names(expect.get("display", [])):
        if mime not in rec.get("mimes", []):
            bad.append(f"no {mime} output (got {', '.join(rec.get('mimes', [])) or 'none'})")
    if "max_wall_ms" in expect and (rec.get("wall_ms") or 0) > expect["max_wall_ms"]:
        bad.append(f"took {rec.get('wall_ms')} ms, over {expect['max_wall_ms']} ms")
    if "max_memory_mb" in expect and \
            (rec.get("memory_peak_bytes") or 0) > expect["max_memory_mb"] * 2**20:
        bad.append(f"peak memory {rec['memory_peak_bytes'] / 2**20:.0f} MB, over "
                   f"{expect['max_memory_mb']} MB")
    return bad


# ---------------------------------------------------------------- progress

class Progress:
    """Progress on stderr: a live status line on a terminal, plain lines otherwise."""

    def __init__(self, total_notebooks, total_cells, stream=sys.stderr, quiet=False):
        self.lock = threading.Lock()
        self.stream = stream
        self.quiet = quiet
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.total_notebooks, self.total_cells = total_notebooks, total_cells
        self.done_notebooks = self.done_cells = self.failed_cells = 0
        self.running = {}
        self.started = time.monotonic()

    def _status(self):
        running = ", ".join(f"{n} {c}" for n, c in list(self.running.items())[:3])
        more = f" +{len(self.running) - 3}" if len(self.running) > 3 else ""
        return (f"[{self.done_notebooks}/{self.total_notebooks} notebooks, "
                f"{self.done_cells}/{self.total_cells} cells, {self.failed_cells} not as declared, "
                f"{time.monotonic() - self.started:.0f} s] {running}{more}")

    def _line(self, text):
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\033[K" + text + "\n" + self._status()[:200])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _refresh(self):
        if self.tty and not self.quiet:
            self.stream.write("\r\033[K" + self._status()[:200])
            self.stream.flush()

    def notebook_started(self, name, cells):
        with self.lock:
            self.running[name] = f"0/{cells}"
            if not self.tty:
                self._line(f"  start  {name} ({cells} cells)")
            self._refresh()

    def cell_done(self, name, index, cells, rec):
        with self.lock:
            self.done_cells += 1
            self.running[name] = f"{index + 1}/{cells}"
            if not rec["passed"]:
                self.failed_cells += 1
                self._line(f"  ✗ {name} cell {index + 1}: {'; '.join(rec['mismatches'])}")
            self._refresh()

    def notebook_done(self, rec):
        with self.lock:
            self.done_notebooks += 1
            self.running.pop(rec["name"], None)
            mark = "ok  " if rec["as_declared"] else "FAIL"
            self._line(f"  {mark}   {rec['name']}: {rec['verdict']} (declared {rec['declared']}), "
                       f"{rec['cells_passed']}/{rec['cells_total']} cells as declared, "
                       f"{rec['duration_s']:.1f} s")

    def finish(self):
        if self.tty and not self.quiet:
            self.stream.write("\r\033[K")
            self.stream.flush()


# ---------------------------------------------------------------- running one notebook

def _cell_source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _safe_name(path, taken):
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.splitext(os.path.basename(path))[0]) or "notebook"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def run_notebook(job, server, opts, progress):
    """Runs one notebook in a fresh session; returns its record (and writes it out)."""
    path, name = job["path"], job["name"]
    nb = job["nb"]
    meta = dict(nb.metadata.get("cellblock", {}) or {})
    started = time.monotonic()
    rec = {"name": name, "path": path, "declared": meta.get("expect_verdict", "pass"),
           "verdict": "error", "as_declared": False, "error": None, "session_id": None,
           "image": opts.image or meta.get("image"), "limits": {}, "cells": [], "fetched": [],
           "cells_total": 0, "cells_passed": 0, "peak_memory_bytes": 0, "duration_s": 0.0,
           "executed": os.path.join("notebooks", name + ".ipynb")}
    limits = dict(opts.limits)
    limits.update(meta.get("limits", {}) or {})
    rec["limits"] = limits
    code_cells = [c for c in nb.cells if c.cell_type == "code" and
                  "skip-eval" not in c.get("metadata", {}).get("tags", [])]
    rec["cells_total"] = len(code_cells)
    progress.notebook_started(name, len(code_cells))
    session = None
    try:
        session = server.session(image=rec["image"], limits=limits or None,
                                 metadata={"eval": name, "notebook": os.path.basename(path)})
        rec["session_id"] = session.id
        base_dir = os.path.dirname(os.path.abspath(path))
        for target, source in (meta.get("inputs", {}) or {}).items():
            with open(os.path.join(base_dir, source), "rb") as f:
                session.put(target, f.read())
        if meta.get("workdir"):
            # One execution of the budget: the notebook reads paths relative to its directory.
            setup = session.run(f"import os as _os; _os.chdir({str(meta['workdir'])!r}); del _os",
                                store_history=False, raise_errors=False)
            if setup.error:
                raise CellblockError(f"workdir {meta['workdir']}: {setup.error.ename}: "
                                     f"{setup.error.evalue}")
        default_timeout = meta.get("timeout_s", opts.timeout)
        broken = None
        for i, cell in enumerate(code_cells):
            cmeta = cell.get("metadata", {}).get("cellblock", {}) or {}
            expect = cmeta.get("expect")
            source = _cell_source(cell)
            crec = {"index": i, "source": source, "expect": expect}
            t0 = time.monotonic()
            if broken:
                ex = None
                crec.update(outcome="closed", ename="ClientTimeout", evalue=broken, by_server=False)
                outputs = [{"output_type": "error", "ename": "ClientTimeout", "evalue": broken,
                            "traceback": [broken]}]
            else:
                try:
                    ex = session.run(source, timeout=cmeta.get("timeout_s", default_timeout),
                                     raise_errors=False)
                    outcome, ename = classify(ex)
                    crec.update(outcome=outcome, ename=ename,
                                evalue=ex.error.evalue if ex.error else None,
                                by_server=bool(ex.error and ex.error.by_server))
                    outputs = ex.outputs
                except ClientTimeout as e:
                    # The server never answered: nothing later in this session can be trusted.
                    ex = e.execution
                    broken = str(e)
                    crec.update(outcome="timeout", ename="ClientTimeout", evalue=str(e),
                                by_server=False)
                    outputs = (ex.outputs if ex else []) + [
                        {"output_type": "error", "ename": "ClientTimeout", "evalue": str(e),
                         "traceback": [str(e)]}]
            budget = ex.budget if ex is not None else {}
            crec.update(
                execution_count=ex.execution_count if ex is not None else None,
                duration_ms=round(1000 * (time.monotonic() - t0), 1),
                wall_ms=budget.get("wall_ms"), cpu_ms=budget.get("cpu_ms"),
                memory_peak_bytes=budget.get("memory_peak_bytes"),
                executions_left=budget.get("executions_left"),
                truncated=bool(budget.get("output_truncated")),
                text=output_text(outputs),
                mimes=sorted({m for o in outputs for m in o.get("data", {})}),
                outputs=outputs)
            crec["mismatches"] = check_expect(expect, crec)
            crec["passed"] = not crec["mismatches"]
            rec["peak_memory_bytes"] = max(rec["peak_memory_bytes"], crec["memory_peak_bytes"] or 0)
            rec["cells"].append(crec)
            cell.outputs = [nbformat.from_dict(o) for o in outputs]
            cell.execution_count = crec["execution_count"] if isinstance(
                crec["execution_count"], int) else None
            cell.metadata.setdefault("cellblock", {})["result"] = {
                k: crec[k] for k in ("outcome", "ename", "passed", "mismatches", "duration_ms",
                                     "wall_ms", "cpu_ms", "memory_peak_bytes", "executions_left",
                                     "truncated")}
            progress.cell_done(name, i, len(code_cells), crec)
        out_dir = os.path.join(opts.report, "files", name)
        for remote in meta.get("fetch", []) or []:
            entry = {"path": remote}
            try:
                data = session.get(remote)
                local = os.path.join(out_dir, remote.replace("/", "_"))
                os.makedirs(out_dir, exist_ok=True)
                with open(local, "wb") as f:
                    f.write(data)
                entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                             local=os.path.relpath(local, opts.report))
            except CellblockError as e:
                entry["error"] = str(e)
            rec["fetched"].append(entry)
        rec["cells_passed"] = sum(c["passed"] for c in rec["cells"])
        fetch_errors = [f for f in rec["fetched"] if "error" in f]
        rec["verdict"] = "pass" if rec["cells_passed"] == len(code_cells) and not fetch_errors \
            else "fail"
    except (CellblockError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if session is not None:
            try:
                session.close()
            except CellblockError:
                pass
    rec["as_declared"] = rec["verdict"] == rec["declared"]
    rec["duration_s"] = round(time.monotonic() - started, 3)
    nb.metadata.setdefault("cellblock", {})["eval"] = {
        k: rec[k] for k in ("verdict", "declared", "as_declared", "session_id", "cells_passed",
                            "cells_total", "duration_s", "error")}
    os.makedirs(os.path.join(opts.report, "notebooks"), exist_ok=True)
    nbformat.write(nb, os.path.join(opts.report, rec["executed"]))
    progress.notebook_done(rec)
    return rec


# ---------------------------------------------------------------- an embedded server

def collect_notebooks(items):
    paths = []
    for item in items:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                paths += [os.path.join(root, f) for f in sorted(files) if f.endswith(".ipynb")]
        else:
            paths.append(item)
    return paths


def parse_limits(items):
    limits = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"cellblock eval: --limit {item}: expected KEY=VALUE")
        try:
            limits[key] = json.loads(value)
        except ValueError:
            limits[key] = value
    return limits


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="cellblock eval",
        description="Run notebooks in fresh cellblock sessions and check what each cell declares.")
    parser.add_argument("notebooks", nargs="+", help="notebook files or directories (searched for *.ipynb)")
    parser.add_argument("--parallel", "-j", type=int, default=4, help="notebooks at once (default 4)")
    parser.add_argument("--image", help="image of every session (overrides the notebooks' own)")
    parser.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                        help="session limit (repeatable); a notebook's own limits take precedence")
    parser.add_argument("--timeout", type=float, help="per-cell timeout in seconds (default: the session's)")
    parser.add_argument("--report", default="cellblock-report", help="report directory (default ./cellblock-report)")
    parser.add_argument("--state-dir", help="state dir of the running server to use "
                        "(default $CELLBLOCK_STATE_DIR or /var/lib/cellblock)")
    parser.add_argument("--embedded", action="store_true",
                        help="always start a server of our own for this run (needs root)")
    parser.add_argument("--no-embedded", action="store_true",
                        help="fail when no server runs instead of starting one")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    opts = parser.parse_args(argv)
    if opts.parallel < 1:
        parser.error("--parallel must be at least 1")
    opts.limits = parse_limits(opts.limit)

    jobs, taken = [], set()
    for path in collect_notebooks(opts.notebooks):
        try:
            nb = nbformat.read(path, as_version=4)
        except (OSError, ValueError) as e:
            print(f"cellblock eval: cannot read {path}: {e}", file=sys.stderr)
            return 2
        jobs.append({"path": path, "name": _safe_name(path, taken), "nb": nb})
    if not jobs:
        print("cellblock eval: no notebooks found", file=sys.stderr)
        return 2
    os.makedirs(opts.report, exist_ok=True)

    embedded = None
    try:
        if opts.embedded:
            raise ServerNotFound("--embedded")
        server = cb.connect(state_dir=opts.state_dir)
    except ServerNotFound as e:
        if opts.no_embedded:
            print(f"cellblock eval: {e}", file=sys.stderr)
            return 2
        binary = find_binary()
        if not binary or os.geteuid() != 0:
            print(f"cellblock eval: {e}; starting a server of our own needs root and the cellblock "
                  f"binary (found: {binary})", file=sys.stderr)
            return 2
        embedded = EmbeddedServer(binary, opts.parallel, opts.image)
        try:
            server = embedded.start()
        except ServerNotFound as e2:
            print(f"cellblock eval: {e2}", file=sys.stderr)
            return 2
    started_at = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    total_cells = sum(1 for j in jobs for c in j["nb"].cells if c.cell_type == "code" and
                      "skip-eval" not in c.get("metadata", {}).get("tags", []))
    progress = Progress(len(jobs), total_cells, quiet=opts.quiet)
    if not opts.quiet:
        where = "an embedded server" if embedded else f"the server at {server.manager}"
        print(f"cellblock eval: {len(jobs)} notebooks, {total_cells} cells, {opts.parallel} at once, "
              f"on {where}", file=sys.stderr)
    try:
        server_info = server.info()
        with concurrent.futures.ThreadPoolExecutor(max_workers=opts.parallel) as pool:
            records = list(pool.map(lambda j: run_notebook(j, server, opts, progress), jobs))
    finally:
        progress.finish()
        server.close()
        if embedded:
            embedded.stop()
    notebooks_ok = sum(r["as_declared"] for r in records)
    report = {
        "cellblock_eval": 1,
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 3),
        "server": {"embedded": embedded is not None, "manager": server.manager,
                   "version": server_info.get("version")},
        "options": {"parallel": opts.parallel, "image": opts.image, "limits": opts.limits,
                    "timeout": opts.timeout},
        "summary": {"notebooks": len(records), "as_declared": notebooks_ok,
                    "not_as_declared": len(records) - notebooks_ok,
                    "cells": sum(r["cells_total"] for r in records),
                    "cells_as_declared": sum(r["cells_passed"] for r in records),
                    "verdicts": {v: sum(r["verdict"] == v for r in records)
                                 for v in ("pass", "fail", "error")}},
        "notebooks": records,
    }
    with open(os.path.join(opts.report, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=json_default)
    write_html(report, os.path.join(opts.report, "report.html"))
    if not opts.quiet:
        print(f"cellblock eval: {notebooks_ok}/{len(records)} notebooks as declared; "
              f"report: {os.path.join(opts.report, 'report.html')}", file=sys.stderr)
    return 0 if notebooks_ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
