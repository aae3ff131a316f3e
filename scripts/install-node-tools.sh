#!/usr/bin/env bash
# Installs the npm packages of the tooling checks (tests/tooling/package-lock.json: buf,
# @grpc/grpc-js, protobufjs, kubernetes-models) into tests/tooling/node_modules, exactly as locked.
# Skipped when that lock file is already installed. Needs node and npm (scripts/install-deps.sh).
# Without the npm registry (offline, or a TLS-intercepting proxy whose CA npm does not trust:
# set NODE_EXTRA_CA_CERTS) it warns and returns 0: the build and every other test need none of
# these, and the checks that do report SKIPPED (never passed) until the tools are installed.
set -euo pipefail
cd "$(dirname "$0")/../tests/tooling"
stamp=node_modules/.installed-package-lock.json
if [ -f "$stamp" ] && cmp -s package-lock.json "$stamp"; then
  exit 0
fi
echo "install-node-tools: npm ci in tests/tooling"
if ! npm ci --no-audit --no-fund --loglevel=error; then
  rm -rf node_modules
  echo "install-node-tools: WARNING: npm ci failed (registry unreachable?); the tooling checks" \
    "(buf, grpc-js reflection, Kubernetes schemas) will be SKIPPED" >&2
  exit 0
fi
cp package-lock.json "$stamp"
