#!/usr/bin/env bash
# Issue 12's wire benchmarks against a fresh local server (docs/PERFORMANCE.md, "The wire"):
#   1. logitserve-wire-bench (C++ client): compute-only vs end-to-end rate per request size, one
#      pipelined large request vs max(compute, transfer), shared-memory inputs vs compute;
#   2. wire_bench.py (Python client): the same, when the logitserve package imports.
#
#   bench/rpc/run_wire_bench.sh [BUILD_DIR | BIN_DIR]   (default: build)
# BIN_DIR: a folder holding logitserve and logitserve-wire-bench (the device bundle's bin/; its
# lib/ and python/ beside it go on LD_LIBRARY_PATH and PYTHONPATH).
# Settings (environment): PIPELINE_ARGS (e.g. "--pipeline-chunk-bytes 8388608 --pipeline-streams
# 4", passed to both benchmarks), BACKEND (cpu), HEAD_SPEC (policy:vocab=256,hidden=4096,seed=1), ROWS
# (64,256,1024,4096,8192), ITERS (5), RATE_SECONDS (2), SERVER_ARGS (extra server flags), PYTHON
# (python3), OUT (results folder, default ./wire-bench). GPU machine, from the unpacked bundle:
#   BACKEND=cuda HEAD_SPEC=policy:vocab=151936,hidden=4096,seed=1 \
#     bash /tmp/ls/bench/run_wire_bench.sh /tmp/ls/bin
set -euo pipefail
BUILD="${1:-build}"
BACKEND="${BACKEND:-cpu}"
HEAD_SPEC="${HEAD_SPEC:-policy:vocab=256,hidden=4096,seed=1}"
ROWS="${ROWS:-64,256,1024,4096,8192}"
ITERS="${ITERS:-5}"
RATE_SECONDS="${RATE_SECONDS:-2}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$PWD/wire-bench}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$BUILD/logitserve" ]]; then  # flat bundle layout
  SERVER="$BUILD/logitserve"
  BENCH="$BUILD/logitserve-wire-bench"
  export LD_LIBRARY_PATH="$BUILD/../lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  export PYTHONPATH="$BUILD/../python:${PYTHONPATH:-}"
  export NCCL_NVLS_ENABLE=0
else
  SERVER="$BUILD/server/logitserve"
  BENCH="$BUILD/bench/rpc/logitserve-wire-bench"
  if [[ -d "$BUILD/client/python/venv" ]]; then PYTHON="$BUILD/client/python/venv/bin/python"; fi
fi
PY_BENCH="$HERE/wire_bench.py"
mkdir -p "$OUT"
"$SERVER" --listen 127.0.0.1:0 --backend "$BACKEND" --log-level warn \
  --synthetic-head "$HEAD_SPEC" ${SERVER_ARGS:-} > "$OUT/server.stdout" 2> "$OUT/server.stderr" &
PID=$!
trap 'kill "$PID" 2> /dev/null || true' EXIT
ADDR=""
for _ in $(seq 3000); do  # up to 5 min: a large synthetic head takes a while to build
  ADDR="$(sed -n 's/^logitserve listening on //p' "$OUT/server.stdout")"
  [[ -n "$ADDR" ]] && break
  kill -0 "$PID" 2> /dev/null || { cat "$OUT/server.stderr"; exit 1; }
  sleep 0.1
done
[[ -n "$ADDR" ]] || { echo "server did not start" >&2; exit 1; }
echo "== machine: $(nproc) cores, $(uptime)"
echo "== 1. C++ client ($BACKEND, $HEAD_SPEC)"
rc=0
"$BENCH" --target "$ADDR" --rows "$ROWS" --iters "$ITERS" --rate-seconds "$RATE_SECONDS" \
  ${PIPELINE_ARGS:-} --json "$OUT/wire_cpp.json" || rc=$?
echo "== 2. Python client"
"$PYTHON" "$PY_BENCH" --target "$ADDR" --rows "$ROWS" --iters "$ITERS" \
  --rate-seconds "$RATE_SECONDS" --transfer-json "$OUT/wire_cpp.json" \
  ${PIPELINE_ARGS:-} --json "$OUT/wire_py.json" || rc=$?
echo "== machine after: $(uptime)"
kill -TERM "$PID"
wait "$PID" || true
exit "$rc"
