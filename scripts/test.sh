#!/usr/bin/env bash
# Sets everything up and runs all tests: unit tests and the integration suite
# (real runc sandboxes, real jupyter_client, jupyter_kernel_test, nbclient),
# then the unit tests again under ASan+UBSan, then a clang-format check.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash scripts/setup.sh

echo "== build"
bash scripts/build.sh "$root/build"
echo "== tests (unit + integration)"
ctest --test-dir "$root/build" --output-on-failure --timeout 900

echo "== ASan+UBSan build and unit tests"
CELLBLOCK_SANITIZE=ON bash scripts/build.sh "$root/build-asan"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$root/build-asan" --output-on-failure -L unit

echo "== clang-format"
files=$(git ls-files '*.cpp' '*.hpp')
if ! clang-format --dry-run --Werror $files; then
  echo "clang-format: the files above need formatting (clang-format -i)" >&2
  exit 1
fi
echo "== all tests passed"
