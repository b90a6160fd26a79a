"""Reward functions (registry ``REWARD_FUNCTIONS``) and the scorer that calls them in the shape they have.

``algorithm.reward`` names a registered factory (``add1``, ``calc``, ``math``, ``remote``, ``classifier``), or user
code by dotted path (``my_pkg.rewards:compute_score``) or file (``./my_reward.py:compute_score``). User code is a
factory ``factory(tokenizer[, cfg]) -> fn`` or the function itself, in any shape of
:mod:`asyncflow.rewards.scorer`: token ids ``fn(prompt_ids, response_ids, **info)``, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, batched, ``async def``. ``info`` holds
what the prompt source gives per row (``ground_truth``, ``data_source``, ``extra_info``). A function that raises
is isolated: the sample gets ``algorithm.reward_on_error`` and the failure is counted and reported.
"""

from asyncflow.rewards.config import RewardConfig
from asyncflow.rewards.registry import REWARD_FUNCTIONS, make_reward_fn
from asyncflow.rewards.scorer import RewardRow, RewardScorer, Scored, batched

__all__ = ["REWARD_FUNCTIONS", "RewardConfig", "RewardRow", "RewardScorer", "Scored", "batched", "make_reward_fn"]
