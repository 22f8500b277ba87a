"""One catalogue of enames (include/cellblock/error_names.hpp, printed by
`cellblock errors --json`): the Python client's classes, docs/manager-api.md
and every ename literal left in the C++ sources must agree with it."""
import glob
import json
import os
import re
import subprocess
import sys

SOURCE = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SOURCE, "clients", "python"))
from cellblock import errors  # noqa: E402


def catalogue():
    out = subprocess.run([os.environ.get("CELLBLOCK_BIN", "cellblock"), "errors", "--json"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {e["ename"]: e for e in json.loads(out)}


def test_the_python_client_has_a_class_for_each_name_and_no_other():
    names = catalogue()
    assert set(errors._BY_NAME) == set(names), (
        f"only in the client: {sorted(set(errors._BY_NAME) - set(names))}; "
        f"only in the server: {sorted(set(names) - set(errors._BY_NAME))}")
    on_session = {n for n, e in names.items() if e["channel"] in ("session", "both")}
    assert set(errors.POLICY_ENAMES) == on_session


def test_the_docs_list_each_name():
    names = catalogue()
    with open(os.path.join(SOURCE, "docs", "manager-api.md")) as f:
        doc = f.read()
    section = doc.split("## Error names", 1)
    assert len(section) == 2, "docs/manager-api.md has no '## Error names' section"
    listed = set(re.findall(r"^\| `(\w+)` \|", section[1], re.M))
    assert listed == set(names), (sorted(listed - set(names)), sorted(set(names) - listed))


def test_every_ename_literal_in_the_sources_is_in_the_catalogue():
    names = catalogue()
    pattern = re.compile(r'(?:RequestError\{|refuse\([^,]*,\s*|PolicyError\(|fail_pending\(|'
                         r'finish_execution\("\w+",\s*|\{"ename",\s*)"([A-Z]\w+)"')
    found = {}
    for path in glob.glob(os.path.join(SOURCE, "server", "*.cpp")) + \
            glob.glob(os.path.join(SOURCE, "sessions", "*.cpp")):
        with open(path) as f:
            for name in pattern.findall(f.read()):
                found.setdefault(name, os.path.relpath(path, SOURCE))
    unknown = {n: p for n, p in found.items() if n not in names}
    assert not unknown, f"enames sent but not in error_names.hpp: {unknown}"
