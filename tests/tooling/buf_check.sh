#!/usr/bin/env bash
# buf over the wire contract (buf.yaml at the repository root):
#   buf_check.sh lint       buf lint (STANDARD, exceptions documented in buf.yaml)
#   buf_check.sh breaking   buf breaking against the committed API image proto/logitserve-v1.binpb,
#                           and, so the check is known to bite, against a copy of proto/ with a
#                           field renumbered, which must fail.
# Refresh the image only when a breaking change is intended (a new major version):
#   tests/tooling/node_modules/.bin/buf build --exclude-source-info -o proto/logitserve-v1.binpb
# Exit 77 (ctest: skipped) when the npm tools are not installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
buf="$root/tests/tooling/node_modules/.bin/buf"
if [[ ! -x "$buf" ]]; then
  echo "SKIPPED: $buf missing (run scripts/install-deps.sh)"
  exit 77
fi
cd "$root"
case "${1:-}" in
  lint)
    "$buf" lint
    echo "buf lint: clean"
    ;;
  breaking)
    "$buf" breaking --against proto/logitserve-v1.binpb
    echo "buf breaking: no breaking change against proto/logitserve-v1.binpb"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    cp -r buf.yaml proto "$tmp/"
    # ScoreRequest.head moves from field 2 to field 99: a wire break buf must report.
    sed -i 's/^  string head = 2;$/  string head = 99;/' "$tmp/proto/logitserve/v1/logitserve.proto"
    grep -q "string head = 99;" "$tmp/proto/logitserve/v1/logitserve.proto"
    if (cd "$tmp" && "$buf" breaking --against "$root/proto/logitserve-v1.binpb") >"$tmp/out" 2>&1; then
      echo "FAIL: buf breaking accepted a renumbered field"
      exit 1
    fi
    grep -q "head" "$tmp/out" || { cat "$tmp/out"; echo "FAIL: unexpected buf output"; exit 1; }
    echo "buf breaking: a renumbered field is reported ($(head -1 "$tmp/out"))"
    ;;
  *)
    echo "usage: $0 lint|breaking" >&2
    exit 2
    ;;
esac
