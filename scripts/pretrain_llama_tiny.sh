#!/usr/bin/env bash
# Pretrain a tiny Llama-family model on the built-in default corpus, in one process, on CPU,
# with Megatron-LM's Llama flags: RoPE, RMSNorm, SwiGLU, grouped-query attention (8 query
# heads sharing 2 key/value heads), untied input and output embeddings, no linear biases.
#
# Same corpus, token budget and schedule as scripts/pretrain_gpt2.sh (16 x 256 tokens per
# iteration, 200 iterations). Checkpoints go to $CHECKPOINT_DIR; running again resumes.
#
#   bash scripts/pretrain_llama_tiny.sh
#   torchrun --nproc-per-node 4 pretrain_gpt2.py ... --tensor-model-parallel-size 2 \
#       --pipeline-model-parallel-size 2        # the same flags at any layout
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/llama_tiny}
TRAIN_ITERS=${TRAIN_ITERS:-200}
SAVE_INTERVAL=${SAVE_INTERVAL:-50}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-5}
PYTHON=${PYTHON:-python}

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 256
    --ffn-hidden-size 688
    --num-attention-heads 8
    --group-query-attention
    --num-query-groups 2
    --seq-length 256
    --max-position-embeddings 256
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

OUTPUT_ARGS=(
    --split 969,30,1
    --train-iters "$TRAIN_ITERS"
    --log-interval "$LOG_INTERVAL"
    --log-throughput
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler
)

exec "$PYTHON" pretrain_gpt2.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
