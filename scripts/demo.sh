#!/usr/bin/env bash
# The main job: sets everything up, builds cellblock, installs the
# cellblock-python kernelspec into the build tree, and runs a real session:
# a Jupyter client starts the sandboxed kernel and runs a short analysis.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/build.sh "$root/build"
"$root/build/bin/cellblock" kernelspec install --prefix "$root/build"
export JUPYTER_PATH="$root/build/share/jupyter"
exec /usr/bin/python3 "$root/scripts/demo_session.py" --out "$root/build/demo"
