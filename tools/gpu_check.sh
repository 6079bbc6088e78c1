#!/usr/bin/env bash
# One command on a GPU machine: build megapp's CUDA extension, run the CUDA tests, the kernel
# bandwidth and GPT MFU benchmarks and (with 2 or more GPUs) an NCCL smoke run, each stage
# under its own time limit, and write docs/gpu_check.md and docs/img/gpu_check.json.
# Without a GPU every GPU stage is skipped with a line and the report goes to
# $TMPDIR/megapp_gpu_check/ unless --markdown/--json say where. Options: --help.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m megapp.benchmarks.gpu_check "$@"
