"""Megatron-LM arguments -> ``MegatronConfig``, converted once at the boundary.

Teams that extend their own Megatron-LM pretraining code keep their argument parser and pass the
parsed namespace here; nothing in AsyncFlow reads the namespace afterwards.
"""

from __future__ import annotations

import argparse
from typing import Any

from asyncflow.config import MegatronConfig

# Megatron-LM argument name -> MegatronConfig field (identical names are listed too, for clarity).
_ARG_MAP = {
    "tensor_model_parallel_size": "tensor_parallel",
    "pipeline_model_parallel_size": "pipeline_parallel",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "lr": "lr",
    "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2",
    "weight_decay": "weight_decay",
    "clip_grad": "clip_grad",
    "micro_batch_size": "micro_batch_size",
    "seed": "seed",
}


def megatron_config_from_args(args: argparse.Namespace | dict[str, Any], **overrides: Any) -> MegatronConfig:
    """Build a ``MegatronConfig`` from Megatron-LM's parsed arguments (unknown arguments are ignored).

    ``bf16``/``fp16`` flags select ``params_dtype``; ``overrides`` win over the arguments.
    """
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    fields: dict[str, Any] = {}
    for arg, field in _ARG_MAP.items():
        if values.get(arg) is not None:
            fields[field] = values[arg]
    if values.get("bf16"):
        fields["params_dtype"] = "bfloat16"
    elif values.get("fp16"):
        fields["params_dtype"] = "float16"
    for name in ("lr", "adam_beta1", "adam_beta2", "weight_decay", "clip_grad"):
        if name in fields:
            fields[name] = float(fields[name])
    fields.update(overrides)
    return MegatronConfig(**fields)
