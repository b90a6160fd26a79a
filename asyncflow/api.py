"""The Python entry point: ``asyncflow.train(cfg, model_provider=..., prompts=..., reward=...)``.

What ``asyncflow train CONFIG key=value ...`` does, for code that builds its run in Python: a Megatron-LM team
passes its parsed arguments and its own model provider; a team with its own data passes a prompt source and a
reward. docs/megatron_lm.md describes every argument.

User code reaches the Ray workers by dotted path: the config holds ``package.module:name`` strings (so that it
stays plain data that YAML, checkpoints and the recipe checks read), and each worker imports the module. A callable
passed here is turned into its dotted path; one that no other process could import (a lambda, a local function,
a function of the ``__main__`` script) is refused with the fix. Ray itself could pickle such a function by value
into its workers, but the run's config could then not name it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncflow import config_loader
from asyncflow.config import AsyncFlowConfig, ConfigError, replace_section, validate

Spec = str | Callable[..., Any]
"""A registered name, a ``package.module:name`` dotted path, or an importable callable."""


def train(cfg: AsyncFlowConfig | str | Path | None = None, *, overrides: Sequence[str] = (),
          model_provider: Spec | None = None, prompts: Spec | None = None, reward: Spec | None = None,
          megatron_args: argparse.Namespace | dict[str, Any] | None = None, resume: bool = False) -> dict:
    """Run an RL training run and return its summary (the dict ``summary.json`` holds).

    ``cfg``: an ``AsyncFlowConfig``, or the path of a YAML config (a recipe's ``config.yaml``), or None for the
    defaults. Applied on top, in this order: ``megatron_args`` (Megatron-LM's parsed arguments, converted by
    ``asyncflow.engines.megatron.args.config_from_megatron_args``; an argument that cannot be honoured is an error),
    ``overrides`` (``section.key=value`` strings, as on the command line), then the three user hooks:

    - ``model_provider`` -> ``trainer.model_provider``: ``fn(config, pre_process, post_process[, context])``
      returning this pipeline stage's ``GPTModel`` (``context``: ``asyncflow.models.provider.ModelContext``);
    - ``prompts`` -> ``workflow.task``: a prompt-source name (``add1``, ``jsonl``, ...) or a factory
      ``factory(tokenizer, seed, data_cfg)`` returning a source with ``next_prompts(count)``,
      ``max_prompt_len``, ``state_dict()`` and ``load_state_dict(state)`` (``asyncflow.data.sources``);
    - ``reward`` -> ``algorithm.reward``: a reward name or user function (``asyncflow.rewards``).

    The same checks as ``asyncflow train`` run before anything starts; a mistake raises ``ConfigError`` naming
    the key. ``resume`` continues from the newest checkpoint under ``checkpoint.dir``.
    """
    cfg = build_config(cfg, overrides=overrides, model_provider=model_provider, prompts=prompts, reward=reward,
                       megatron_args=megatron_args)
    from asyncflow.cli import _checks_before_train
    from asyncflow.workflow.loop import train as run

    problems = _checks_before_train(cfg, None, [])
    if problems:
        raise ConfigError("; ".join(problems))
    return run(cfg, resume=resume)


def build_config(cfg: AsyncFlowConfig | str | Path | None = None, *, overrides: Sequence[str] = (),
                 model_provider: Spec | None = None, prompts: Spec | None = None, reward: Spec | None = None,
                 megatron_args: argparse.Namespace | dict[str, Any] | None = None) -> AsyncFlowConfig:
    """The config ``train`` would run (same arguments, nothing started); its cross-key rules are checked."""
    if cfg is None or isinstance(cfg, str | Path):
        cfg = config_loader.load(AsyncFlowConfig, cfg)
    if megatron_args is not None:
        from asyncflow.engines.megatron.args import config_from_megatron_args

        # The architecture arguments are checked against the model the run will train (model.path may be an override).
        arch = _arch_if_present(_with_overrides(cfg, overrides).model.path)
        cfg = config_from_megatron_args(cfg, megatron_args, arch=arch)
    cfg = _with_overrides(cfg, overrides)
    hooks = [("trainer", "model_provider", model_provider), ("workflow", "task", prompts),
             ("algorithm", "reward", reward)]
    for section, key, spec in hooks:
        if spec is not None:
            cfg = replace_section(cfg, section, **{key: dotted_path(spec, f"{section}.{key}")})
    validate(cfg)
    return cfg


def _with_overrides(cfg: AsyncFlowConfig, overrides: Sequence[str]) -> AsyncFlowConfig:
    if not overrides:
        return cfg
    # asdict, not config_loader.to_dict: that one redacts secrets (a reward endpoint's token) for printing.
    data = config_loader.deep_merge(dataclasses.asdict(cfg), config_loader.parse_overrides(list(overrides)))
    return config_loader.build(AsyncFlowConfig, data)


def dotted_path(spec: Spec, key: str) -> str:
    """``spec`` as the config holds it: a string unchanged, a callable as ``module:qualname`` that other processes
    can import. The module's folder joins ``PYTHONPATH`` so that the workers of a Ray cluster started from this
    process find it."""
    if isinstance(spec, str):
        return spec
    module, name = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
    fix = (f"{key}: define it at the top level of a module (e.g. my_hooks.py beside the script) and pass it from "
           "there, or pass its dotted path 'package.module:name'")
    if module in (None, "__main__", "builtins") or "<" in name:
        raise ConfigError(f"{key}: {spec!r} cannot be imported by the Ray workers ({module or 'no module'}:{name}); "
                          + fix.split(": ", 1)[1])
    path = f"{module}:{name}"
    try:
        found = getattr(importlib.import_module(module), name.split(".")[0])
        for part in name.split(".")[1:]:
            found = getattr(found, part)
    except (ImportError, AttributeError):
        found = None
    if found is not spec:
        raise ConfigError(f"{key}: {path} does not import back as the same object; " + fix.split(": ", 1)[1])
    _export_module_root(module)
    return path


def _export_module_root(module: str) -> None:
    """Put the ``sys.path`` entry that holds ``module`` on ``PYTHONPATH`` (Ray's local workers inherit it)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:
        return
    root = Path(file).resolve().parents[module.count(".")]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *paths])


def _arch_if_present(model_path: str):
    """The checkpoint's ``GPTArch`` when ``model.path`` already holds one (a tiny model may be made later)."""
    from asyncflow.models.arch import GPTArch

    return GPTArch.from_pretrained(model_path) if (Path(model_path) / "config.json").is_file() else None
