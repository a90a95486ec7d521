#!/bin/sh
# Make sure the Node.js client (clients/node) can run for its tests (tests/test_node_client.py):
# `node` and `npm` (Debian's packages, installed with apt-get when we are root), then the
# client's packages from its package-lock.json (`npm ci`), again only when the lock changed.
set -e
cd "$(dirname "$0")/../clients/node"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing nodejs and npm (apt)..."
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null || true
  fi
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "ensure-node: no node/npm on PATH and cannot install them (needs root and apt-get)." >&2
    echo "  Install Node.js >= 18 and npm; the Node client tests are skipped without them (or fail under CI)." >&2
    exit 1
  fi
fi
if [ node_modules/.package-lock.json -nt package-lock.json ]; then exit 0; fi
npm ci --no-audit --no-fund --loglevel=error
