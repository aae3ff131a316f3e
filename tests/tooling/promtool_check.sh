#!/usr/bin/env bash
# `promtool check metrics` (Prometheus' own linter) over a live scrape of the real server, after
# one request so every family has samples. Exit 77 (ctest: skipped) without promtool (Debian:
# the `prometheus` package; not installed by install-deps.sh, which keeps CI lean: the strict
# exposition-format parser of tests/service/prometheus_text.h checks the same text in CI).
#   promtool_check.sh LOGITSERVE_BINARY LOGITSERVE_CLI_BINARY
set -euo pipefail
if ! command -v promtool >/dev/null; then
  echo "SKIPPED: promtool is not installed (Debian: apt-get install prometheus)"
  exit 77
fi
server="$1"; cli="$2"
out=$(mktemp); trap 'kill "$pid" 2>/dev/null || true; rm -f "$out"' EXIT
"$server" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --threads 1 \
  --synthetic-head policy:vocab=300,hidden=16,seed=1 >"$out" 2>/dev/null &
pid=$!
for _ in $(seq 300); do grep -q "listening on" "$out" && break; sleep 0.1; done
address=$(awk '/listening on/ {print $4}' "$out")
metrics=$(awk '/metrics on/ {print $4}' "$out")
"$cli" heads --target "$address" >/dev/null
body=$(curl -fsS "http://$metrics/metrics")
grep -q '^process_start_time_seconds ' <<<"$body"
grep -q '^logitserve_build_info{' <<<"$body"
promtool check metrics <<<"$body"
echo "promtool check metrics: clean ($(grep -c '^# TYPE' <<<"$body") families)"
