#!/usr/bin/env bash
# Installs the npm packages of the tooling checks (tests/tooling/package-lock.json: buf,
# @grpc/grpc-js, protobufjs, kubernetes-models) into tests/tooling/node_modules, exactly as locked.
# Skipped when that lock file is already installed. Needs node and npm (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/../tests/tooling"
stamp=node_modules/.installed-package-lock.json
if [ -f "$stamp" ] && cmp -s package-lock.json "$stamp"; then
  exit 0
fi
echo "install-node-tools: npm ci in tests/tooling"
npm ci --no-audit --no-fund --loglevel=error
cp package-lock.json "$stamp"
