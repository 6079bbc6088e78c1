#!/usr/bin/env bash
# Flushed against asynchronous pipelines on one CPU machine: the CPU demo's tiny GPT
# (4 layers, 128 wide, byte tokens) on 4 pipeline stages of one gloo process each, under
# 1F1B, PipeDream-2BW, PipeDream and PipeDream with vertical sync, over the same samples;
# then the report with the loss curves. 2BW is checked against a single-process 2BW run,
# 1F1B against the plain single-process run; PipeDream has no single-process equal.
#
#   bash examples/ablation_async_cpu.sh [more tools/ablate.py flags]
#
# Records land in runs/ablation_async (SWEEP_DIR), the report in docs/ablation_async/
# (REPORT_DIR); HARDWARE as in examples/ablation_cpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

SWEEP_DIR=${SWEEP_DIR:-runs/ablation_async}
REPORT_DIR=${REPORT_DIR:-docs/ablation_async}
source examples/ablation_hardware.sh  # HARDWARE_FLAGS

status=0
# Both asynchronous schedules step each stage on its own: no global-norm clipping, no
# embedding tied across stages (the same for every point, the flushed ones included).
python tools/ablate.py --out "$SWEEP_DIR" --model tiny --nproc 4 \
    --model-flags "--clip-grad 0 --untie-embeddings-and-output-weights" \
    --global-batch-size 32 --train-iters 80 --timeout 600 \
    --pp 4 --schedule 1f1b pipedream-2bw pipedream pipedream-vsync --micro-batch-size 2 \
    "${HARDWARE_FLAGS[@]}" "$@" || status=$?
case " $* " in *" --dry-run "*) exit "$status" ;; esac  # the points only: no report
python tools/ablation_report.py "$SWEEP_DIR" --out "$REPORT_DIR" || status=$?
exit "$status"
