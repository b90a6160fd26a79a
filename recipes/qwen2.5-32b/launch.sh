#!/usr/bin/env bash
# Qwen2.5-32B-Instruct GRPO (async, partial rollout, staleness 2) on 8 nodes x 8 GPUs: trainer TP8 x PP2 x DP2,
# rollout 4 x vLLM TP8.
# Slurm:  sbatch -N 8 --gpus-per-node=8 --exclusive --wrap "MODEL_DIR=/models/... bash recipes/qwen2.5-32b/launch.sh"
# Hosts:  MODEL_DIR=/models/... HOSTS="this-host host2 ..." bash recipes/qwen2.5-32b/launch.sh [section.key=value ...]
# Layout in cluster.env, training config in config.yaml; see docs/recipes.md and recipes/common/ray_cluster.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/../common/ray_cluster.sh
source "$here/../common/ray_cluster.sh"
rc_main "$here" "$@"
