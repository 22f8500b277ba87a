#!/usr/bin/env bash
# Configures and builds cellblock into build/ (or $1), Release-with-debug-info.
# Pass CELLBLOCK_SANITIZE=ON in the environment for an ASan+UBSan build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCELLBLOCK_SANITIZE="${CELLBLOCK_SANITIZE:-OFF}" >/dev/null
cmake --build "$build" -j"$(nproc)"
