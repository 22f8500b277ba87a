#!/usr/bin/env bash
# Runs every fuzz target for a while on its seed corpus.
#   tests/fuzz/run_fuzzers.sh BUILD_DIR SECONDS [TARGET...] [-- LIBFUZZER_ARGS...]
# New inputs go to BUILD_DIR/corpus/<target>, crashes to BUILD_DIR/artifacts,
# logs to BUILD_DIR/logs. Exits non-zero if any target finds a crash.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: run_fuzzers.sh BUILD_DIR SECONDS [TARGET...] [-- ARGS...]}" && pwd)
seconds=${2:?seconds per target}
shift 2
targets=()
while (($#)) && [[ $1 != -- ]]; do
  targets+=("$1")
  shift
done
[[ ${1:-} == -- ]] && shift
((${#targets[@]})) || targets=(wire connection_file limits image http_head zmtp packed)

mkdir -p "$build/artifacts" "$build/logs"
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
failed=()
# Where a log says why the run stopped.
report() {
  sed -n '/==ERROR\|runtime error\|FUZZ_CHECK\|deadly signal/,$p' "$1" | grep -v '^ *#1[0-9] ' |
    cut -c1-240 | head -n 30 >&2
}
for name in "${targets[@]}"; do
  # Saved reproducers first: each must pass once its bug is fixed.
  for reproducer in "$here"/crashes/"$name"-*; do
    [[ -e $reproducer ]] || continue
    if ! "$build/fuzz_$name" "$reproducer" >"$build/logs/$name-reproducer.log" 2>&1; then
      echo "fuzz_$name: saved reproducer $(basename "$reproducer") still fails:" >&2
      report "$build/logs/$name-reproducer.log"
      failed+=("$name (reproducer $(basename "$reproducer"))")
    fi
  done
  dict=$here/json.dict
  [[ $name == wire ]] && dict=$here/wire.dict
  [[ $name == http_head ]] && dict=$here/http.dict
  [[ $name == zmtp ]] && dict=$here/zmtp.dict
  [[ $name == packed ]] && dict=$here/wire.dict
  mkdir -p "$build/corpus/$name"
  log=$build/logs/$name.log
  echo "fuzz_$name: ${seconds}s"
  if "$build/fuzz_$name" "$build/corpus/$name" "$here/corpus/$name" \
      -dict="$dict" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$name-" "$@" >"$log" 2>&1; then
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$log" | tr '\n' ' '
    echo
  else
    echo "fuzz_$name FAILED ($log):" >&2
    report "$log"
    failed+=("$name")
  fi
done
if ((${#failed[@]})); then
  echo "fuzzing found crashes in: ${failed[*]} (reproducers in $build/artifacts)" >&2
  exit 1
fi
