#!/usr/bin/env bash
# Builds and runs the libFuzzer targets (ctest label `fuzz`; tests/fuzz/CMakeLists.txt).
#
#   fuzz.sh build BUILD_DIR                 configure (once) and build tests/fuzz/project with clang
#   fuzz.sh run BUILD_DIR TARGET SECONDS    fuzz TARGET (score_request | safetensors) for SECONDS
#
# `run` starts from the checked-in seeds in tests/fuzz/corpus/TARGET (read only: new inputs go to
# a scratch directory) and exits non-zero on any crash, sanitizer report, leak, timeout or
# out-of-memory; the reproducer is kept as BUILD_DIR/artifacts/TARGET-crash-... and printed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cmd="${1:?usage: fuzz.sh build|run BUILD_DIR ...}"
build="${2:?BUILD_DIR missing}"

case "$cmd" in
  build)
    if [[ ! -f "$build/build.ninja" ]]; then
      launcher=()
      if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
      cmake -S "$here/project" -B "$build" -G Ninja \
        -DCMAKE_CXX_COMPILER="${LOGITSERVE_FUZZ_CXX:-clang++-14}" "${launcher[@]}"
    fi
    cmake --build "$build" -j "${LOGITSERVE_FUZZ_JOBS:-2}"
    ;;
  run)
    target="${3:?TARGET missing}"
    seconds="${4:?SECONDS missing}"
    binary="$build/${target}_fuzzer"
    [[ -x "$binary" ]] || { echo "fuzz.sh: no $binary (run 'fuzz.sh build' first)"; exit 2; }
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    mkdir -p "$build/artifacts"
    # -timeout: one input taking > 10 s is a hang; -rss_limit_mb: a runaway allocation fails.
    "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$target-" "$scratch" "$here/corpus/$target"
    ;;
  *)
    echo "fuzz.sh: unknown command '$cmd'" >&2
    exit 2
    ;;
esac
