"""Reward functions (registry ``REWARD_FUNCTIONS``).

Signature: ``fn(prompt_ids: list[int], response_ids: list[int], **task_info) -> float``. A user reward
function is given by dotted path (``my_pkg.rewards:score``) in ``algorithm.reward``.
"""

from asyncflow.rewards.registry import REWARD_FUNCTIONS, make_reward_fn

__all__ = ["REWARD_FUNCTIONS", "make_reward_fn"]
