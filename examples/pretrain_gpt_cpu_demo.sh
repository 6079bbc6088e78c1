#!/usr/bin/env bash
# Pre-train a tiny GPT on one CPU machine: 8 processes on gloo laid out as
# tensor parallel 2 × pipeline parallel 2 × data parallel 2.
#
#   bash examples/pretrain_gpt_cpu_demo.sh [more pretrain_gpt.py flags]
#
# The data is the built-in corpus (this Python's standard-library sources,
# byte-level tokens), built once under ~/.cache/megapp. 100 iterations of a
# 4-layer, 128-wide model take about 1 min 25 s on two cores; the loss falls
# from about 4.9 to under 3. Metrics land in runs/cpu_demo/metrics.jsonl.
# README.md runs the same command (tests/test_pretrain_args.py keeps them equal).
set -euo pipefail
cd "$(dirname "$0")/.."

torchrun --nproc-per-node 8 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 32 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 100 \
    --log-interval 10 --eval-interval 50 --eval-iters 5 \
    --use-default-corpus --metrics-path runs/cpu_demo/metrics.jsonl \
    "$@"
