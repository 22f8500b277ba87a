#!/usr/bin/env bash
# Installs playwright-core, pinned by package-lock.json, into
# tests/frontend/node_modules for tests/python/test_frontends.py.
# Needs only the npm registry: no browser download, the tests drive Debian's
# /usr/bin/chromium. Idempotent: does nothing when the pinned version is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

if ! command -v npm >/dev/null; then
  # Debian's nodejs comes without npm; NodeSource's nodejs carries its own
  # (and conflicts with Debian's npm package), so only install it when missing.
  echo "frontend/install.sh: installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm
fi

pinned=$(node -p 'require("./package-lock.json").packages["node_modules/playwright-core"].version')
installed=$(node -p 'try { require("./node_modules/playwright-core/package.json").version } catch { "" }')
if [[ "$installed" == "$pinned" ]]; then
  echo "frontend/install.sh: playwright-core $pinned present"
  exit 0
fi

echo "frontend/install.sh: npm ci (playwright-core $pinned)"
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
