#!/usr/bin/env bash
# Pretrain a small GPT-2 on the built-in default corpus, in one process, on CPU.
#
# Token arithmetic: each iteration sees GLOBAL_BATCH x SEQ_LEN = 16 x 256 = 4,096 tokens
# (4 micro-batches of 4 sequences, accumulated); 200 iterations are ~0.8M tokens, a few
# minutes on 2 CPU cores. The first run builds the corpus (the Python standard library,
# tokenized with a SentencePiece BPE trained on it) into ~/.cache/megazero, once.
#
# Checkpoints go to $CHECKPOINT_DIR every $SAVE_INTERVAL iterations; running the script again
# resumes from latest_checkpointed_iteration.txt and continues up to $TRAIN_ITERS.
#
#   bash scripts/pretrain_gpt2.sh                   # train (or resume) to 200 iterations
#   TRAIN_ITERS=400 bash scripts/pretrain_gpt2.sh   # continue further
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt2_small}
TRAIN_ITERS=${TRAIN_ITERS:-200}
SAVE_INTERVAL=${SAVE_INTERVAL:-50}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-5}
PYTHON=${PYTHON:-python}

GPT_ARGS=(
    --num-layers 4
    --hidden-size 256
    --num-attention-heads 4
    --seq-length 256
    --max-position-embeddings 256
    --micro-batch-size 4
    --global-batch-size 16
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
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

# No --data-path: the default corpus. To train on your own Megatron-format data:
#   DATA_ARGS=(--data-path my-corpus_text_document --tokenizer-type GPT2BPETokenizer
#              --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --split 949,50,1)
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

exec "$PYTHON" pretrain_gpt2.py "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
