#!/usr/bin/env bash
# Creates a venv (system site packages: Debian's grpcio, protobuf, numpy, pytest) in the build
# tree and pip-installs the logitserve package into it, offline. The package is built from a copy
# laid out like its sdist (proto under protos/), so no build files land in the source tree.
#   ci/install.sh PYTHON3 VENV_DIR STAGING_DIR
set -euo pipefail
PYTHON3="$1"; VENV="$2"; STAGE="$3"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON3" -m venv --system-site-packages "$VENV"
rm -rf "$STAGE"
mkdir -p "$STAGE/protos/logitserve/v1"
cp -r "$HERE/pyproject.toml" "$HERE/setup.py" "$HERE/README.md" "$HERE/MANIFEST.in" \
  "$HERE/logitserve" "$STAGE/"
rm -rf "$STAGE/logitserve/v1" "$STAGE/logitserve/__pycache__"
cp "$ROOT/proto/logitserve/v1/logitserve.proto" "$STAGE/protos/logitserve/v1/"
"$VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps --no-index \
  --force-reinstall "$STAGE"
cd "$VENV" && "$VENV/bin/python" -c "import logitserve, logitserve.v1.logitserve_pb2_grpc; print('installed', logitserve.__file__)"
