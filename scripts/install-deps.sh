#!/usr/bin/env bash
# Installs every Debian 12 package that logitserve's build, tests, benchmarks and demo need, then
# the npm packages of the third-party tooling checks (scripts/install-node-tools.sh; skip them with
# LOGITSERVE_NODE_TOOLS=0, as the container build does).
# Idempotent: packages already present are skipped quickly. Needs root (or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
NODE_TOOLS=${LOGITSERVE_NODE_TOOLS:-1}

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libssl-dev
  libhwy-dev libdnnl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-grpcio python3-protobuf python3-pytest python3-pip python3-venv python3-wheel
  python3-setuptools python3-build python3-yaml yamllint libopenblas0-pthread
  clang-14 clang-format-14 libclang-rt-14-dev libfuzzer-14-dev openssl curl
)
# Node.js and npm for tests/tooling (buf, grpc-js, kubernetes-models); a node that is already on
# PATH (e.g. from NodeSource) is used as it is.
if [ "$NODE_TOOLS" = 1 ] && ! { command -v node && command -v npm; } >/dev/null; then
  PACKAGES+=(nodejs npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ "$NODE_TOOLS" = 1 ] && [ -f scripts/install-node-tools.sh ]; then
  bash scripts/install-node-tools.sh
fi
