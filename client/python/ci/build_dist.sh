#!/usr/bin/env bash
# Builds the logitserve Python sdist and wheel into DIST_DIR, offline: the sources are staged in
# STAGING_DIR laid out like the sdist (proto under protos/), so nothing lands in the source tree;
# `python3 -m build --no-isolation` makes the sdist (generated stubs included) and the wheel.
# With NATIVE_LIB (the build's liblogitserve_native.so) the wheel ships it as
# logitserve/_native/ and is tagged for this platform (py3-none-linux_x86_64); the sdist never
# carries it (built from source, the package sends through grpcio alone).
#   ci/build_dist.sh PYTHON3 STAGING_DIR DIST_DIR [NATIVE_LIB]
set -euo pipefail
PYTHON3="$1"; STAGE="$2"; DIST="$3"; NATIVE="${4:-}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
rm -rf "$STAGE" "$DIST"
mkdir -p "$STAGE/protos/logitserve/v1"
cp -r "$HERE/pyproject.toml" "$HERE/setup.py" "$HERE/README.md" "$HERE/MANIFEST.in" \
  "$HERE/logitserve" "$STAGE/"
rm -rf "$STAGE/logitserve/v1" "$STAGE/logitserve/__pycache__"
cp "$ROOT/proto/logitserve/v1/logitserve.proto" "$STAGE/protos/logitserve/v1/"
"$PYTHON3" -m build --no-isolation --sdist --outdir "$DIST" "$STAGE" >"$DIST.log" 2>&1 ||
  { cat "$DIST.log"; exit 1; }
if [ -n "$NATIVE" ]; then
  mkdir -p "$STAGE/logitserve/_native"
  cp "$NATIVE" "$STAGE/logitserve/_native/liblogitserve_native.so"
fi
"$PYTHON3" -m build --no-isolation --wheel --outdir "$DIST" "$STAGE" >>"$DIST.log" 2>&1 ||
  { cat "$DIST.log"; exit 1; }
ls "$DIST"/logitserve-*.whl "$DIST"/logitserve-*.tar.gz
