#!/usr/bin/env bash
# Installs kubernetes-models and yaml, pinned by package-lock.json, into
# deploy/kubernetes/validate/node_modules for run.sh (offline validation of
# the Kubernetes manifests). Needs only the npm registry; no cluster, no
# kubectl. Idempotent: does nothing when the pinned versions are there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

if ! command -v npm >/dev/null; then
  # Debian's nodejs comes without npm; NodeSource's nodejs carries its own
  # (and conflicts with Debian's npm package), so only install it when missing.
  echo "kubernetes/validate/install.sh: installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm
fi

version() {  # version of package $1 in the lock ($2 = lock) or in node_modules ($2 = installed)
  node -p "try { $([[ $2 == lock ]] \
    && echo "require('./package-lock.json').packages['node_modules/$1'].version" \
    || echo "require('./node_modules/$1/package.json').version") } catch { '' }"
}

missing=()
for pkg in kubernetes-models yaml; do
  pinned=$(version "$pkg" lock)
  [[ -n "$pinned" && "$(version "$pkg" installed)" == "$pinned" ]] || missing+=("$pkg@$pinned")
done
if ((${#missing[@]} == 0)); then
  echo "kubernetes/validate/install.sh: kubernetes-models $(version kubernetes-models lock), yaml $(version yaml lock) present"
  exit 0
fi

echo "kubernetes/validate/install.sh: npm ci (${missing[*]})"
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
