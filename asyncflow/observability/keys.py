"""Standard metric names. The RL loop logs them; the progress line, plots and benchmarks read them.

Names are ``section/quantity`` so TensorBoard and wandb group them into panels by section.
"""

REWARD_MEAN = "reward/mean"
"""Mean reward of the samples trained in this step."""
SAMPLES_PER_S = "perf/samples_per_s"
"""Trained samples per second of wall time over the step."""
TOKENS_PER_S = "perf/tokens_per_s"
"""Generated (response) tokens per second of wall time over the step."""
LAG_MEAN = "staleness/version_lag_mean"
"""Mean of (trainer version - weight version that generated the sample) over the step's samples."""
LAG_MAX = "staleness/version_lag_max"
"""Largest version lag in the step; never above ``max_staleness``."""
QUEUE_DEPTH = "queue/depth"
"""Rows produced by rollout and not yet consumed by the trainer when the step ended."""
IDLE_PREFIX = "idle/"
"""``idle/<group>``: fraction of the run's wall time in which no worker of the group was busy."""
