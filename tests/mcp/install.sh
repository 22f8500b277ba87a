#!/usr/bin/env bash
# Installs the official MCP TypeScript SDK and the MCP Inspector, pinned by
# package-lock.json, into tests/mcp/node_modules for tests/python/test_mcp.py.
# Needs only the npm registry (no browser download: the Inspector's CLI mode
# is all the tests use). Idempotent: does nothing when the pinned versions are there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

if ! command -v npm >/dev/null; then
  # Debian's nodejs comes without npm (see tests/frontend/install.sh).
  echo "mcp/install.sh: installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm
fi

version() {  # $1: a JS expression for a version; "" when it throws
  node -p "try { $1 } catch { '' }"
}
up_to_date=1
for package in @modelcontextprotocol/sdk @modelcontextprotocol/inspector; do
  pinned=$(version "require('./package-lock.json').packages['node_modules/$package'].version")
  installed=$(version "require('./node_modules/$package/package.json').version")
  [[ -n "$pinned" && "$installed" == "$pinned" ]] || up_to_date=0
done
if [[ $up_to_date == 1 ]]; then
  echo "mcp/install.sh: @modelcontextprotocol/sdk and inspector present"
  exit 0
fi

echo "mcp/install.sh: npm ci (@modelcontextprotocol/sdk, @modelcontextprotocol/inspector)"
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
