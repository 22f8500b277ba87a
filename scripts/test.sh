#!/usr/bin/env bash
# Sets everything up and runs all tests: unit tests and the integration suite
# (real runc sandboxes, real jupyter_client, jupyter_kernel_test, nbclient),
# after a clang-format check; then the whole suite again under ASan+UBSan, and a short
# run of the libFuzzer targets (tests/fuzz, built with clang into build-fuzz).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Each phase prints the time since the start: CI stops the run at 90 minutes,
# and the log then shows where the time went.
phase() { printf '== %s (at %dm%02ds)\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

phase setup
bash scripts/setup.sh

# Formatting first: a file clang-format would change fails the run in
# seconds, not after an hour of tests.
phase clang-format
files=$(git ls-files '*.cpp' '*.hpp')
if ! clang-format --dry-run --Werror $files; then
  echo "clang-format: the files above need formatting (clang-format -i)" >&2
  exit 1
fi

phase build
bash scripts/build.sh "$root/build"
# The fuzz targets are built now, so a compile or link error shows in the first
# minutes rather than after both test passes; they run at the end.
phase "build fuzz targets"
cmake -S "$root/tests/fuzz" -B "$root/build-fuzz" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$root/build-fuzz" -j"$(nproc)"
phase "tests (unit + integration)"
ctest --test-dir "$root/build" --output-on-failure --timeout 900

# The heavy tests (gigabyte files, hundreds of sessions; label "heavy") and
# those whose time goes to mmdebstrap, a browser or a Notebook server (label
# "once": image builds, frontends, the provisioner) ran in the plain pass
# above; under ASan they would take hours and drive no C++ the rest does not.
phase "ASan+UBSan build"
CELLBLOCK_SANITIZE=ON bash scripts/build.sh "$root/build-asan"
phase "ASan+UBSan tests (unit and integration, without the heavy and once-only ones)"
# The integration tests drive the sanitized cellblock through its own
# kernelspec in build-asan: a sanitizer report aborts the server and fails them.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$root/build-asan" --output-on-failure --timeout 1800 --label-exclude 'heavy|once'

phase "fuzz (short)"
bash tests/fuzz/run_fuzzers.sh "$root/build-fuzz" 10

phase "all tests passed"
