#!/usr/bin/env bash
# Builds the logitserve container image (Dockerfile) with docker, podman or buildah.
#
#   scripts/build-image.sh [--cpu | --cuda] [--tag TAG] [--build-image IMAGE]
#                          [--runtime-image IMAGE] [--engine docker|podman|buildah] [-- ENGINE_ARGS]
#
#   --cpu / --cuda     CPU-only image (LOGITSERVE_CUDA=OFF) or the GPU image (default)
#   --tag              image name (default logitserve:cpu or logitserve:cuda)
#   --build-image      base of the build stage (default debian:12), e.g. a mirror or an image
#   --runtime-image    base of the runtime stage (default debian:12-slim)   imported from a tarball
#   --engine           default: docker (when its daemon answers), else podman, else buildah
#                      ($ENGINE also works)
#   after --            passed to the engine's build command (e.g. --build-arg CUDA_ARCHS="80;90")
#
# podman and buildah build with --isolation=chroot and the host network: that works as root where
# user namespaces and nested network setup are not available (CI runners, containers); override
# with ISOLATION=oci. The image reports the source commit (`logitserve --version`) from
# `git describe`, since .git is not in the build context.
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=ON
tag=""
build_image=debian:12
runtime_image=debian:12-slim
engine=${ENGINE:-}
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) cuda=OFF ;;
    --cuda) cuda=ON ;;
    --tag) tag="$2"; shift ;;
    --build-image) build_image="$2"; shift ;;
    --runtime-image) runtime_image="$2"; shift ;;
    --engine) engine="$2"; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z $engine ]]; then
  # docker only with a reachable daemon (its CLI alone cannot build); podman / buildah need none.
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
  else
    for candidate in podman buildah; do
      if command -v "$candidate" >/dev/null; then engine=$candidate; break; fi
    done
  fi
fi
if [[ -z $engine ]] || ! command -v "$engine" >/dev/null; then
  echo "build-image: no container engine found (install docker, podman or buildah)" >&2
  exit 3
fi
[[ -n $tag ]] || tag="logitserve:$([[ $cuda == ON ]] && echo cuda || echo cpu)"
commit=$(git describe --always --dirty --abbrev=12 --exclude '*' 2>/dev/null || echo unknown)

args=(--build-arg "LOGITSERVE_CUDA=$cuda" --build-arg "BUILD_IMAGE=$build_image"
      --build-arg "RUNTIME_IMAGE=$runtime_image" --build-arg "GIT_COMMIT=$commit"
      -t "$tag" -f Dockerfile)
case "$engine" in
  docker) cmd=(docker build) ;;
  podman) cmd=(podman build --isolation="${ISOLATION:-chroot}" --network host) ;;
  buildah) cmd=(buildah build --isolation="${ISOLATION:-chroot}" --network host) ;;
  *) echo "build-image: unsupported engine '$engine'" >&2; exit 2 ;;
esac
echo "build-image: ${cmd[*]} ${args[*]} ${extra[*]} ." >&2
"${cmd[@]}" "${args[@]}" "${extra[@]}" .
echo "build-image: built $tag (commit $commit) with $engine" >&2
