# syntax=docker/dockerfile:1
# logitserve container image: a build stage and a slim runtime stage, both Debian 12 (bookworm).
#
# Why Debian 12 and not NVIDIA's nvidia/cuda images: CI builds on Debian 12 with
# scripts/install-deps.sh, which installs Debian 12 packages by name (gRPC 1.51, protobuf, abseil,
# highway, oneDNN, ...). NVIDIA publishes its CUDA images for Ubuntu, RHEL-family and UBI only,
# where those names and versions differ. So the image starts from Debian 12 and adds the CUDA 13 toolkit
# from NVIDIA's own Debian 12 apt repository: the build runs the very script and CMake configure CI
# uses, and the runtime stage installs the exact Debian and NVIDIA packages the binaries link to.
#
#   Any engine (docker, podman, buildah), base images overridable: scripts/build-image.sh --help
#   GPU image:  docker build -t logitserve:cuda .
#   CPU image:  docker build --build-arg LOGITSERVE_CUDA=OFF -t logitserve:cpu .
#   Other GPUs: --build-arg CUDA_ARCHS="80;90"  (CMAKE_CUDA_ARCHITECTURES)
#   Run CI's tests in the build: --build-arg RUN_TESTS=1 (all but the `gpu` label, no GPU in a
#   build, and `deploy`, which checks Dockerfile and deploy/ that .dockerignore leaves out)
# See docs/operations.md for run commands and Kubernetes deployment.

ARG BUILD_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12-slim

# ---------------------------------------------------------------------------------------------
FROM ${BUILD_IMAGE} AS build
# ON: the CUDA backend (needs the toolkit below); OFF: CPU backend only.
ARG LOGITSERVE_CUDA=ON
ARG CUDA_ARCHS=90
# NVIDIA's Debian 12 repository and package names (suffix = CUDA major-minor).
ARG CUDA_REPO=https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64
ARG CUDA_KEYRING=cuda-keyring_1.1-1_all.deb
ARG CUDA_PKG_SUFFIX=13-0
ARG CUDA_HOME=/usr/local/cuda-13.0
# Optional NCCL pin, e.g. "=2.27.7-1+cuda13.0"; empty = the newest in the repository.
ARG NCCL_PIN=
# NVIDIA packages of the build (nvcc, cudart, CCCL; cuBLAS(Lt); NCCL). The whole toolkit also
# works: --build-arg CUDA_BUILD_PACKAGES="cuda-toolkit-13-0 libnccl-dev".
ARG CUDA_BUILD_PACKAGES="cuda-minimal-build-${CUDA_PKG_SUFFIX} libcublas-dev-${CUDA_PKG_SUFFIX} libnccl2${NCCL_PIN} libnccl-dev${NCCL_PIN}"
ARG RUN_TESTS=0
ARG BUILD_JOBS=0
# The commit `logitserve --version` reports (.git is not in the build context);
# scripts/build-image.sh passes `git describe`.
ARG GIT_COMMIT=unknown
ENV DEBIAN_FRONTEND=noninteractive
# The npm tools of CI's tooling checks (tests/tooling) are not needed to build the image.
ENV LOGITSERVE_NODE_TOOLS=0

# 1. The CUDA toolkit from NVIDIA's Debian 12 repository (GPU build only).
RUN set -eux; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends ca-certificates curl; \
    mkdir -p /out/pkg; \
    if [ "$LOGITSERVE_CUDA" = ON ]; then \
      curl -fsSL -o /out/pkg/cuda-keyring.deb "$CUDA_REPO/$CUDA_KEYRING"; \
      dpkg -i /out/pkg/cuda-keyring.deb; \
      apt-get update -qq; \
      apt-get install -y -qq --no-install-recommends $CUDA_BUILD_PACKAGES; \
      test -x "$CUDA_HOME/bin/nvcc"; \
    fi; \
    rm -rf /var/lib/apt/lists/*

# 2. Every Debian package CI installs: the same script.
COPY scripts/install-deps.sh /src/scripts/install-deps.sh
RUN bash /src/scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*

# 3. The same CMake configure and build as scripts/test.sh (plus the CUDA switches).
COPY . /src
WORKDIR /src
RUN set -eux; \
    jobs="$BUILD_JOBS"; [ "$jobs" != 0 ] || jobs=$(nproc); \
    cuda_flags="-DLOGITSERVE_ENABLE_CUDA=OFF"; \
    if [ "$LOGITSERVE_CUDA" = ON ]; then \
      cuda_flags="-DLOGITSERVE_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER=$CUDA_HOME/bin/nvcc \
        -DCUDAToolkit_ROOT=$CUDA_HOME -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS"; \
    fi; \
    cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release $cuda_flags \
      -DLOGITSERVE_GIT_COMMIT="$GIT_COMMIT"; \
    if [ "$RUN_TESTS" = 1 ]; then \
      BUILD_DIR=/build CTEST_ARGS="-LE gpu|deploy" bash scripts/test.sh; \
    else \
      cmake --build /build -j"$jobs" --target logitserve logitserve-cli; \
    fi

# 4. Collect the binaries, and the packages that own every shared library they load, for the
#    runtime stage to install: Debian's by name (ABI-stable within Debian 12; the runtime gets
#    the current security updates), NVIDIA's pinned to the exact versions built against.
RUN set -eux; \
    mkdir -p /out/bin; \
    cp /build/server/logitserve /build/client/cli/logitserve-cli /out/bin/; \
    strip --strip-unneeded /out/bin/*; \
    export LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib"; \
    if ldd /out/bin/* | grep -q 'not found'; then ldd /out/bin/*; exit 1; fi; \
    for lib in $(ldd /out/bin/* | awk '/=> \// {print $3}' | sort -u); do \
      real="$(readlink -f "$(dirname "$lib")")/$(basename "$lib")"; \
      pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || \
            dpkg -S "/usr$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true); \
      pkg=$(printf '%s\n' "$pkg" | head -1 | cut -d: -f1); \
      if [ -z "$pkg" ]; then echo "no Debian package owns $lib" >&2; exit 1; fi; \
      case "$pkg" in \
        cuda-*|libcublas*|libnccl*) dpkg-query -W -f='${Package}=${Version}\n' "$pkg" ;; \
        *) echo "$pkg" ;; \
      esac; \
    done | sort -u > /out/pkg/runtime-packages.txt; \
    cat /out/pkg/runtime-packages.txt

# ---------------------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime
ARG CUDA_HOME=/usr/local/cuda-13.0
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/pkg/ /tmp/pkg/
RUN set -eux; \
    apt-get update -qq; \
    if [ -f /tmp/pkg/cuda-keyring.deb ]; then \
      apt-get install -y -qq --no-install-recommends ca-certificates; \
      dpkg -i /tmp/pkg/cuda-keyring.deb; \
      apt-get update -qq; \
    fi; \
    xargs -a /tmp/pkg/runtime-packages.txt \
      apt-get install -y -qq --no-install-recommends; \
    rm -rf /var/lib/apt/lists/* /tmp/pkg; \
    useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin logitserve
COPY --from=build /out/bin/logitserve /out/bin/logitserve-cli /usr/local/bin/

# The NVIDIA container runtime mounts the driver (libcuda, libnvidia-ml) when these are set; the
# CPU image ignores them. cuBLAS from NVIDIA's packages lives under CUDA_HOME.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=${CUDA_HOME}/lib64:${CUDA_HOME}/targets/x86_64-linux/lib
# Fail the build, not the first start, when a library is missing.
RUN if ldd /usr/local/bin/logitserve /usr/local/bin/logitserve-cli | grep 'not found'; then \
      exit 1; \
    fi

USER 10001:10001
EXPOSE 50051
# Liveness for plain `docker run` (Kubernetes uses its own gRPC probes, see deploy/k8s). A server
# started with TLS needs `--tls --tls-ca-file ...` here; see docs/operations.md.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/usr/local/bin/logitserve-cli", "health", "--target", "127.0.0.1:50051", \
       "--timeout", "3", "--attempts", "1"]
# Listens on every interface; give heads (and other flags) as arguments, e.g.
#   docker run --gpus all -p 50051:50051 -v /srv/heads:/heads:ro IMAGE \
#     --head policy=/heads/policy.safetensors:lm_head.weight
ENTRYPOINT ["/usr/local/bin/logitserve", "--listen", "0.0.0.0:50051"]
CMD []
