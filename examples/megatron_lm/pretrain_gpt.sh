#!/usr/bin/env bash
# A Megatron-LM pretraining script's argument list, run as RL post-training through asyncflow.train.
# The flags are Megatron-LM's own (the model flags describe outputs/tiny_model, the tiny CPU model that
# the tiny recipes create); train.py converts them once and refuses any it cannot honour.
#
#   bash examples/megatron_lm/pretrain_gpt.sh                 # train (CPU: a few minutes)
#   DRY_RUN=1 bash examples/megatron_lm/pretrain_gpt.sh       # print the config it would run
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-outputs/tiny_model}
OUT=${OUT:-outputs/megatron_lm}

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 256
    --num-attention-heads 2
    --group-query-attention
    --num-query-groups 1
    --max-position-embeddings 256
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 64
    --global-batch-size 256
    --seq-length 32
    --train-iters 20
    --lr 0.002
    --lr-decay-style constant
    --weight-decay 0.0
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.99
    --seed 1234
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)
CHECKPOINT_ARGS=(
    --save "$OUT/checkpoints"
    --save-interval 10
)

exec "${PYTHON:-.venv/bin/python}" examples/megatron_lm/train.py \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" \
    --asyncflow-model "$MODEL" --asyncflow-output "$OUT" ${DRY_RUN:+--asyncflow-dry-run}
