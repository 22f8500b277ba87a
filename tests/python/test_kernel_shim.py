"""The kernel shim's own helpers (kernel-shim/cellblock_ipykernel.py) that a
forked kernel uses to start from its zygote's state without touching all of
it (docs/zygote.md, "What a fork's kernel does not touch"). Checked here on
the interpreter running the tests; test_zygote.py checks the same behaviour
in real forked sessions."""
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.environ.get("CELLBLOCK_SOURCE_DIR", "../.."), "kernel-shim"))
import cellblock_ipykernel as shim  # noqa: E402


@pytest.fixture
def fake_modules():
    added = []

    def add(name):
        sys.modules[name] = types.ModuleType(name)
        added.append(name)

    yield add
    for name in added:
        sys.modules.pop(name, None)


def test_the_modules_at_start_are_the_zygotes_and_those_imported_since(fake_modules):
    fake_modules("cb_shim_test_before")
    at_start = shim._ModulesAtStart()
    fake_modules("cb_shim_test_after_1")
    fake_modules("cb_shim_test_after_2")
    now = at_start.now()
    assert now == set(sys.modules)
    assert {"cb_shim_test_before", "cb_shim_test_after_1", "cb_shim_test_after_2"} <= now
    # Made from the zygote's set, not built anew from sys.modules.
    assert now is at_start.names


def test_the_modules_at_start_are_built_anew_when_one_of_the_zygotes_is_gone(fake_modules):
    fake_modules("cb_shim_test_gone")
    fake_modules("cb_shim_test_stays")
    at_start = shim._ModulesAtStart()
    del sys.modules["cb_shim_test_gone"]
    fake_modules("cb_shim_test_new")
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_gone" not in now and "cb_shim_test_new" in now
    assert now is not at_start.names


def test_the_modules_at_start_are_built_anew_when_the_zygotes_last_is_gone(fake_modules):
    fake_modules("cb_shim_test_last")
    at_start = shim._ModulesAtStart()
    assert at_start.last == "cb_shim_test_last"
    fake_modules("cb_shim_test_since")
    del sys.modules["cb_shim_test_last"]
    fake_modules("cb_shim_test_last")  # back, at the end: after one added since
    now = at_start.now()
    assert now == set(sys.modules)
    assert "cb_shim_test_since" in now


def test_only_the_finders_of_the_homes_import_path_entries_are_forgotten(tmp_path, monkeypatch):
    home = str(tmp_path / "home")
    packages = os.path.join(home, ".local", "packages")
    elsewhere = str(tmp_path / "elsewhere")
    missing = str(tmp_path / "missing")
    not_on_path = os.path.join(home, "not-on-path")
    monkeypatch.setattr(sys, "path", [packages, elsewhere, missing, *sys.path])
    cache = dict(sys.path_importer_cache)
    monkeypatch.setattr(sys, "path_importer_cache", cache)
    marker = object()
    cache.update({packages: marker, elsewhere: marker, missing: None, home: marker,
                  not_on_path: marker})
    shim._forget_finders_under(home)
    assert packages not in cache and missing not in cache and home not in cache
    assert cache[elsewhere] is marker
    # Not on the import path: not looked at (a package's own dir, say).
    assert cache[not_on_path] is marker
