#!/usr/bin/env bash
# Pretrain GPT-2 with torchrun over several processes (one node or many).
#
# World size = NPROC_PER_NODE x NNODES = TP x PP x DP. The global batch of GLOBAL_BATCH
# sequences is split over DP replicas in micro-batches of MICRO_BATCH:
# GLOBAL_BATCH / (MICRO_BATCH x DP) micro-batches are accumulated per iteration, each
# iteration seeing GLOBAL_BATCH x SEQ_LEN tokens. On CPU, torch.distributed uses gloo; on GPUs,
# NCCL (chosen automatically).
#
#   NPROC_PER_NODE=2 TP=2 bash scripts/pretrain_gpt2_distributed.sh
#   NPROC_PER_NODE=4 TP=2 PP=2 ZERO_STAGE=1 bash scripts/pretrain_gpt2_distributed.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 ... (one call per node)
#
# Checkpoints use Megatron's layout under $CHECKPOINT_DIR; they load at any other layout
# (see README), e.g. resume this tp=2 run with scripts/pretrain_gpt2.sh.
#
# Faults: torchrun restarts the whole group up to MAX_RESTARTS times (default 3) when a rank
# dies; --load = --save, so the restarted group resumes from the last checkpoint (at most
# SAVE_INTERVAL iterations are redone). SIGTERM (preemption) saves at the end of the current
# iteration and exits 0 (--exit-signal-handler); a second SIGTERM exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC_PER_NODE=${NPROC_PER_NODE:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
TP=${TP:-2}
PP=${PP:-1}
ZERO_STAGE=${ZERO_STAGE:-0}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
SEQ_LEN=${SEQ_LEN:-256}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt2_small}
TRAIN_ITERS=${TRAIN_ITERS:-200}
SAVE_INTERVAL=${SAVE_INTERVAL:-50}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-5}
PYTHON=${PYTHON:-python}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$NPROC_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
    --max-restarts "$MAX_RESTARTS"
)

GPT_ARGS=(
    --num-layers 4
    --hidden-size 256
    --num-attention-heads 4
    --seq-length "$SEQ_LEN"
    --max-position-embeddings "$SEQ_LEN"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --clip-grad 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --zero-stage "$ZERO_STAGE"
)

DATA_ARGS=(
    --split 969,30,1
)

OUTPUT_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --log-interval "$LOG_INTERVAL"
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler
)

exec "$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt2.py \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
