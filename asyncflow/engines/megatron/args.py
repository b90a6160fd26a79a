"""Megatron-LM arguments -> AsyncFlow config keys, converted once at the boundary.

Teams that extend their own Megatron-LM pretraining code keep their argument parser and pass the parsed
namespace (or a dict) here; nothing in AsyncFlow reads the namespace afterwards. Every argument this module knows
is either mapped to a config key, accepted because AsyncFlow already does what it asks, or refused: one
``MegatronArgsError`` lists every refused argument with its value and the reason. Arguments this module does not
know (logging, data paths, tokenizer, profiling: what an RL run takes from its own config) are ignored.

The mapping table in ``docs/megatron_lm.md`` lists the same rules in prose.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from asyncflow.config import AsyncFlowConfig, ConfigError, MegatronConfig, replace_section
from asyncflow.models.arch import GPTArch

# Megatron-LM argument -> (dotted AsyncFlow key, conversion). Mapped whenever present and not None, at its
# Megatron-LM default too: a Megatron-LM run would have used that value.
_MAPPED: dict[str, tuple[str, type]] = {
    "tensor_model_parallel_size": ("trainer.tensor_parallel", int),
    "pipeline_model_parallel_size": ("trainer.pipeline_parallel", int),
    "expert_model_parallel_size": ("trainer.expert_parallel", int),
    "context_parallel_size": ("trainer.context_parallel", int),
    "sequence_parallel": ("trainer.sequence_parallel", bool),
    "use_distributed_optimizer": ("trainer.use_distributed_optimizer", bool),
    "overlap_grad_reduce": ("trainer.overlap_grad_reduce", bool),
    "overlap_param_gather": ("trainer.overlap_param_gather", bool),
    "make_vocab_size_divisible_by": ("trainer.make_vocab_size_divisible_by", int),
    "lr": ("trainer.lr", float),
    "weight_decay": ("trainer.weight_decay", float),
    "clip_grad": ("trainer.clip_grad", float),
    "adam_beta1": ("trainer.adam_beta1", float),
    "adam_beta2": ("trainer.adam_beta2", float),
    "adam_eps": ("trainer.adam_eps", float),
    "micro_batch_size": ("trainer.micro_batch_size", int),
    "seed": ("trainer.seed", int),
    "moe_grouped_gemm": ("trainer.moe_grouped_gemm", bool),
    "seq_length": ("rollout.max_model_len", int),
    "train_iters": ("workflow.steps", int),
    "save": ("checkpoint.dir", str),
    "save_interval": ("checkpoint.interval", int),
}

# Megatron-LM argument -> (its default, why AsyncFlow cannot honour another value).
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "num_layers_per_virtual_pipeline_stage": (None, "the trainer builds one model chunk per pipeline stage "
                                              "(no virtual pipeline / interleaved schedule)"),
    "num_virtual_stages_per_pipeline_rank": (None, "the trainer builds one model chunk per pipeline stage "
                                             "(no virtual pipeline / interleaved schedule)"),
    "decoder_first_pipeline_num_layers": (None, "pipeline stages hold equal numbers of layers"),
    "decoder_last_pipeline_num_layers": (None, "pipeline stages hold equal numbers of layers"),
    "pipeline_model_parallel_layout": (None, "pipeline stages hold equal numbers of layers"),
    "account_for_embedding_in_pipeline_split": (False, "pipeline stages hold equal numbers of layers"),
    "account_for_loss_in_pipeline_split": (False, "pipeline stages hold equal numbers of layers"),
    "rampup_batch_size": (None, "every RL step has the same batch (workflow.prompts_per_step)"),
    "train_samples": (None, "an RL run counts steps: use --train-iters (workflow.steps)"),
    "fp8": (None, "no FP8 training (params_dtype is float32, bfloat16 or float16)"),
    "fp8_format": (None, "no FP8 training (params_dtype is float32, bfloat16 or float16)"),
    "fp4": (None, "no FP4 training"),
    "optimizer": ("adam", "the trainer runs Megatron's Adam (AdamW: decoupled weight decay) only"),
    "use_precision_aware_optimizer": (False, "the optimizer keeps Megatron's default fp32 main params and moments"),
    "optimizer_cpu_offload": (False, "no optimizer CPU offload (the trainer offloads whole train states between "
                              "steps instead: ActorService)"),
    "num_distributed_optimizer_instances": (1, "one distributed-optimizer instance over the data-parallel ranks"),
    "use_torch_fsdp2": (False, "the trainer wraps its model in Megatron's DDP, not FSDP"),
    "use_megatron_fsdp": (False, "the trainer wraps its model in Megatron's DDP, not FSDP"),
    "use_custom_fsdp": (False, "the trainer wraps its model in Megatron's DDP, not FSDP"),
    "tp_comm_overlap": (False, "tensor-parallel communication overlap (Transformer Engine userbuffers) is not "
                        "configured"),
    "recompute_modules": (None, "selective recompute covers Megatron's default module (core attention) only"),
    "moe_aux_loss_coeff": (0.0, "the MoE router is built without an auxiliary load-balancing loss (the RL loss "
                           "alone trains it)"),
    "moe_z_loss_coeff": (None, "the MoE router is built without a z-loss"),
    "moe_expert_capacity_factor": (None, "MoE routing drops no tokens (no capacity factor)"),
    "ckpt_format": ("torch_dist", "--load/--save read and write Megatron dist checkpoints (torch_dist) only"),
    "lr_warmup_iters": (0, "the learning rate is constant (no warmup)"),
    "lr_warmup_samples": (0, "the learning rate is constant (no warmup)"),
    "lr_warmup_fraction": (None, "the learning rate is constant (no warmup)"),
    "weight_decay_incr_style": ("constant", "weight decay is constant"),
    "position_embedding_type": ("learned_absolute", "the models here use rotary embeddings (rope)"),
    "rotary_percent": (1.0, "rotary embeddings cover the whole head dimension"),
}
"""``position_embedding_type`` also accepts ``rope``; the dropouts also accept 0 (handled below)."""

# Architecture arguments, compared with the checkpoint's config.json when an arch is given and they are set:
# Megatron-LM argument -> GPTArch field.
_ARCH: dict[str, str] = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "kv_channels": "head_dim",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
}


class MegatronArgsError(ConfigError):
    """Megatron-LM arguments AsyncFlow cannot honour (the message names each one, its value and why)."""


@dataclass
class _Conversion:
    """The state of one conversion: the values read, the keys made and the arguments refused."""

    values: dict[str, Any]
    keys: dict[str, Any] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def given(self, name: str, default: Any = None) -> bool:
        """True when ``name`` is present with a value other than ``default``."""
        return name in self.values and self.values[name] != default

    def refuse(self, name: str, why: str) -> None:
        """Refuse argument ``name`` (written as its command-line flag)."""
        self.refused.append(f"--{name.replace('_', '-')}={self.values.get(name)!r}: {why}")


def _values(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)


def megatron_overrides(args: argparse.Namespace | dict[str, Any], *, samples_per_prompt: int = 8,
                       arch: GPTArch | None = None) -> dict[str, Any]:
    """Dotted AsyncFlow keys (``trainer.tensor_parallel``, ``checkpoint.dir``, ...) of Megatron-LM's arguments.

    ``samples_per_prompt`` (``workflow.samples_per_prompt``) turns ``--global-batch-size`` into
    ``workflow.prompts_per_step``. With ``arch`` (the checkpoint's ``GPTArch``), the architecture arguments that
    are set (``--num-layers``, ``--hidden-size``, ...) must match it. Raises ``MegatronArgsError`` listing every
    argument that cannot be honoured.
    """
    conv = _Conversion(_values(args))
    for name, (key, kind) in _MAPPED.items():
        if conv.values.get(name) is not None:
            conv.keys[key] = kind(conv.values[name])
    for name, (default, why) in _DEFAULT_ONLY.items():
        if conv.given(name, default) and not _also_accepted(name, conv.values[name]):
            conv.refuse(name, why)
    _precision(conv)
    _recompute(conv)
    _dropout(conv)
    _parallel_extras(conv)
    _schedule(conv)
    _batch(conv, samples_per_prompt)
    _load(conv)
    if arch is not None:
        _check_arch(conv, arch)
    if conv.refused:
        raise MegatronArgsError("Megatron-LM arguments AsyncFlow cannot honour: " + "; ".join(conv.refused))
    return conv.keys


def megatron_config_from_args(args: argparse.Namespace | dict[str, Any], **overrides: Any) -> MegatronConfig:
    """The ``trainer`` section (``MegatronConfig``) of Megatron-LM's arguments; ``overrides`` win over them.

    Refuses what cannot be honoured, as ``megatron_overrides`` does. Arguments that map to other sections
    (``--seq-length``, ``--train-iters``, ``--save``, ``--global-batch-size``) are checked but only
    ``config_from_megatron_args`` (or ``asyncflow.train(..., megatron_args=...)``) applies them.
    """
    keys = megatron_overrides(args)
    fields = {key.split(".", 1)[1]: value for key, value in keys.items() if key.startswith("trainer.")}
    fields.update(overrides)
    return MegatronConfig(**fields)


def config_from_megatron_args(cfg: AsyncFlowConfig, args: argparse.Namespace | dict[str, Any],
                              arch: GPTArch | None = None) -> AsyncFlowConfig:
    """A copy of ``cfg`` with every key Megatron-LM's arguments map to (see ``megatron_overrides``)."""
    keys = megatron_overrides(args, samples_per_prompt=cfg.workflow.samples_per_prompt, arch=arch)
    sections: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    for section, changes in sections.items():
        cfg = replace_section(cfg, section, **changes)
    return cfg


def _also_accepted(name: str, value: Any) -> bool:
    """Non-default values of ``_DEFAULT_ONLY`` arguments that AsyncFlow does honour."""
    if name == "position_embedding_type":
        return value == "rope"
    if name == "ckpt_format":
        return value == "torch_dist"
    if name == "recompute_modules":
        return list(value) == ["core_attn"]
    if name == "moe_aux_loss_coeff":  # Megatron-LM takes one coefficient per router (nargs='+')
        return all(float(v) == 0.0 for v in (value if isinstance(value, list | tuple) else [value]))
    return False


def _precision(conv: _Conversion) -> None:
    if conv.values.get("bf16") and conv.values.get("fp16"):
        conv.refuse("fp16", "--bf16 and --fp16 together")
    elif conv.values.get("bf16"):
        conv.keys["trainer.params_dtype"] = "bfloat16"
    elif conv.values.get("fp16"):
        conv.keys["trainer.params_dtype"] = "float16"


def _recompute(conv: _Conversion) -> None:
    granularity = conv.values.get("recompute_granularity")
    if granularity is None and conv.values.get("recompute_activations"):  # Megatron-LM's older spelling
        granularity = "selective"
    if granularity == "selective":
        conv.keys["trainer.recompute"] = "selective"
    elif granularity == "full":
        method = conv.values.get("recompute_method")
        if method not in (None, "uniform"):
            conv.refuse("recompute_method", "full recompute runs Megatron's uniform method (chunks of "
                        "recompute_num_layers layers) only")
        conv.keys["trainer.recompute"] = "full"
        if conv.values.get("recompute_num_layers") is not None:
            conv.keys["trainer.recompute_num_layers"] = int(conv.values["recompute_num_layers"])
    elif granularity is not None:
        conv.refuse("recompute_granularity", "only selective or full")


def _dropout(conv: _Conversion) -> None:
    for name in ("hidden_dropout", "attention_dropout"):
        value = conv.values.get(name)
        # 0.1 is Megatron-LM's default, left in place by scripts that never thought of dropout.
        if value is not None and float(value) not in (0.0, 0.1):
            conv.refuse(name, "RL trains without dropout (the trainer's log-probabilities must match rollout's): "
                        "use 0")


def _parallel_extras(conv: _Conversion) -> None:
    etp = conv.values.get("expert_tensor_parallel_size")
    if etp is not None and etp != conv.values.get("tensor_model_parallel_size", 1):
        conv.refuse("expert_tensor_parallel_size", "experts use the tensor-parallel size of the dense layers")
    cp_comm = conv.values.get("cp_comm_type")
    if cp_comm is not None and set(cp_comm if isinstance(cp_comm, list | tuple) else [cp_comm]) != {"p2p"}:
        conv.refuse("cp_comm_type", "context parallelism runs Transformer Engine's default ring (p2p)")
    dispatcher = conv.values.get("moe_token_dispatcher_type")
    if dispatcher in ("allgather", "alltoall"):
        conv.keys["trainer.moe_token_dispatcher"] = dispatcher
    elif dispatcher is not None:
        conv.refuse("moe_token_dispatcher_type", "allgather or alltoall")


def _schedule(conv: _Conversion) -> None:
    """Megatron-LM decays the learning rate unless the style is constant, min_lr equals lr, or it has no horizon."""
    v = conv.values
    horizon = any(v.get(n) for n in ("lr_decay_iters", "lr_decay_samples", "train_iters", "train_samples"))
    style = v.get("lr_decay_style", "constant")
    lr, min_lr = v.get("lr"), v.get("min_lr", 0.0)
    if style != "constant" and horizon and lr is not None and float(min_lr or 0.0) != float(lr):
        conv.refuse("lr_decay_style", f"the learning rate is constant (--lr {lr}): pass --lr-decay-style constant "
                    "or --min-lr equal to --lr")
    wd = v.get("weight_decay")
    for name in ("start_weight_decay", "end_weight_decay"):
        if v.get(name) is not None and wd is not None and float(v[name]) != float(wd):
            conv.refuse(name, "weight decay is constant (--weight-decay)")


def _batch(conv: _Conversion, samples_per_prompt: int) -> None:
    gbs = conv.values.get("global_batch_size")
    if gbs is None:
        return
    if gbs % samples_per_prompt:
        conv.refuse("global_batch_size", f"an RL step trains workflow.prompts_per_step x "
                    f"workflow.samples_per_prompt ({samples_per_prompt}) rows: use a multiple of {samples_per_prompt}")
        return
    conv.keys["workflow.prompts_per_step"] = gbs // samples_per_prompt


def _load(conv: _Conversion) -> None:
    load, pretrained = conv.values.get("load"), conv.values.get("pretrained_checkpoint")
    if load and pretrained and load != pretrained:
        conv.refuse("pretrained_checkpoint", "--load and --pretrained-checkpoint name different checkpoints; "
                    "the trainer's initial weights come from one (trainer.load_dir)")
    if load or pretrained:
        conv.keys["trainer.load_dir"] = str(pretrained or load)


def _check_arch(conv: _Conversion, arch: GPTArch) -> None:
    why = "the model comes from model.path's config.json, which says {}"
    for name, attr in _ARCH.items():
        value = conv.values.get(name)
        if value is not None and value != getattr(arch, attr):
            conv.refuse(name, why.format(f"{attr}={getattr(arch, attr)}"))
    v = conv.values
    if v.get("group_query_attention") and v.get("num_query_groups") not in (None, arch.num_query_groups):
        conv.refuse("num_query_groups", why.format(f"num_key_value_heads={arch.num_query_groups}"))
    if conv.given("rotary_base", 10000) and float(v["rotary_base"]) != arch.rope_theta:
        conv.refuse("rotary_base", why.format(f"rope_theta={arch.rope_theta}"))
    if v.get("untie_embeddings_and_output_weights") and arch.tie_word_embeddings:
        conv.refuse("untie_embeddings_and_output_weights", why.format("tie_word_embeddings=true"))
    if v.get("add_qkv_bias") and not arch.qkv_bias:
        conv.refuse("add_qkv_bias", why.format("no q/k/v biases"))
    if v.get("qk_layernorm") and not arch.qk_layernorm:
        conv.refuse("qk_layernorm", why.format("no q/k norms"))
    if v.get("use_rope_scaling"):  # Megatron-LM's Llama-3 scaling, which the built-in model applies from config.json
        scaling = arch.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            conv.refuse("use_rope_scaling", why.format(f"rope_scaling={arch.rope_scaling}"))
        elif float(v.get("rope_scaling_factor", 8.0)) != float(scaling.get("factor", 8.0)):
            conv.refuse("rope_scaling_factor", why.format(f"rope_scaling factor={scaling.get('factor')}"))
    if arch.is_moe and v.get("num_experts") and v.get("moe_router_topk") not in (None, arch.moe_router_topk):
        conv.refuse("moe_router_topk", why.format(f"num_experts_per_tok={arch.moe_router_topk}"))
