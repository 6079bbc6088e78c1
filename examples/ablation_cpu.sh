#!/usr/bin/env bash
# An ablation sweep on one CPU machine: the CPU demo's tiny GPT (4 layers, 128 wide, byte
# tokens) under 12 layouts of 8 gloo processes (tp 1 and 2 × pipeline 2; 1F1B, interleaved
# 1F1B and ZB-V; no recompute and full recompute), plus the single-process reference, then
# the report with its plots.
#
#   bash examples/ablation_cpu.sh [more tools/ablate.py flags, e.g. --repeats 3]
#   bash examples/ablation_cpu.sh --dry-run   # the points and the refused ones, nothing run
#
# Sweep records land in runs/ablation_cpu (SWEEP_DIR; run it again: finished points are
# reused, and a larger --repeats only adds launches), the report in docs/ablation/
# (REPORT_DIR). HARDWARE=<name or calibrated JSON profile> sets the profile of the
# predicted step time. Measured on the 2-core development machine with the default
# corpus built: 4 min 26 s end to end with no other job, 8 min 9 s to 8 min 51 s under a
# load average of 10-20, 13 min 52 s with --repeats 3; a rerun that reuses every point
# takes 19 s to 1 min.
set -euo pipefail
cd "$(dirname "$0")/.."

SWEEP_DIR=${SWEEP_DIR:-runs/ablation_cpu}
REPORT_DIR=${REPORT_DIR:-docs/ablation}
source examples/ablation_hardware.sh  # HARDWARE_FLAGS

status=0
python tools/ablate.py --out "$SWEEP_DIR" --model tiny --nproc 8 \
    --global-batch-size 32 --train-iters 8 --timeout 240 \
    --tp 1 2 --pp 2 --vpp 1 2 --schedule 1f1b interleaved-1f1b zb-v \
    --micro-batch-size 2 --recompute none full \
    "${HARDWARE_FLAGS[@]}" "$@" || status=$?
case " $* " in *" --dry-run "*) exit "$status" ;; esac  # the points only: no report
# The report is written even when a layout failed parity (status 1), so the alarm is seen.
python tools/ablation_report.py "$SWEEP_DIR" --out "$REPORT_DIR" || status=$?
exit "$status"
