#!/usr/bin/env bash
# Installs playwright-core, pinned by package-lock.json, into
# tests/frontend/node_modules for tests/python/test_frontends.py (which drives
# Debian's /usr/bin/chromium: no browser download). Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../scripts/npm_pinned.sh" "$here" playwright-core
