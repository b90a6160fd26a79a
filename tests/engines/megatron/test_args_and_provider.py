"""Megatron-LM arguments convert into MegatronConfig; a user's model provider replaces the builder."""

import argparse
import multiprocessing as mp

import pytest

from asyncflow.engines.megatron.args import megatron_config_from_args
from tests.forkserver import start_method

CALLS = []


def my_provider(config, pre_process, post_process):
    """A user's model provider (what a team with its own Megatron pretraining code would pass)."""
    from asyncflow.models.megatron import build_gpt_model

    model = build_gpt_model(_ARCH[0], config, pre_process=pre_process, post_process=post_process)
    model.built_by_user_provider = True
    return model


_ARCH = []


def test_megatron_args_convert_once():
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, lr=3e-6,
                              adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, clip_grad=1, micro_batch_size=2,
                              seed=42, make_vocab_size_divisible_by=64, bf16=True, fp16=False, num_layers=32)
    cfg = megatron_config_from_args(args, lr=1e-6)
    assert (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.micro_batch_size, cfg.seed) == (2, 4, 2, 42)
    assert cfg.lr == 1e-6 and cfg.clip_grad == 1.0 and cfg.params_dtype == "bfloat16"
    assert cfg.make_vocab_size_divisible_by == 64


def _child(model_dir):
    import torch

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.megatron import GPTArch
    from asyncflow.models.parallel import destroy_megatron

    _ARCH.append(GPTArch.from_pretrained(model_dir))
    cfg = MegatronConfig(model_provider="tests.engines.megatron.test_args_and_provider:my_provider")
    trainer = MegatronTrainer(cfg, model_dir)
    trainer.load_hf(model_dir)
    used = getattr(trainer.model.module, "built_by_user_provider", False)
    lp = trainer.logprobs(torch.tensor([[2, 5, 6, 7, 8, 18]] * 4))
    destroy_megatron()
    return used, bool(torch.isfinite(lp).all())


@pytest.mark.slow
def test_user_model_provider_is_used(tiny_model_dir):
    with mp.get_context(start_method()).Pool(1) as pool:
        used, finite = pool.apply(_child, (str(tiny_model_dir),))
    assert used and finite
