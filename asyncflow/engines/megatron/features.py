"""Memory features of ``MegatronEngineConfig`` (trainer and critic), checked against this machine and converted
once into Megatron's own config arguments (``TransformerConfig``, ``DistributedDataParallelConfig``,
``OptimizerConfig``).

What runs where (megatron-core 0.16.1):

- ``recompute``, ``overlap_grad_reduce``: CPU and GPU (on CPU through ``megatron_patches.recompute``);
- ``use_distributed_optimizer`` (and ``overlap_param_gather``, which needs it), 16-bit ``params_dtype``
  (Megatron's mixed-precision optimizer with fp32 main params): CPU and GPU (on CPU through
  ``megatron_patches.mixed_precision``: Megatron sorts parameters by their ``torch.cuda.*Tensor`` type name);
- ``sequence_parallel``: GPU with Transformer Engine: the torch norms of the local spec assert it is off;
- ``moe_token_dispatcher: alltoall``: GPU only (it creates CUDA streams);
- ``moe_grouped_gemm``: GPU with Transformer Engine (TEGroupedMLP);
- ``context_parallel`` > 1: GPU with Transformer Engine (its attention runs the ring over CP ranks; the local
  spec's attention asserts CP = 1). The trainer's split and gather (``context_parallel.py``) run on CPU.

Megatron's ``MoELayer`` refuses to train an MoE model at TP > 1 without sequence parallelism, so on CPU MoE
models train at TP = 1 only.

``asyncflow plan`` estimates all of them; ``check`` stops a trainer that asks for one this machine cannot run,
with a ``ConfigError`` naming the key, before Megatron fails somewhere deep inside. Rules between keys alone
(``overlap_param_gather`` needs the distributed optimizer, sequence parallelism needs TP > 1) are
``asyncflow.config_rules``'s and run when the config is loaded; the ones here need the machine (CUDA, Transformer
Engine) or the model (MoE), which only the trainer, or a recipe check for its cluster, knows.
"""

from __future__ import annotations

import math
from typing import Any

from asyncflow.config import ConfigError, MegatronEngineConfig


def check(cfg: MegatronEngineConfig, section: str = "trainer", *, is_moe: bool = False,
          cuda: bool | None = None, te: bool | None = None) -> None:
    """Raise ``ConfigError`` listing every feature of ``cfg`` that this machine (or this trainer) cannot run."""
    found = problems(cfg, section, is_moe=is_moe, cuda=cuda, te=te)
    if found:
        raise ConfigError("; ".join(found))


def problems(cfg: MegatronEngineConfig, section: str = "trainer", *, is_moe: bool = False,
             cuda: bool | None = None, te: bool | None = None) -> list[str]:
    """Every feature of ``cfg`` that this machine (or this trainer) cannot run, each naming ``section.key``.

    ``cuda`` / ``te`` default to what is installed (a CUDA device; Transformer Engine importable);
    ``asyncflow.recipes_check`` passes True for both to check a cluster recipe.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if te is None:
        from asyncflow.models.megatron import have_transformer_engine

        te = have_transformer_engine()
    found = []

    def bad(key: str, why: str) -> None:
        value = getattr(cfg, key)
        value = str(value).lower() if isinstance(value, bool) else value  # as written in YAML
        found.append(f"{section}.{key}={value}: {why}")

    sequence_parallel = getattr(cfg, "sequence_parallel", False)  # the critic has none (CriticConfig)
    if sequence_parallel and not te:
        bad("sequence_parallel", "needs Transformer Engine's norms: the torch norms of Megatron's local "
            "layer spec assert sequence_parallel is off (so never on CPU)")
    if cfg.context_parallel != 1 and not (cuda and te):
        bad("context_parallel", "attention over context-parallel ranks is Transformer Engine's (CUDA); the local "
            "layer spec's attention asserts CP = 1")
    if is_moe and cfg.tensor_parallel > 1 and not sequence_parallel:
        moe_tp = (f"an MoE model at tensor_parallel={cfg.tensor_parallel} needs sequence parallelism: Megatron's "
                  "MoELayer refuses to train with TP > 1 without it")
        if hasattr(cfg, "sequence_parallel"):
            bad("sequence_parallel", moe_tp)
        else:  # a critic: its value head reads whole sequences, so no sequence parallelism
            bad("tensor_parallel", moe_tp + "; the critic has none (its value head reads whole sequences): use 1")
    if cfg.moe_token_dispatcher == "alltoall" and not cuda:
        bad("moe_token_dispatcher", "the alltoall dispatcher creates CUDA streams; use allgather on CPU")
    if cfg.micro_batch_tokens and cfg.context_parallel > 1:
        bad("micro_batch_tokens", "sequence packing splits rows of one width over context-parallel ranks only "
            "with packed (THD) attention, which is not wired for context parallelism; use 0")
    if cfg.micro_batch_tokens and cfg.pipeline_parallel > 1 and is_moe and cfg.moe_token_dispatcher == "allgather":
        bad("micro_batch_tokens", "variable sequence lengths between pipeline stages are refused by Megatron's "
            "allgather MoE dispatcher; use moe_token_dispatcher=alltoall (CUDA) or 0")
    if cfg.micro_batch_tokens and is_moe and cfg.expert_parallel > 1 and cfg.data_parallel > 1:
        bad("micro_batch_tokens", "expert-parallel ranks in different data-parallel replicas exchange every "
            "micro-batch's tokens (Megatron's MoE dispatchers gather equal shapes), and packed micro-batches differ "
            "between replicas; use 0 (or expert_parallel within the tensor-parallel ranks)")
    if cfg.moe_grouped_gemm and not te:
        bad("moe_grouped_gemm", "needs Transformer Engine's grouped linear (TEGroupedMLP); not on CPU")
    return found


def seq_multiple(cfg: MegatronEngineConfig, cuda: bool | None = None) -> int:
    """What a packed or length-fitted micro-batch's width is rounded up to: a multiple of the tensor-parallel size
    under sequence parallelism (it splits the sequence over those ranks), of 8 on CUDA (tensor-core tiles). On CPU
    without sequence parallelism nothing needs it, so rows are padded only to the longest. Context parallelism pads
    its own chunks (``context_parallel``)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    multiple = 8 if cuda else 1
    if getattr(cfg, "sequence_parallel", False):  # the critic has none (CriticConfig)
        multiple = math.lcm(multiple, cfg.tensor_parallel)
    return multiple


def transformer_kwargs(cfg: MegatronEngineConfig, is_moe: bool) -> dict[str, Any]:
    """``TransformerConfig`` arguments of the recompute, parallelism and MoE features."""
    kwargs: dict[str, Any] = dict(sequence_parallel=getattr(cfg, "sequence_parallel", False),
                                  context_parallel_size=cfg.context_parallel,
                                  # packing: stages exchange each micro-batch's shape before its activations
                                  variable_seq_lengths=bool(cfg.micro_batch_tokens) and cfg.pipeline_parallel > 1)
    if cfg.recompute == "selective":  # Megatron's default module list: core attention
        kwargs.update(recompute_granularity="selective")
    elif cfg.recompute == "full":  # keep each chunk's input; chunks of recompute_num_layers layers
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=cfg.recompute_num_layers)
    if is_moe:
        kwargs.update(moe_token_dispatcher_type=cfg.moe_token_dispatcher, moe_grouped_gemm=cfg.moe_grouped_gemm)
    elif kwargs["variable_seq_lengths"]:  # Megatron refuses its default (allgather) dispatcher even without experts
        kwargs.update(moe_token_dispatcher_type="alltoall")
    return kwargs


def ddp_kwargs(cfg: MegatronEngineConfig) -> dict[str, Any]:
    """``DistributedDataParallelConfig`` arguments (gradients are reduced in fp32, as before)."""
    return dict(grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer,
                overlap_grad_reduce=cfg.overlap_grad_reduce, overlap_param_gather=cfg.overlap_param_gather)


def optimizer_kwargs(cfg: MegatronEngineConfig) -> dict[str, Any]:
    """``OptimizerConfig`` arguments of the distributed optimizer, and Adam's epsilon."""
    return dict(use_distributed_optimizer=cfg.use_distributed_optimizer,
                overlap_param_gather=cfg.overlap_param_gather, adam_eps=cfg.adam_eps)
