"""Architecture facts of the supported model families, read once from a Hugging Face ``config.json``.

The bottom of the package: the bridge, the engines, the planner and the tools all read ``GPTArch``
instead of re-parsing Hugging Face configs. Nothing here imports Megatron, vLLM or another layer of
AsyncFlow.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

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
    rope_scaling: dict[str, Any] | None = None
    """``config.json``'s ``rope_scaling`` as written there (None: none); ``models.megatron.rope_scaling_kwargs``
    reads it."""
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
            rope_scaling=_rope_scaling(cfg),
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


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of a config, None for plain rope (transformers >= 5 writes ``rope_type: default`` into
    ``rope_parameters`` beside ``rope_theta``; older configs have ``rope_scaling``)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
