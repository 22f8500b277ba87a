"""cellblock's version is defined once, by CMakeLists.txt's project(): the
binary (`cellblock --version`, server_info), and the Python client's package
(`cellblock.__version__`, clients/python/pyproject.toml) must say the same."""
import os
import re
import subprocess
import sys

SOURCE = os.environ.get("CELLBLOCK_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SOURCE, "clients", "python"))
import cellblock  # noqa: E402


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        found = re.search(r"^project\(cellblock VERSION ([0-9.]+)", f.read(), re.M)
    assert found, "CMakeLists.txt names no project version"
    return found.group(1)


def test_the_binary_says_the_projects_version():
    out = subprocess.run([os.environ.get("CELLBLOCK_BIN", "cellblock"), "--version"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    assert out.strip() == f"cellblock {project_version()}"


def test_the_python_client_says_the_same():
    with open(os.path.join(SOURCE, "clients", "python", "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.M)
    assert declared and declared.group(1) == project_version()
    assert cellblock.__version__ == project_version()
