#!/usr/bin/env bash
# Fails (naming each file and showing its diff) when any C++ / CUDA source of the project is not
# clang-format clean under the repository's .clang-format. Sources: *.h *.cc *.cu *.cuh under
# the project's own folders; never node_modules, build trees or generated code (protoc output
# lives in the build tree). Exit 77 (ctest: skipped) when clang-format-14 is not installed:
# another clang-format major version formats differently.
#   check_format.sh SOURCE_DIR [CLANG_FORMAT]
# Fix: clang-format -i $(tests/lint/check_format.sh SOURCE_DIR --list)
set -euo pipefail
src=${1:?source dir}
fmt=${2:-}
list_only=0
if [[ "$fmt" == "--list" ]]; then list_only=1; fmt=""; fi
if [[ -z "$fmt" || ! -x "$fmt" ]]; then fmt=$(command -v clang-format-14 || true); fi
if [[ -z "$fmt" ]]; then
  echo "clang-format-14 not found: skipped (scripts/install-deps.sh installs it)"
  exit 77
fi
cd "$src"
mapfile -t files < <(find bench client common kernels proto server tests \
  -type d \( -name node_modules -o -name 'build*' -o -name gen -o -name corpus \) -prune -o \
  -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print | sort)
bad=0
for f in "${files[@]}"; do
  if ! "$fmt" --style=file "$f" | cmp -s - "$f"; then
    bad=$((bad + 1))
    if ((list_only)); then
      echo "$f"
    else
      echo "not clang-format clean: $f"
      "$fmt" --style=file "$f" | diff -u "$f" - | head -40 || true
    fi
  fi
done
((list_only)) && exit 0
echo "${#files[@]} sources checked, $bad not clean"
((bad == 0))
