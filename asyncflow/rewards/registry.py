"""The reward-function registry, loading user reward code, and the built-in rewards of the synthetic tasks."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.registry import Registry, RegistryError
from asyncflow.rewards.config import RewardConfig
from asyncflow.rewards.scorer import params, shape_of

REWARD_FUNCTIONS = Registry("reward function", builtins={
    "math": "asyncflow.rewards.math:make_math_reward",
    "remote": "asyncflow.rewards.remote:make_remote_reward",
    "classifier": "asyncflow.rewards.classifier:make_classifier_reward",
})
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


def load_from_file(spec: str) -> Any:
    """``path/to/file.py:name`` (verl's ``custom_reward_function.path`` and ``.name`` in one string): ``name``
    of that file, imported as a module of its own."""
    path, _, name = spec.rpartition(":")
    file = Path(path).expanduser()
    if not file.is_file():
        raise RegistryError(f"reward file {path!r} not found (algorithm.reward: FILE.py:FUNCTION)")
    module_spec = importlib.util.spec_from_file_location(f"asyncflow_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    try:
        return getattr(module, name)
    except AttributeError:
        raise RegistryError(f"reward file {path!r} has no {name!r}") from None


def absolute_spec(spec: str) -> str:
    """``spec`` with a ``file.py:name``'s path made absolute (the reward workers may run in another folder)."""
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{Path(path).expanduser().resolve()}:{name}"
    return spec


def resolve_reward(spec: str) -> Any:
    """The object ``spec`` names: a registered name, ``pkg.module:attr``, or ``path/to/file.py:attr``."""
    path, sep, _ = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return load_from_file(spec)
    return REWARD_FUNCTIONS.resolve(spec)


def is_reward_function(obj: Any) -> bool:
    """Whether ``obj`` is a reward function itself (verl's shapes, or one taking ``prompt_ids, response_ids``)
    rather than a factory ``factory(tokenizer[, cfg]) -> fn``."""
    return shape_of(obj) != "tokens" or {"prompt_ids", "response_ids"} <= set(params(obj))


def make_reward_fn(spec: str, tokenizer, cfg: RewardConfig | None = None) -> Callable:
    """Build reward function ``spec``: a registered factory's name, or a dotted path or ``file.py:name`` to a
    factory or to the function itself (in any shape ``asyncflow.rewards.scorer`` reads). A factory taking
    ``cfg`` receives the ``reward`` section."""
    obj = resolve_reward(spec)
    if is_reward_function(obj):
        return obj
    return obj(tokenizer, **({"cfg": cfg or RewardConfig()} if "cfg" in params(obj) else {}))
