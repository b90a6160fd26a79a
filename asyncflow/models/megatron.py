"""Build a Megatron-core ``GPTModel`` for the Llama / Qwen2 / Qwen3 family from a Hugging Face config.

The architecture facts (sizes, GQA, QKV bias, QK-norm, RoPE base, tied embeddings) are read once from
``config.json`` into ``GPTArch``; everything else (bridge, vLLM side, tools) reads ``GPTArch`` instead of
re-parsing Hugging Face configs. The layer-spec choice (Transformer Engine on GPU clusters, Megatron's
local modules otherwise) is made in exactly one place: ``layer_spec``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


@dataclasses.dataclass(frozen=True)
class GPTArch:
    """Architecture of a dense decoder-only model of the Llama/Qwen family, read from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    torch_dtype: str = "float32"
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model). Every layer is an MoE layer when > 0."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one routed expert."""
    moe_router_topk: int = 0
    """Experts each token is routed to."""
    moe_norm_topk_prob: bool = True
    """Renormalize the top-k routing probabilities (Qwen3-MoE) or keep softmax-over-all (Qwen2-MoE)."""
    shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert (0: none); Qwen2-MoE gates it with a sigmoid."""

    @property
    def is_moe(self) -> bool:
        """True for Mixture-of-Experts models."""
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> GPTArch:
        """From a ``config.json`` dict or a ``transformers.PretrainedConfig``."""
        if not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if model_type == "qwen2":
            qkv_bias = True  # Qwen2 always has q/k/v biases; its config has no flag for it
        elif model_type == "qwen2_moe":
            qkv_bias = bool(cfg.get("qkv_bias", True))
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        moe = _moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}
        rope = cfg.get("rope_theta")
        if rope is None:  # transformers >= 5 keeps it under rope_parameters
            rope = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_hidden_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            qkv_bias=qkv_bias,
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **moe,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> GPTArch:
        """Read ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE facts of a Qwen2-MoE / Qwen3-MoE config; only all-MoE layer stacks are supported."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("MoE models with dense layers (mlp_only_layers / decoder_sparse_step != 1) "
                         "are not supported")
    return dict(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def have_transformer_engine() -> bool:
    """True where Transformer Engine is importable (GPU clusters); never on the CPU stack."""
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec(arch: GPTArch, use_te: bool | None = None):
    """The one place that picks the layer spec: TE when installed (norms fuse into the linears), else local."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = have_transformer_engine() if use_te is None else use_te
    moe = dict(num_experts=arch.num_experts, moe_grouped_gemm=False) if arch.is_moe else {}
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
        moe_token_dispatcher_type="allgather",  # alltoall creates CUDA streams
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
        transformer_layer_spec=layer_spec(arch, use_te),
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
