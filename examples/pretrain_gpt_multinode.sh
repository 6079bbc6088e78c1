#!/usr/bin/env bash
# Pre-train a 1.3B-parameter GPT on several GPU nodes. Run this script once on every
# node, with the same settings, in any order:
#
#   NNODES=4 MASTER_ADDR=node-0 DATA_PATH=/data/corpus_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   CHECKPOINT_DIR=/checkpoints/gpt-1.3b bash examples/pretrain_gpt_multinode.sh
#
# torchrun starts GPUS_PER_NODE ranks per node (one per GPU, NCCL) and the nodes meet at
# MASTER_ADDR:MASTER_PORT (c10d rendezvous, hosted by the node that runs there; it numbers
# the nodes in the order they arrive). Layout:
# tensor parallel TP inside a node (NVLink), pipeline parallel PP across nodes, data
# parallel over the rest (world / (TP × PP)). Set DATA_PATH to a prefix written by
# tools/data/preprocess_data.py (or weight/prefix pairs in quotes). Extra arguments go to
# pretrain_gpt.py, after the ones below (a repeated flag takes the last value).
#
# Every setting below is an environment variable with the 1.3B run as its default; the
# test suite runs this script on one CPU machine as two "nodes" with a tiny model:
#   MODEL_ARGS   model shape             BATCH_ARGS   micro and global batch
#   FEATURES     switches (sequence parallel, distributed optimizer, bf16); "" for none
#   TOKENIZER_ARGS  default: GPT-2 BPE from VOCAB_FILE and MERGE_FILE
#   TRAIN_ARGS   schedule and length     TENSORBOARD_DIR  "" turns TensorBoard off
#
# The job saves to and resumes from CHECKPOINT_DIR: the first run starts fresh, a rerun
# continues from the latest checkpoint. A rank that dies or stops answering ends the job
# within --distributed-timeout-minutes (TIMEOUT_MINUTES); a worker whose torchrun is
# killed exits by itself.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-megapp-gpt}
TP=${TP:-2}
PP=${PP:-2}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-10}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a dataset prefix (tools/data/preprocess_data.py writes one)}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt-1.3b}
TENSORBOARD_DIR=${TENSORBOARD_DIR-$CHECKPOINT_DIR/tensorboard}
MODEL_ARGS=${MODEL_ARGS:-"--num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048"}
BATCH_ARGS=${BATCH_ARGS:-"--micro-batch-size 2 --global-batch-size 512"}
FEATURES=${FEATURES-"--sequence-parallel --use-distributed-optimizer --bf16"}
TRAIN_ARGS=${TRAIN_ARGS:-"--lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --train-iters 300000 --weight-decay 0.1 --adam-beta2 0.95 \
    --clip-grad 1.0 --save-interval 1000 --log-interval 10 --eval-interval 1000 \
    --eval-iters 10"}
if [ -z "${TOKENIZER_ARGS:-}" ]; then
    VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab.json (or set TOKENIZER_ARGS)}
    MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges.txt (or set TOKENIZER_ARGS)}
    TOKENIZER_ARGS="--tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB_FILE \
        --merge-file $MERGE_FILE"
fi

# One stream per GPU keeps communication kernels in the order they were issued, so
# tensor-parallel all-reduces overlap compute as scheduled.
export CUDA_DEVICE_MAX_CONNECTIONS=1

# shellcheck disable=SC2086  # the *_ARGS and DATA_PATH hold several words
exec torchrun \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    $MODEL_ARGS $BATCH_ARGS $FEATURES $TRAIN_ARGS $TOKENIZER_ARGS \
    --data-path $DATA_PATH --split 969,30,1 \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" \
    --distributed-timeout-minutes "$TIMEOUT_MINUTES" \
    ${TENSORBOARD_DIR:+--tensorboard-dir "$TENSORBOARD_DIR"} \
    "$@"
