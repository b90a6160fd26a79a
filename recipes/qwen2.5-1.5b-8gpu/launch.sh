#!/usr/bin/env bash
# Qwen2.5-1.5B-Instruct GRPO on GSM8K-style math (async, staleness 1) on one node of 8 GPUs: trainer DP4,
# rollout 4 x vLLM TP1. The quickstart of docs/cluster.md.
# One machine: MODEL_DIR=/models/Qwen2.5-1.5B-Instruct HOSTS=localhost bash recipes/qwen2.5-1.5b-8gpu/launch.sh \
#                  data.path=/data/gsm8k/train.parquet
# Slurm:       sbatch --nodes=1 --export=ALL,RECIPE=recipes/qwen2.5-1.5b-8gpu,MODEL_DIR=... recipes/slurm/asyncflow.sbatch
# Layout in cluster.env, training config in config.yaml; see docs/cluster.md and recipes/common/ray_cluster.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/../common/ray_cluster.sh
source "$here/../common/ray_cluster.sh"
rc_main "$here" "$@"
