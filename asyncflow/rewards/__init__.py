"""Reward functions (registry ``REWARD_FUNCTIONS``).

A reward function is built by a factory ``factory(tokenizer) -> fn`` and called as
``fn(prompt_ids: list[int], response_ids: list[int], **info) -> float``; ``info`` holds
``ground_truth=`` when the prompt source provides reference answers. A user reward factory is given by
dotted path (``my_pkg.rewards:make_score``) in ``algorithm.reward``. A function that raises is
isolated: the sample gets ``algorithm.reward_on_error`` and the failure is counted and reported.
"""

from asyncflow.rewards.registry import REWARD_FUNCTIONS, make_reward_fn

__all__ = ["REWARD_FUNCTIONS", "make_reward_fn"]
