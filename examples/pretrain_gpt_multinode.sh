#!/usr/bin/env bash
# Pre-train a 1.3B-parameter GPT on several GPU nodes. Run this script once on every
# node, with the same settings except NODE_RANK:
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node-0 DATA_PATH=/data/corpus_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   CHECKPOINT_DIR=/checkpoints/gpt-1.3b bash examples/pretrain_gpt_multinode.sh
#
# torchrun starts GPUS_PER_NODE ranks per node (one per GPU, NCCL) and meets the
# other nodes at MASTER_ADDR:MASTER_PORT (node 0 hosts the rendezvous). Layout:
# tensor parallel 2 inside a node (NVLink), pipeline parallel 2, data parallel over
# the rest (world / 4). Set DATA_PATH to a prefix written by tools/preprocess_data.py
# (or weight/prefix pairs in quotes). Extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a dataset prefix (tools/preprocess_data.py writes one)}
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab.json}
MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges.txt}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt-1.3b}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_DIR/tensorboard}

# One stream per GPU keeps communication kernels in the order they were issued, so
# tensor-parallel all-reduces overlap compute as scheduled.
export CUDA_DEVICE_MAX_CONNECTIONS=1

# shellcheck disable=SC2086  # DATA_PATH may hold several words (weight/prefix pairs)
torchrun \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --sequence-parallel --use-distributed-optimizer \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 512 \
    --bf16 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --train-iters 300000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --data-path $DATA_PATH --split 969,30,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$TENSORBOARD_DIR" \
    "$@"
