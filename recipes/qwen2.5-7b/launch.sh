#!/usr/bin/env bash
# Qwen2.5-7B-Instruct GRPO (the sample stream, staleness 2) on 2 nodes x 8 GPUs: trainer TP2 x DP4, rollout 4 x vLLM TP2.
# Slurm:  sbatch -N 2 --gpus-per-node=8 --exclusive --wrap "MODEL_DIR=/models/... bash recipes/qwen2.5-7b/launch.sh"
# Hosts:  MODEL_DIR=/models/... HOSTS="this-host host2 ..." bash recipes/qwen2.5-7b/launch.sh [section.key=value ...]
# Layout in cluster.env, training config in config.yaml; see docs/recipes.md and recipes/common/ray_cluster.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/../common/ray_cluster.sh
source "$here/../common/ray_cluster.sh"
rc_main "$here" "$@"
