#!/usr/bin/env bash
# Compile-check every csrc/**/*.cu with nvcc for sm_80 and sm_90 (the kernels include no torch
# headers, so no CUDA build of torch is needed). Exits non-zero if any file fails.
set -uo pipefail

cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda_sources: nvcc not found, skipping"
  exit 0
fi

out_dir="$(mktemp -d /tmp/megapp-nvcc.XXXXXX)"
trap 'rm -rf "$out_dir"' EXIT

status=0
while IFS= read -r -d '' src; do
  obj="$out_dir/$(echo "$src" | tr '/' '_').o"
  start=$SECONDS
  if log="$("$NVCC" -std=c++17 -O3 -I csrc/include \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -c "$src" -o "$obj" 2>&1)"; then
    echo "ok    $src ($((SECONDS - start)) s)"
  else
    echo "FAIL  $src"
    echo "$log" | sed 's/^/      /'
    status=1
  fi
done < <(find csrc -name '*.cu' -print0 | sort -z)
exit $status
