#!/usr/bin/env bash
# Installs kubernetes-models and yaml, pinned by package-lock.json, into
# deploy/kubernetes/validate/node_modules for run.sh (offline validation of
# the Kubernetes manifests; no cluster, no kubectl). Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../../scripts/npm_pinned.sh" "$here" kubernetes-models yaml
