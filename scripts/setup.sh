#!/usr/bin/env bash
# Installs every Debian package cellblock's build, tests and default image need,
# when missing. Idempotent; needs root (apt-get, and runc sandboxes later).
set -euo pipefail

PACKAGES=(
  # build
  cmake ninja-build g++ pkg-config clang-format
  libzmq3-dev cppzmq-dev nlohmann-json3-dev uuid-dev libssl-dev
  libsqlitecpp-dev libsqlite3-dev libgtest-dev libcli11-dev libspdlog-dev libfmt-dev
  libseccomp-dev
  # a compiler cache: a rebuild of sources that barely changed (the next CI run,
  # another clone) takes objects from it instead of compiling (scripts/build.sh)
  ccache
  # the egress gateway's tests make their upstreams' certificates with the openssl tool
  openssl ca-certificates
  # fuzzing (tests/fuzz: clang's libFuzzer and sanitizer runtimes)
  clang libclang-rt-14-dev
  # sandbox runtimes (runsc: the gVisor tier, image host-gvisor)
  runc runsc
  # building declarative images (cellblock image build)
  mmdebstrap
  # the default image's kernel and data stack
  python3 python3-ipykernel python3-numpy python3-pandas python3-matplotlib fonts-dejavu-core
  # a hibernating session's portable snapshot (kernel-shim/cellblock_snapshot.py)
  python3-dill
  # what python-datasci preloads beyond them, so the host image can mirror its
  # preload (tests/python/test_datasci_preload.py, bench figure 11)
  python3-scipy python3-seaborn
  # clients and tests
  python3-jupyter-client python3-jupyter-kernel-test python3-nbclient python3-nbformat
  jupyter-console python3-pytest python3-zmq python3-pexpect tmux iproute2 procps
  # what the server syncs to the disk before it answers (test_adoption.py)
  strace
  # the Python client's install test (pip without an index or build isolation);
  # pip and requests in sessions, through the egress gateway (test_egress_packages.py)
  python3-pip python3-setuptools python3-requests
  # real frontends (tests/python/test_frontends.py): classic Notebook 6, nbconvert,
  # and headless Chromium driven by playwright-core (tests/frontend/install.sh)
  jupyter-notebook jupyter-nbconvert python3-nbconvert chromium nodejs
  # the Swarm backend's tests (tests/swarm: a private three-node swarm on this host)
  docker.io
  # serve --metrics is scraped by the real Prometheus, and linted by promtool (test_metrics.py)
  prometheus
)

if [[ $(id -u) -ne 0 ]]; then
  echo "setup.sh: run as root (it installs packages; cellblock needs root for runc)" >&2
  exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  echo "setup.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup.sh: all ${#PACKAGES[@]} packages present"
fi

# playwright-core from the npm registry (pinned; no browser download).
bash "$(dirname "$0")/../tests/frontend/install.sh"
# kubernetes-models and yaml from the npm registry (pinned): offline checks of deploy/kubernetes.
bash "$(dirname "$0")/../deploy/kubernetes/validate/install.sh"
# The MCP TypeScript SDK and Inspector from the npm registry (pinned): tests/python/test_mcp.py.
bash "$(dirname "$0")/../tests/mcp/install.sh"
