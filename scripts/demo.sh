#!/usr/bin/env bash
# The main job: sets everything up, builds cellblock, starts `cellblock serve`,
# and runs a real session through it the way an agent would, with the Python
# client (clients/python): create a session, upload a CSV, run the walkthrough
# notebook's cells (clean, aggregate, plot, write results), fetch the files
# byte-identical, show refusals and the budget, print the audit history, close
# the session. Then `cellblock eval` runs every notebook of notebooks/ as a
# test and writes build/demo/eval/report.html. Finally the server stops.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/build.sh "$root/build"
state=/run/cellblock-demo
out="$root/build/demo"
mkdir -p "$out"
"$root/build/bin/cellblock" serve --state-dir "$state" --pool host=1 2>"$out/server.log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do [[ -f $state/server.json ]] && break; sleep 0.1; done
[[ -f $state/server.json ]] || { cat "$out/server.log"; exit 1; }
/usr/bin/python3 "$root/scripts/demo_session.py" --state-dir "$state" --out "$out"
echo
echo "=== every notebook of notebooks/ as a test, each in a fresh session (cellblock eval)"
"$root/build/bin/cellblock" eval "$root/notebooks" --parallel 4 --state-dir "$state" --report "$out/eval"
echo
"$root/build/bin/cellblock" ls --all --state-dir "$state"
