#!/usr/bin/env bash
# Usage: scripts/npm_pinned.sh DIR PACKAGE...
# Installs what DIR's package-lock.json pins into DIR/node_modules (`npm ci`),
# unless every PACKAGE named is already there at its pinned version. Needs
# only the npm registry; no install scripts run, no browser is downloaded.
# Used by scripts/setup.sh for the test clients (tests/frontend, tests/mcp)
# and the offline Kubernetes checks (deploy/kubernetes/validate).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(cd "$1" && pwd)
shift
cd "$dir"
name=${dir#"$root/"}

if ! command -v npm >/dev/null; then
  # Debian's nodejs comes without npm; NodeSource's nodejs carries its own
  # (and conflicts with Debian's npm package), so only install it when missing.
  echo "npm_pinned.sh: installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm
fi

version() {  # $1: a JS expression for a version; "" when it throws
  node -p "try { $1 } catch { '' }"
}
present=()
stale=()
for package in "$@"; do
  pinned=$(version "require('./package-lock.json').packages['node_modules/$package'].version")
  installed=$(version "require('./node_modules/$package/package.json').version")
  if [[ -n "$pinned" && "$installed" == "$pinned" ]]; then
    present+=("$package@$pinned")
  else
    stale+=("$package@${pinned:-?}")
  fi
done
if ((${#stale[@]} == 0)); then
  echo "npm_pinned.sh: $name: ${present[*]} present"
  exit 0
fi
echo "npm_pinned.sh: $name: npm ci (${stale[*]})"
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
