#!/usr/bin/env bash
# Builds logitserve with CUDA for Hopper (sm_90, Release) in build-cuda and collects a bundle that
# runs on the GPU test machine (see ../shared/DEVICE.md): .bundle/bin (server, GPU tests, kernel
# benchmark, run-gpu.sh), .bundle/lib (every shared library ldd lists, except glibc's, libstdc++,
# libgcc_s, libnccl: the GPU machine uses its own), .bundle/bench (the PyTorch baseline), and
# .bundle/pack/logitserve-bundle.tar.gz, the same tree gzipped to fit the device tool's 64 MiB
# transfer limit (libdnnl alone is 40 MB uncompressed).
#
# The CUDA toolkit's own libraries (cuBLASLt 540 MB, cuBLAS) are left out by default: the GPU
# machine has the same CUDA 13.0, and run-gpu.sh puts /usr/local/cuda/lib64 (or the pip wheel's
# nvidia/cublas/lib) on LD_LIBRARY_PATH. BUNDLE_CUDA_LIBS=1 copies them too. The CUDA runtime is
# linked statically.
#
#   scripts/device-bundle.sh                 configure, build, collect
#   JOBS=2 scripts/device-bundle.sh          parallel build jobs (default: nproc)
#   BUILD_DIR=build-cuda CUDA_ARCHS=90 ...   overrides
#
# On the GPU machine (carry .bundle/pack; files under $OUT come back), in two calls of < 10 min:
#   mkdir -p /tmp/ls && tar -xzf .bundle/pack/logitserve-bundle.tar.gz -C /tmp/ls &&
#     /tmp/ls/bin/run-gpu.sh tests sanitizer
#   (the same) ... /tmp/ls/bin/run-gpu.sh bench torch
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build-cuda}
CUDA_ARCHS=${CUDA_ARCHS:-90}
JOBS=${JOBS:-$(nproc)}
BUNDLE=$ROOT/.bundle

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA_ARGS:-} \
  -DLOGITSERVE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS"

# Targets: the server, the CLI, every GPU test, the CUDA benchmark (when bench/CMakeLists.txt adds
# bench/cuda).
available=$(cmake --build "$BUILD_DIR" --target help | sed -n 's/^\([A-Za-z0-9_.+-]*\): .*/\1/p')
wanted=(logitserve logitserve-cli cuda_kernels_test hidden_stats_test cuda_backend_test
        cuda_backend_conformance_test cuda_backend_edge_cases_test cuda_backend_determinism_test
        cuda_fault_test cuda_sticky_fault_test watchdog_test logitserve-kernel-bench
        cuda_server_fault_test cuda_server_test service_e2e_test serving_e2e_test
        load_head_e2e_test client_e2e_test client_shm_e2e_test client_shm_channel_e2e_test
        logitserve-bench logitserve-rpc-bench logitserve-wire-bench)
targets=()
for t in "${wanted[@]}"; do
  if grep -qx "$t" <<<"$available"; then targets+=("$t"); else echo "device-bundle: no target $t (skipped)"; fi
done
cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib" "$BUNDLE/bench" "$BUNDLE/pack"
for t in "${targets[@]}"; do
  # The newest file of that name: a build folder may still hold one from an older layout (the
  # server binary moved from server/service/ to server/).
  f=$(find "$BUILD_DIR" -type f -name "$t" -perm -u+x -printf '%T@ %p\n' | sort -nr | head -1 |
      cut -d' ' -f2-)
  [ -n "$f" ] || { echo "device-bundle: built $t but cannot find it" >&2; exit 1; }
  cp "$f" "$BUNDLE/bin/"
  strip --strip-unneeded "$BUNDLE/bin/$t"
done
cp bench/cuda/torch_baseline.py bench/cuda/triton_peer.py "$BUNDLE/bench/"
# The wire benchmarks (issue 12): the runner, the Python client's benchmark and the Python package
# with its generated stubs. The GPU machine's python3 has grpcio, protobuf and numpy but nothing
# can be installed there, so the package is not pip-installed: the wheel the build makes (stubs
# generated here by protoc, the native send path's library in logitserve/_native/, which links the
# gRPC C++ libraries bundled in lib/) is unpacked into python/, which run_wire_bench.sh puts on
# PYTHONPATH; bin/python-check.sh prints the versions there and whether the stubs import.
cp bench/rpc/run_wire_bench.sh bench/rpc/wire_bench.py bench/rpc/run_service_bench.sh bench/rpc/thread_cpu.py \
  "$BUNDLE/bench/"
bundle_python=/usr/bin/python3  # Debian's, with python3-build / -setuptools / -wheel (as CI)
[ -x "$bundle_python" ] || bundle_python=$(command -v python3)
cmake --build "$BUILD_DIR" -j"$JOBS" --target logitserve_python_native
native_lib=$(find "$BUILD_DIR/client/python" -maxdepth 1 -name liblogitserve_native.so | head -1)
if bash client/python/ci/build_dist.sh "$bundle_python" "$BUILD_DIR/bundle-python-stage" \
    "$BUILD_DIR/bundle-python-dist" "$native_lib" > "$BUILD_DIR/bundle-python.log" 2>&1; then
  mkdir -p "$BUNDLE/python"
  "$bundle_python" - "$BUILD_DIR"/bundle-python-dist/logitserve-*.whl \
      "$BUNDLE/python" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("logitserve/")]
for stub in ("logitserve/v1/logitserve_pb2.py", "logitserve/v1/logitserve_pb2_grpc.py"):
    if stub not in names:
        sys.exit("%s lacks %s" % (wheel, stub))
zipfile.ZipFile(wheel).extractall(out, names)
print("device-bundle: Python package from", wheel.rsplit("/", 1)[-1], "->", out)
PY
  PYTHONPATH="$BUNDLE/python" "$bundle_python" -B -c \
    'import logitserve, logitserve.v1.logitserve_pb2_grpc; print("device-bundle: python/ imports", logitserve.__version__)'
else
  cat "$BUILD_DIR/bundle-python.log"
  echo "device-bundle: could not build the Python package (wire_bench.py will not run)"
fi
cp bench/rpc/python-check.sh "$BUNDLE/bin/"

# Shared libraries: everything ldd resolves, minus the system's own C/C++ runtime and NCCL.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libmvec\.|libpthread\.|libdl\.|librt\.|libresolv\.|libutil\.|libanl\.|libnsl\.|libBrokenLocale\.|libnss_|libstdc\+\+\.|libgcc_s\.|libnccl\.)'
cuda_libs='^(libcublas|libcublasLt|libcudart)\.'
for bin in "$BUNDLE"/bin/* "$BUNDLE"/python/logitserve/_native/*.so; do
  ldd "$bin" >/dev/null 2>&1 || continue  # the scripts among them
  ldd "$bin" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  if [[ "$name" =~ $cuda_libs ]] && [ "${BUNDLE_CUDA_LIBS:-0}" != 1 ]; then continue; fi
  cp -L "$path" "$BUNDLE/lib/$name"
done

cat >"$BUNDLE/bin/run-gpu.sh" <<'EOF'
#!/usr/bin/env bash
# Runs logitserve's GPU checks on the GPU machine; logs go to $OUT (default ./gpu-logs), at most
# eight files (the device tool returns eight): summary.txt, tests.log, sanitizer.log, bench.log,
# kernel_bench.json, torch_baseline.json, nvidia-smi.txt.
#   run-gpu.sh [PHASE...]   phases: tests sanitizer e2e bench torch, or all (the default: every
#                           phase); and, only when named, ab and trace (below). e2e: the service's
#                           end-to-end suites against the real server on the CUDA backend, and
#                           the server under injected device faults.
# Each step has a time limit (STEP_TIMEOUT, default 240 s; TORCH_TIMEOUT 300 s). `tests sanitizer`
# and `bench torch` each take a few minutes; `all` may exceed a 10-minute call.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
if ! ldconfig -p | grep -q libcublasLt.so.13 && [ ! -e /usr/local/cuda/lib64/libcublasLt.so.13 ]; then
  wheel=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2>/dev/null || true)
  [ -n "$wheel" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel"
fi
export NCCL_NVLS_ENABLE=0
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
summary=$out/summary.txt
step() {  # step LOG NAME COMMAND...: appends to LOG; one line per step (+ failed tests) to summary
  local log=$1 name=$2; shift 2
  local t0=$SECONDS start rc result
  { echo; echo "===== $name: $*"; } >>"$log"
  start=$(wc -l <"$log")
  timeout "$STEP_TIMEOUT" "$@" >>"$log" 2>&1
  rc=$?
  result=$(tail -n +"$start" "$log" |
    grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test|#wrong total|ERROR SUMMARY|every GPU test is skipped' |
    sort -u | tr '\n' ' ' | cut -c1-160)
  printf '%-30s rc=%-3d %4ds  %s\n' "$name" "$rc" $((SECONDS - t0)) "$result" | tee -a "$summary"
  tail -n +"$start" "$log" | grep -E '^\[  FAILED  \] [A-Za-z]' | sort -u | head -20 |
    sed 's/^/      /' | tee -a "$summary"
  [ "$rc" = 124 ] && echo "      (timed out after ${STEP_TIMEOUT}s)" | tee -a "$summary"
  return 0
}
phases=" ${*:-all} "
want() { [[ $phases == *" all "* || $phases == *" $1 "* ]]; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
ldd "$here/bin/cuda_backend_test" >>"$out/nvidia-smi.txt" 2>&1 || true
if want tests; then
  # cuda_sticky_fault_test last: its sticky error is confined to its own process, but it is the
  # one test that deliberately faults the GPU.
  for t in watchdog_test cuda_kernels_test hidden_stats_test cuda_backend_test cuda_backend_conformance_test \
           cuda_backend_edge_cases_test cuda_backend_determinism_test cuda_fault_test \
           cuda_sticky_fault_test; do
    [ -x "$here/bin/$t" ] && step "$out/tests.log" "$t" "$here/bin/$t"
  done
fi
if want e2e; then
  export LOGITSERVE_SERVER_BINARY="$here/bin/logitserve" LOGITSERVE_EXPECT_GPU=1
  for t in cuda_server_fault_test cuda_server_test service_e2e_test serving_e2e_test \
           load_head_e2e_test client_e2e_test; do
    [ -x "$here/bin/$t" ] && step "$out/e2e.log" "$t" "$here/bin/$t"
  done
fi
if want sanitizer; then
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
        /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1 || true)
  if [ -n "$san" ]; then
    for tool in memcheck racecheck synccheck initcheck; do
      step "$out/sanitizer.log" "sanitizer-$tool" "$san" --tool "$tool" --error-exitcode 9 \
        "$here/bin/cuda_kernels_test"
    done
  else
    echo "compute-sanitizer not found" | tee -a "$summary"
  fi
fi
if want bench; then
  if [ -x "$here/bin/logitserve-kernel-bench" ]; then
    step "$out/bench.log" kernel-bench "$here/bin/logitserve-kernel-bench" --json "$out/kernel_bench.json"
  else
    echo "logitserve-kernel-bench not in the bundle" | tee -a "$summary"
  fi
fi
if want torch; then
  STEP_TIMEOUT=${TORCH_TIMEOUT:-300} step "$out/bench.log" torch-baseline \
    python3 "$here/bench/torch_baseline.py" --json "$out/torch_baseline.json"
fi
# ab: another build's kernel benchmark ($AB_BENCH, e.g. the previous main's) and this one's, run
# alternately AB_ROUNDS times (default 2) with AB_ARGS, into bench.log: a change's effect measured
# against the card's drift in the same call.
if [[ $phases == *" ab "* ]]; then
  if [ -x "${AB_BENCH:-}" ]; then
    read -r -a ab_args <<<"${AB_ARGS:---no-hidden --dtypes bf16,fp16 --iters 10}"
    for round in $(seq "${AB_ROUNDS:-2}"); do
      step "$out/bench.log" "ab-$round-A (AB_BENCH)" "$AB_BENCH" "${ab_args[@]}"
      step "$out/bench.log" "ab-$round-B (this build)" "$here/bin/logitserve-kernel-bench" \
        "${ab_args[@]}"
    done
  else
    echo "ab: AB_BENCH is not an executable" | tee -a "$summary"
  fi
fi
# trace: every TRACE_EVERY-th job of a logits-mode bench traced (LOGITSERVE_CUDA_TRACE: each
# stage's GPU and host times), into bench.log.
if [[ $phases == *" trace "* ]]; then
  LOGITSERVE_CUDA_TRACE=${TRACE_EVERY:-5} step "$out/bench.log" trace \
    "$here/bin/logitserve-kernel-bench" --no-hidden --dtypes bf16 --iters 3
fi
echo "logs in $out"
EOF
chmod +x "$BUNDLE/bin/run-gpu.sh"

tar -C "$BUNDLE" -czf "$BUNDLE/pack/logitserve-bundle.tar.gz" bin lib bench \
  $([ -d "$BUNDLE/python" ] && echo python)
echo "device-bundle: $(du -sh "$BUNDLE/bin" | cut -f1) bin, $(du -sh "$BUNDLE/lib" | cut -f1) lib;" \
     "packed $(du -h "$BUNDLE/pack/logitserve-bundle.tar.gz" | cut -f1) in .bundle/pack"
ls "$BUNDLE/bin" "$BUNDLE/lib"
