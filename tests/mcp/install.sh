#!/usr/bin/env bash
# Installs the official MCP TypeScript SDK and the MCP Inspector, pinned by
# package-lock.json, into tests/mcp/node_modules for tests/python/test_mcp.py
# (the Inspector's CLI mode only: no browser). Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../scripts/npm_pinned.sh" "$here" @modelcontextprotocol/sdk @modelcontextprotocol/inspector
