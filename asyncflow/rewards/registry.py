"""The reward-function registry and the built-in verifiable rewards of the synthetic tasks."""

from __future__ import annotations

from collections.abc import Callable

from asyncflow.registry import Registry

REWARD_FUNCTIONS = Registry("reward function", builtins={"math": "asyncflow.rewards.math:make_math_reward"})
RewardFn = Callable[[list[int], list[int]], float]


@REWARD_FUNCTIONS.register("add1")
def make_add1_reward(tokenizer) -> RewardFn:
    """Fraction of the four digits answered correctly (each prompt digit plus one, mod 10)."""
    from asyncflow.data.synthetic import Add1Task

    return Add1Task(tokenizer).reward


@REWARD_FUNCTIONS.register("calc")
def make_calc_reward(tokenizer) -> RewardFn:
    """Fraction of the product's four digits answered after the calculator's output (``calc`` task)."""
    from asyncflow.data.synthetic import CalcTask

    return CalcTask(tokenizer).reward


def make_reward_fn(spec: str, tokenizer) -> RewardFn:
    """Build reward function ``spec`` (registered factory name or dotted path to a factory)."""
    return REWARD_FUNCTIONS.resolve(spec)(tokenizer)
