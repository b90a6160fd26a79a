"""What a user's Megatron model provider receives: the ``TransformerConfig`` and a ``ModelContext``.

A provider is Megatron-LM's ``model_provider`` shape, ``fn(config, pre_process, post_process)``; one that also
takes a ``context`` argument (or ``**kwargs``) gets a ``ModelContext`` with the facts it would otherwise
hard-code: the padded vocabulary, the rope settings, the longest position and this rank's parallel state.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from asyncflow.models.arch import GPTArch, padded_vocab_size


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """This rank's place in Megatron's parallel state (sizes and ranks of each dimension)."""

    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    context_parallel: int
    data_parallel: int
    tensor_rank: int
    pipeline_rank: int
    expert_rank: int
    context_rank: int
    data_rank: int

    @classmethod
    def current(cls) -> ParallelContext:
        """Read from ``megatron.core.parallel_state`` (initialized by the trainer before it calls a provider)."""
        from megatron.core import parallel_state as ps

        return cls(
            tensor_parallel=ps.get_tensor_model_parallel_world_size(),
            pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
            expert_parallel=ps.get_expert_model_parallel_world_size(),
            context_parallel=ps.get_context_parallel_world_size(),
            data_parallel=ps.get_data_parallel_world_size(),
            tensor_rank=ps.get_tensor_model_parallel_rank(),
            pipeline_rank=ps.get_pipeline_model_parallel_rank(),
            expert_rank=ps.get_expert_model_parallel_rank(),
            context_rank=ps.get_context_parallel_rank(),
            data_rank=ps.get_data_parallel_rank(),
        )


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """Facts of the model a provider builds, as the built-in builder uses them (``build_gpt_model``)."""

    arch: GPTArch
    """The whole architecture read from the checkpoint's ``config.json``."""
    vocab_size: int
    """The tokenizer's vocabulary (``config.json``'s ``vocab_size``)."""
    padded_vocab_size: int
    """The embedding's rows: ``vocab_size`` padded to a multiple of ``make_vocab_size_divisible_by`` x TP. Pass it
    as ``GPTModel(vocab_size=...)``: the weight loader and the bridge expect this many rows."""
    make_vocab_size_divisible_by: int
    """``trainer.make_vocab_size_divisible_by``."""
    max_position_embeddings: int
    """``GPTModel(max_sequence_length=...)``."""
    rotary_base: float
    """Rope base (``rope_theta``): ``GPTModel(rotary_base=...)``."""
    rope_scaling: dict[str, Any] | None
    """``config.json``'s ``rope_scaling`` (None when the model has none). The built-in builder applies Llama-3
    scaling (``models.megatron.rope_scaling_kwargs``) and refuses others."""
    share_embeddings_and_output_weights: bool
    """Tied input and output embeddings (``tie_word_embeddings``)."""
    pre_process: bool
    """This pipeline stage holds the input embedding (also passed as the provider's ``pre_process``)."""
    post_process: bool
    """This pipeline stage holds the output layer (also passed as the provider's ``post_process``)."""
    parallel: ParallelContext
    """This rank's parallel state."""


def model_context(arch: GPTArch, make_vocab_size_divisible_by: int, parallel: ParallelContext | None = None,
                  pre_process: bool | None = None, post_process: bool | None = None) -> ModelContext:
    """The ``ModelContext`` of this rank (parallel state and pipeline stage read from Megatron unless given)."""
    parallel = parallel or ParallelContext.current()
    last = parallel.pipeline_rank == parallel.pipeline_parallel - 1
    return ModelContext(
        arch=arch,
        vocab_size=arch.vocab_size,
        padded_vocab_size=padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, parallel.tensor_parallel),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        max_position_embeddings=arch.max_position_embeddings,
        rotary_base=arch.rope_theta,
        rope_scaling=dict(arch.rope_scaling) if arch.rope_scaling else None,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        pre_process=parallel.pipeline_rank == 0 if pre_process is None else pre_process,
        post_process=last if post_process is None else post_process,
        parallel=parallel,
    )


def takes_context(provider: Callable) -> bool:
    """True when ``provider`` accepts a ``context`` keyword (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(provider).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(p.name == "context" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call_provider(provider: Callable, config, context: ModelContext):
    """Call ``provider(config, pre_process=, post_process=)``, with ``context=`` when it takes one."""
    extra = {"context": context} if takes_context(provider) else {}
    return provider(config, pre_process=context.pre_process, post_process=context.post_process, **extra)
