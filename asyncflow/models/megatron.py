"""Build a Megatron-core ``GPTModel`` for the Llama / Qwen2 / Qwen3 family from a ``GPTArch``.

The architecture facts live in ``asyncflow.models.arch``. The layer-spec choice (Transformer Engine on GPU
clusters, Megatron's local modules otherwise) is made in exactly one place: ``layer_spec``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from asyncflow.models.arch import GPTArch, padded_vocab_size  # noqa: F401 - re-exported for the engines


def have_transformer_engine() -> bool:
    """True where Transformer Engine is importable (GPU clusters); never on the CPU stack."""
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec(arch: GPTArch, use_te: bool | None = None, moe_grouped_gemm: bool = False):
    """The one place that picks the layer spec: TE when installed (norms fuse into the linears), else local."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = have_transformer_engine() if use_te is None else use_te
    moe = dict(num_experts=arch.num_experts, moe_grouped_gemm=moe_grouped_gemm) if arch.is_moe else {}
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=arch.qk_layernorm, **moe
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=arch.qk_layernorm, normalization="RMSNorm", **moe
    )


def transformer_config(
    arch: GPTArch,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    expert_parallel: int = 1,
    **overrides: Any,
):
    """A Megatron ``TransformerConfig`` equivalent to the Hugging Face architecture.

    ``expert_parallel`` matters for MoE models only (experts are split evenly over the EP ranks).
    ``overrides`` are further ``TransformerConfig`` arguments (the trainer passes its recompute, sequence /
    context parallel and MoE dispatcher settings from ``asyncflow.engines.megatron.features``).
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
    )
    if arch.is_moe:
        kwargs.update(_moe_config(arch, expert_parallel))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_config(arch: GPTArch, expert_parallel: int) -> dict[str, Any]:
    """TransformerConfig arguments that reproduce Qwen-MoE routing exactly (no aux loss, no capacity drop)."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        # Qwen3-MoE: softmax over the top-k logits == renormalized top-k of softmax over all experts;
        # Qwen2-MoE (norm_topk_prob=False): softmax over all experts first, then top-k.
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",  # alltoall creates CUDA streams (a trainer may override it on GPU)
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=arch.shared_expert_ffn_hidden_size > 0,
        moe_router_dtype="fp32",
        expert_model_parallel_size=expert_parallel,
    )


def build_gpt_model(
    arch: GPTArch,
    config,
    *,
    make_vocab_size_divisible_by: int = 128,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool | None = None,
):
    """A ``GPTModel`` for this rank's pipeline stage (parallel state must be initialized)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if arch.is_moe:
        from megatron_patches import moe

        moe.apply()  # also needed on a GPU machine without Transformer Engine
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    vocab = padded_vocab_size(
        arch.vocab_size, make_vocab_size_divisible_by, config.tensor_model_parallel_size
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_te, moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False)),
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        **rope_scaling_kwargs(arch),
    )


_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The parameters of Llama-3 rope scaling that Megatron's ``RotaryEmbedding`` fixes (only the factor is free)."""


def rope_scaling_kwargs(arch: GPTArch) -> dict[str, Any]:
    """``GPTModel`` arguments of the checkpoint's rope scaling; a ``ValueError`` for scaling the built-in model cannot
    apply (rollout would apply it and the trainer not, so their log-probabilities would disagree)."""
    scaling = arch.rope_scaling
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = all(float(scaling.get(k, v)) == v for k, v in _LLAMA3_FIXED.items())
    if kind == "llama3" and fixed:
        return dict(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    raise ValueError(f"config.json's rope_scaling {scaling} is not supported by the built-in model (Megatron applies "
                     f"llama3 scaling with {_LLAMA3_FIXED} only): pass a trainer.model_provider that applies it")
