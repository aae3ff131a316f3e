#!/usr/bin/env bash
# The tree's dependency rules (SPEC §1, STYLE.md 1-2), checked on the sources:
#   - kernels/ includes nothing from server/, client/, common/ or proto/ (the math sees no
#     service types);
#   - server/heads includes nothing from server/backend, server/scheduler or server/service;
#     server/backend nothing from server/scheduler or server/service; server/scheduler nothing
#     from server/service;
#   - no directory-wide include_directories(): every target declares its own include path
#     (target_include_directories) and links what it includes;
#   - no C++ / CUDA source over 700 lines unless a "Long file:" line in its first 40 lines says why.
#   check_layering.sh SOURCE_DIR
set -uo pipefail
cd "${1:?source dir}"
bad=0
fail() { echo "$1"; bad=$((bad + 1)); }
srcs() {
  find "$@" -type d \( -name node_modules -o -name 'build*' -o -name gen -o -name corpus \) -prune \
    -o -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print
}
forbid() {  # forbid DIR PATTERN...: no #include "PATTERN..." under DIR
  local dir=$1
  shift
  for p in "$@"; do
    while IFS= read -r hit; do
      fail "layering: $dir must not include $p: $hit"
    done < <(srcs "$dir" | xargs grep -Hn "^#include \"$p" || true)
  done
}
forbid kernels server/ client/ common/ proto/ logitserve/v1/
forbid server/heads server/backend/ server/scheduler/ server/service/
forbid server/backend server/scheduler/ server/service/
forbid server/scheduler server/service/
while IFS= read -r hit; do
  fail "cmake: directory-wide include path (use target_include_directories): $hit"
done < <(find . -type d \( -name node_modules -o -name 'build*' -o -name .git \) -prune -o \
           -type f \( -name CMakeLists.txt -o -name '*.cmake' \) -print |
         xargs grep -Hn '^\s*include_directories(' || true)
while IFS= read -r f; do
  n=$(wc -l < "$f")
  if ((n > 700)) && ! head -40 "$f" | grep -q "Long file:"; then
    fail "size: $f has $n lines and no \"Long file:\" reason at its top"
  fi
done < <(srcs bench client common kernels proto server tests)
echo "layering: $bad problem(s)"
((bad == 0))
