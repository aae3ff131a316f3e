#!/usr/bin/env bash
# Service benchmarks against a fresh local server (docs/performance-history.md, "Service
# benchmarks"):
#   1. RPC overhead: logitserve-rpc-bench (Score vs a raw gRPC transfer of the same bytes);
#   2. batching off vs on: logitserve-bench, 32 concurrent small clients, one server per setting.
#
#   bench/rpc/run_service_bench.sh [BUILD_DIR | BIN_DIR]   (default: build)
# BIN_DIR: a folder holding the three binaries side by side (the device bundle's bin/; its lib/
# beside it goes on LD_LIBRARY_PATH).
# Settings (environment): BACKEND (cpu), HEAD_SPEC (synthetic head of the RPC-overhead run),
# ROWS (list for the overhead run), ITERS, SMALL_HEAD_SPEC (head of the batching run), CLIENTS (32),
# TOKENS (rows per small request, 16), DURATION (20s), BATCH_TOKENS (8192), QUEUE_DELAY_US (0),
# OUT (results folder, default ./service-bench). GPU machine, from the unpacked device bundle:
#   BACKEND=cuda HEAD_SPEC=policy:vocab=151936,hidden=4096,seed=1 ROWS=1024,8192 \
#   SMALL_HEAD_SPEC=policy:vocab=151936,hidden=4096,seed=1 CLIENTS=32 TOKENS=64 \
#   bash run_service_bench.sh /tmp/ls/bin
set -euo pipefail
BUILD="${1:-build}"
BACKEND="${BACKEND:-cpu}"
HEAD_SPEC="${HEAD_SPEC:-policy:vocab=256,hidden=4096,seed=1}"
ROWS="${ROWS:-256,1024,4096}"
ITERS="${ITERS:-15}"
SMALL_HEAD_SPEC="${SMALL_HEAD_SPEC:-policy:vocab=8192,hidden=1024,seed=1}"
CLIENTS="${CLIENTS:-32}"
TOKENS="${TOKENS:-16}"
DURATION="${DURATION:-20s}"
BATCH_TOKENS="${BATCH_TOKENS:-8192}"
QUEUE_DELAY_US="${QUEUE_DELAY_US:-0}"
OUT="${OUT:-$PWD/service-bench}"
if [[ -x "$BUILD/logitserve" ]]; then  # flat bundle layout
  SERVER="$BUILD/logitserve"
  RPC_BENCH="$BUILD/logitserve-rpc-bench"
  LOAD_BENCH="$BUILD/logitserve-bench"
  export LD_LIBRARY_PATH="$BUILD/../lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  export NCCL_NVLS_ENABLE=0
else
  SERVER="$BUILD/server/logitserve"
  RPC_BENCH="$BUILD/bench/rpc/logitserve-rpc-bench"
  LOAD_BENCH="$BUILD/bench/load/logitserve-bench"
fi
mkdir -p "$OUT"

PID=""
ADDR=""
start_server() {  # start_server LOG_NAME ARGS...
  local name="$1"
  shift
  "$SERVER" --listen 127.0.0.1:0 --backend "$BACKEND" --log-level warn "$@" \
    > "$OUT/$name.stdout" 2> "$OUT/$name.stderr" &
  PID=$!
  for _ in $(seq 3000); do  # up to 5 min: a large synthetic head takes a while to build
    ADDR="$(sed -n 's/^logitserve listening on //p' "$OUT/$name.stdout")"
    [[ -n "$ADDR" ]] && return 0
    kill -0 "$PID" 2> /dev/null || { cat "$OUT/$name.stderr"; return 1; }
    sleep 0.1
  done
  echo "server did not start" >&2
  return 1
}
stop_server() {
  kill -TERM "$PID"
  wait "$PID" || true
}
trap '[[ -n "$PID" ]] && kill "$PID" 2> /dev/null || true' EXIT

echo "== machine: $(nproc) cores, $(uptime)"
echo "== 1. RPC overhead ($BACKEND, $HEAD_SPEC)"
start_server rpc --synthetic-head "$HEAD_SPEC"
"$RPC_BENCH" --target "$ADDR" --head policy --rows "$ROWS" \
  --iters "$ITERS" --json "$OUT/rpc_overhead.json"
stop_server

echo "== 2. batching off vs on: $CLIENTS clients x $TOKENS rows ($BACKEND, $SMALL_HEAD_SPEC)"
for mode in off on; do
  if [[ "$mode" == off ]]; then batch=0; else batch="$BATCH_TOKENS"; fi
  start_server "batch_$mode" --synthetic-head "$SMALL_HEAD_SPEC" --max-batch-tokens "$batch" \
    --max-queue-delay-us "$QUEUE_DELAY_US"
  echo "-- batching $mode: --max-batch-tokens $batch --max-queue-delay-us $QUEUE_DELAY_US"
  "$LOAD_BENCH" --target "$ADDR" --head policy --concurrency "$CLIENTS" \
    --duration "$DURATION" --warmup 2s --tokens "$TOKENS" --entropy --quiet \
    --json "$OUT/batch_$mode.json"
  stop_server
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
off, on = (json.load(open(f"{out}/batch_{m}.json")) for m in ("off", "on"))
print(f"batching on/off: throughput x{on['rps'] / off['rps']:.2f} "
      f"({off['rps']:.0f} -> {on['rps']:.0f} req/s), p99 {off['latency_p99_ms']:.2f} -> "
      f"{on['latency_p99_ms']:.2f} ms")
PY
echo "== machine after: $(uptime)"
