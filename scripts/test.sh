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

# The fuzz targets and the ASan+UBSan tree build at the lowest CPU and I/O
# priority while the plain tests run: those wait on sandboxes, kernels and
# sockets far more than they compute, and the builds take the idle cores
# (14 of CI's 90 minutes when they ran alone). A compile or link error fails
# the run as soon as the plain tests are done.
phase "background: fuzz targets, then the ASan+UBSan build"
background_log="$root/build-background.log"
# setsid: the builds are a process group of their own, which the trap below
# ends whole if the run stops early (a failed plain test).
setsid nice -n 19 ionice -c 3 bash -c '
    set -euo pipefail
    root=$1
    source "$root/scripts/ccache.sh"
    cmake -S "$1/tests/fuzz" -B "$1/build-fuzz" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
      "${ccache_args[@]}" >/dev/null
    cmake --build "$1/build-fuzz" -j"$(nproc)"
    CELLBLOCK_SANITIZE=ON bash "$1/scripts/build.sh" "$1/build-asan"' _ "$root" \
  >"$background_log" 2>&1 &
background=$!
trap 'kill -- -$background 2>/dev/null || true' EXIT

# The unit tests run two at a time (each is its own process and a fraction of
# a second; one after the other, 629 of them took 70 s plain and 160 s under
# ASan); the integration suites one at a time, each judging only its own
# servers and sessions.
phase "unit tests"
ctest --test-dir "$root/build" --output-on-failure --timeout 900 -L unit -j2
phase "integration tests"
ctest --test-dir "$root/build" --output-on-failure --timeout 900 -LE unit

phase "waiting for the background builds"
if ! wait $background; then
  tail -n 80 "$background_log" >&2
  echo "the fuzz or ASan+UBSan build failed (log: $background_log)" >&2
  exit 1
fi
trap - EXIT

# The heavy tests (gigabyte files, hundreds of sessions; label "heavy") and
# those whose time goes to mmdebstrap, a browser or a Notebook server (label
# "once": image builds, frontends, the provisioner) ran in the plain pass
# above; under ASan they would take hours and drive no C++ the rest does not.
phase "ASan+UBSan tests (unit and integration, without the heavy and once-only ones)"
# The integration tests drive the sanitized cellblock through its own
# kernelspec in build-asan: a sanitizer report aborts the server and fails them.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$root/build-asan" --output-on-failure --timeout 1800 -L unit -j2
ctest --test-dir "$root/build-asan" --output-on-failure --timeout 1800 -LE 'unit|heavy|once'

phase "fuzz (short)"
bash tests/fuzz/run_fuzzers.sh "$root/build-fuzz" 10

phase "all tests passed"
