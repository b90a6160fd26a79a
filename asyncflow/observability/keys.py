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
RESPONSE_LEN_MEAN = "response/length_mean"
"""Mean response length, in tokens, of the samples trained in this step (every data-parallel replica's rows)."""
RESPONSE_LEN_MAX = "response/length_max"
"""Longest trained response of the step, in tokens."""
RESPONSE_LEN_MIN = "response/length_min"
"""Shortest trained response of the step, in tokens."""
CLIP_RATIO = "response/clip_ratio"
"""Fraction of the step's trained responses cut at the generation cap (their length reached
``rollout.max_new_tokens``) instead of ending on their own. This is also the truncation rate: prompts are never
truncated here (a prompt over ``data.max_prompt_len`` is an error), so a truncated sample is a clipped response."""
ENTROPY = "actor/entropy"
"""Mean per-token entropy of the policy over the step's response tokens, from the trainer's logits in the first
pass (before the update), in nats."""
EVAL_PREFIX = "eval/"
"""Validation metrics (``workflow.eval_every``), logged on the step whose rollout ran the evaluation."""
EVAL_GREEDY_ACC = "eval/greedy_acc"
"""Fraction of validation prompts whose greedy (temperature 0) response is correct (reward reaches
``workflow.eval_correct_reward``)."""
EVAL_MEAN_REWARD = "eval/mean_reward"
"""Mean reward of the sampled validation responses (``eval_k`` per prompt, at the rollout temperature)."""
EVAL_GREEDY_REWARD = "eval/greedy_reward"
"""Mean reward of the greedy validation responses."""
EVAL_VERSION = "eval/version"
"""The weight version the validation responses were generated with (the steps trained into those weights)."""
EVAL_PROMPTS = "eval/prompts"
"""Validation prompts evaluated."""


def eval_pass_at(k: int) -> str:
    """``eval/pass@<k>``: the unbiased pass@k over the validation prompts (Chen et al. 2021) from ``eval_k``
    sampled responses each."""
    return f"eval/pass@{k}"
