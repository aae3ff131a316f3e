#!/usr/bin/env bash
# Runs every logitserve test: installs system packages, builds (CPU backend; the CUDA code too when
# a CUDA toolkit is present), then ctest. GPU tests skip themselves when no GPU is visible.
#   BUILD_DIR   build folder (default: build)
#   CTEST_ARGS  extra ctest arguments (e.g. "-L gpu" or "-R Conformance")
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release}
cmake --build "$BUILD_DIR" -j"$(nproc)"
cd "$BUILD_DIR"
# shellcheck disable=SC2086
ctest --output-on-failure -j"$(nproc)" ${CTEST_ARGS:-}
