#!/usr/bin/env bash
# logitserve demo: install dependencies, build the server and the CLI, start a CPU server with two
# synthetic heads (policy and reference), then check health, list the heads, make an 8-token
# input and score it (log-probs, entropy, forward/reverse KL, JSD, top-3), printing the table.
# The server is always stopped on exit (SIGTERM); any failure exits non-zero.
#
#   scripts/demo.sh            # from the repository root (or anywhere: it finds the root)
#   BUILD_DIR=build-demo scripts/demo.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${BUILD_DIR:-build}"
SERVER="$BUILD_DIR/server/logitserve"
CLI="$BUILD_DIR/client/cli/logitserve-cli"
START_TIMEOUT_S="${START_TIMEOUT_S:-120}"

step() { printf '\n==> %s\n' "$*"; }

step "installing dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh

step "configuring and building logitserve and logitserve-cli in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)" --target logitserve logitserve-cli

WORK="$(mktemp -d -t logitserve-demo.XXXXXX)"
SERVER_PID=""
cleanup() {
  local rc=$?
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "==> stopping the server (SIGTERM)"
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [[ $rc -ne 0 && -s "$WORK/server.log" ]]; then
    echo "---- last server log lines ----" >&2
    tail -n 20 "$WORK/server.log" >&2
  fi
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "starting the server (CPU backend, synthetic heads policy and reference: V=32000, H=1024)"
"$SERVER" --backend cpu \
  --synthetic-head policy:vocab=32000,hidden=1024,seed=1 \
  --synthetic-head reference:vocab=32000,hidden=1024,seed=2 \
  --listen 127.0.0.1:0 >"$WORK/server.out" 2>"$WORK/server.log" &
SERVER_PID=$!

ADDRESS=""
deadline=$((SECONDS + START_TIMEOUT_S))
while [[ -z "$ADDRESS" ]]; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    wait "$SERVER_PID" || true
    echo "demo: the server exited before listening" >&2
    exit 1
  fi
  if (( SECONDS >= deadline )); then
    echo "demo: the server did not report listening within ${START_TIMEOUT_S} s" >&2
    exit 1
  fi
  ADDRESS="$(sed -n 's/^logitserve listening on //p' "$WORK/server.out" | head -n 1)"
  [[ -n "$ADDRESS" ]] || sleep 0.1
done
echo "server pid $SERVER_PID listening on $ADDRESS"

step "logitserve-cli health"
"$CLI" health --target "$ADDRESS"

step "logitserve-cli heads"
"$CLI" heads --target "$ADDRESS"

step "logitserve-cli make-input: 8 tokens of random bf16 hidden states (+ reference hidden states)"
"$CLI" make-input --output "$WORK/input.safetensors" --rows 8 --hidden-size 1024 --vocab 32000 \
  --seed 7 --reference

step "logitserve-cli score (policy vs reference)"
"$CLI" score --target "$ADDRESS" --head policy --reference-head reference \
  --input "$WORK/input.safetensors" \
  --entropy --forward-kl --reverse-kl --jsd-beta 0.5 --top-k 3

step "demo finished"
