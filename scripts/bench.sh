#!/usr/bin/env bash
# The benchmark suite: sets up, builds, and runs bench/run.py (as root) with the
# arguments given, e.g. `sudo scripts/bench.sh --quick` or `--only step,rich`.
# Prints a Markdown table and writes bench/results/<UTC time>.md/.json and latest.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/build.sh "$root/build"
# Debian's interpreter: it has jupyter_client, pyzmq and ipykernel (another python3
# may come first on PATH).
exec /usr/bin/python3 "$root/bench/run.py" "$@"
