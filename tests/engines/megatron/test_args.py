"""Megatron-LM arguments map to AsyncFlow keys or are refused by name (unit tests: no model, no process group)."""

import argparse

import pytest

from asyncflow.config import AsyncFlowConfig
from asyncflow.engines.megatron.args import (
    MegatronArgsError,
    config_from_megatron_args,
    megatron_config_from_args,
    megatron_overrides,
)
from asyncflow.models.arch import GPTArch


def _issue_namespace(**changes):
    """The namespace of issue 44: EP8, sequence parallelism, the distributed optimizer, full recompute, CP2 and
    overlap_grad_reduce, with the rest at Megatron-LM's defaults as its parser leaves them."""
    values = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=8,
                  context_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True,
                  recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2,
                  overlap_grad_reduce=True, overlap_param_gather=False, bf16=True, fp16=False, lr=1e-6,
                  min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=0, weight_decay=0.1, clip_grad=1.0,
                  adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, micro_batch_size=1, global_batch_size=256,
                  seq_length=4096, seed=7, save="/ckpt/run", save_interval=50, load=None,
                  make_vocab_size_divisible_by=128, hidden_dropout=0.1, attention_dropout=0.1,
                  optimizer="adam", ckpt_format="torch_dist", position_embedding_type="rope",
                  num_layers_per_virtual_pipeline_stage=None, fp8=None,
                  # arguments this module does not know, at their defaults: ignored
                  log_interval=100, tensorboard_dir=None, data_path=None, vocab_file=None)
    values.update(changes)
    return argparse.Namespace(**values)


def test_issue_namespace_maps_every_feature():
    keys = megatron_overrides(_issue_namespace(), samples_per_prompt=8)
    assert keys["trainer.expert_parallel"] == 8
    assert keys["trainer.sequence_parallel"] is True
    assert keys["trainer.use_distributed_optimizer"] is True
    assert (keys["trainer.recompute"], keys["trainer.recompute_num_layers"]) == ("full", 2)
    assert keys["trainer.context_parallel"] == 2
    assert keys["trainer.overlap_grad_reduce"] is True
    assert keys["trainer.params_dtype"] == "bfloat16"
    assert (keys["trainer.adam_beta2"], keys["trainer.weight_decay"], keys["trainer.seed"]) == (0.95, 0.1, 7)
    assert keys["workflow.prompts_per_step"] == 32  # 256 rows / 8 samples per prompt
    assert keys["rollout.max_model_len"] == 4096
    assert (keys["checkpoint.dir"], keys["checkpoint.interval"]) == ("/ckpt/run", 50)
    assert not any(k.endswith(("log_interval", "data_path")) for k in keys)


def test_whole_config_takes_every_section():
    cfg = config_from_megatron_args(AsyncFlowConfig(), _issue_namespace(train_iters=300, lr_decay_style="constant"))
    assert (cfg.trainer.expert_parallel, cfg.trainer.context_parallel, cfg.trainer.recompute) == (8, 2, "full")
    assert (cfg.workflow.steps, cfg.workflow.prompts_per_step, cfg.rollout.max_model_len) == (300, 32, 4096)
    assert cfg.checkpoint.dir == "/ckpt/run"
    trainer = megatron_config_from_args(_issue_namespace(), lr=3e-6)
    assert trainer.use_distributed_optimizer and trainer.sequence_parallel and trainer.lr == 3e-6


def test_unhonoured_arguments_are_refused_together_by_name():
    args = _issue_namespace(num_layers_per_virtual_pipeline_stage=2, fp8="hybrid", recompute_method="block",
                            hidden_dropout=0.2, optimizer="sgd", train_iters=100,  # linear decay over 100 steps
                            global_batch_size=250, expert_tensor_parallel_size=1)
    with pytest.raises(MegatronArgsError) as err:
        megatron_overrides(args, samples_per_prompt=8)
    message = str(err.value)
    for flag in ("--num-layers-per-virtual-pipeline-stage=2", "--fp8='hybrid'", "--recompute-method='block'",
                 "--hidden-dropout=0.2", "--optimizer='sgd'", "--lr-decay-style='linear'",
                 "--global-batch-size=250", "--expert-tensor-parallel-size=1"):
        assert flag in message, flag
    assert message.count("; ") == 7  # one error, eight arguments
    assert "interleaved" in message and "constant" in message  # each says why


def test_defaults_and_unknown_arguments_pass_silently():
    # Megatron-LM's own defaults of arguments that AsyncFlow does not honour otherwise (dropout 0.1, a linear
    # decay with no horizon), and arguments this module does not know at all.
    args = argparse.Namespace(hidden_dropout=0.1, lr_decay_style="linear", lr=1e-5, train_iters=None,
                              some_future_flag=None, wandb_project=None, num_workers=2)
    assert megatron_overrides(args) == {"trainer.lr": 1e-5}
    assert megatron_overrides(_issue_namespace(min_lr=1e-6, train_iters=10))["trainer.lr"] == 1e-6  # no decay


def test_architecture_arguments_must_match_the_checkpoint():
    arch = GPTArch(model_type="qwen2", vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=4,
                   num_query_groups=2, head_dim=16, ffn_hidden_size=128, max_position_embeddings=256,
                   rms_norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, qk_layernorm=False, tie_word_embeddings=True)
    same = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, rotary_base=1000000, add_qkv_bias=True)
    assert megatron_overrides(same, arch=arch) == {}
    with pytest.raises(MegatronArgsError, match=r"--num-layers=4: .*num_layers=2.*--rotary-base=10001"):
        megatron_overrides({**same, "num_layers": 4, "rotary_base": 10001}, arch=arch)


def test_rope_scaling_argument_must_match_the_checkpoint():
    from dataclasses import replace

    arch = GPTArch(model_type="llama", vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=4,
                   num_query_groups=4, head_dim=16, ffn_hidden_size=128, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=5e5, qkv_bias=False, qk_layernorm=False, tie_word_embeddings=True)
    llama31 = replace(arch, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert megatron_overrides({"use_rope_scaling": True, "rope_scaling_factor": 8.0}, arch=llama31) == {}
    with pytest.raises(MegatronArgsError, match="--rope-scaling-factor=32.0"):
        megatron_overrides({"use_rope_scaling": True, "rope_scaling_factor": 32.0}, arch=llama31)
    with pytest.raises(MegatronArgsError, match="--use-rope-scaling=True: .*rope_scaling=None"):
        megatron_overrides({"use_rope_scaling": True}, arch=arch)
