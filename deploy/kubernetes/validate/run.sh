#!/usr/bin/env bash
# Validates deploy/kubernetes offline (no API server, no kubelet: the
# manifests are checked against the Kubernetes schemas and cellblock's rules,
# never applied), then shows that the validator refuses each fixture of
# broken/ for exactly the reasons its `# expect:` lines declare: every
# declared reason appears, and no other. Needs install.sh first.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

if [[ ! -f node_modules/kubernetes-models/package.json || ! -f node_modules/yaml/package.json ]]; then
  echo "kubernetes/validate/run.sh: node_modules is missing: run deploy/kubernetes/validate/install.sh" \
    "(scripts/setup.sh does)" >&2
  exit 2
fi

passed=0
failed=0
fail() {
  echo "FAIL: $*"
  failed=$((failed + 1))
}

echo "== the manifests of deploy/kubernetes"
if node validate.mjs; then
  passed=$((passed + 1))
else
  fail "deploy/kubernetes does not validate (above)"
fi

echo "== each broken fixture is refused, for exactly its declared reasons"
for fixture in broken/*.yaml; do
  mapfile -t expects < <(sed -n 's/^# expect: //p' "$fixture")
  if ((${#expects[@]} == 0)); then
    fail "$fixture declares no '# expect:' line"
    continue
  fi
  rc=0
  out=$(node validate.mjs --with "$fixture" 2>&1) || rc=$?
  if ((rc != 1)); then
    fail "$fixture: validate.mjs exited $rc, not 1 (refused)"
    sed 's/^/    /' <<<"$out"
    continue
  fi
  problems=$(grep -v '^refused: ' <<<"$out" || true)
  bad=0
  for expect in "${expects[@]}"; do
    if ! grep -qF -- "$expect" <<<"$problems"; then
      fail "$fixture: not refused for: $expect"
      bad=1
    fi
  done
  while IFS= read -r line; do
    declared=0
    for expect in "${expects[@]}"; do
      [[ "$line" == *"$expect"* ]] && declared=1 && break
    done
    if ((!declared)); then
      fail "$fixture: refused for a reason it does not declare: $line"
      bad=1
    fi
  done <<<"$problems"
  if ((bad)); then
    sed 's/^/    /' <<<"$out"
  else
    echo "ok: $fixture refused ($(wc -l <<<"$problems") problem(s), as declared)"
    passed=$((passed + 1))
  fi
done

echo "$passed passed, $failed failed"
((failed == 0))
