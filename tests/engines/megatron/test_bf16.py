"""bf16 parameters on the CPU through Megatron's own mixed-precision and distributed optimizers.

What these caught: the trainer built the optimizer (which copies the model's bf16 weights into its fp32
main params) before the Hugging Face weights were loaded, and nothing refreshed the main params, so the
first optimizer step copied the random initial weights back into the model. On the CPU this could not be
seen at all until ``megatron_patches.mixed_precision`` let the optimizers accept CPU parameters.

Megatron runs in spawned children so that its patches and process groups never leak into pytest. That the demo
recipe learns in bf16 on both engines, and reports the live logprob gap within the bf16 bounds, is the async
bf16 run of ``tests/tools/test_gpu_check.py``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from tests.forkserver import start_method


def _bf16_cfg(**overrides):
    from asyncflow.config import MegatronConfig

    return MegatronConfig(micro_batch_size=2, params_dtype="bfloat16", **overrides)


def _main_param_pairs(optimizer):
    """``(model_param, fp32 main param)`` for every 16-bit parameter this rank's optimizer holds.

    Under the distributed optimizer the model side is this rank's shard (a view into the parameter).
    """
    pairs = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_float16_groups"):  # DistributedOptimizer
            groups = zip(opt.shard_float16_groups, opt.shard_fp32_from_float16_groups)
        else:  # Float16OptimizerWithFloat16Params
            groups = zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for model_group, main_group in groups:
            pairs.extend(zip(model_group, main_group))
    return pairs


def _check_after_load(trainer, model_dir) -> dict:
    """Are the optimizer's main params the loaded weights (bf16 upcast, bit for bit)?"""
    import torch
    from safetensors.torch import load_file

    pairs = _main_param_pairs(trainer.optimizer)
    mismatched = sum(not torch.equal(main, model.detach().float()) for model, main in pairs)
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    exported = dict(trainer.export_hf())
    # The model itself holds the checkpoint in its own dtypes (so the comparison above is against real weights):
    # bf16 everywhere but the norms, which Megatron's local spec builds as torch norms in fp32.
    loaded = all(torch.equal(exported[k], hf[k].to(exported[k].dtype)) for k in hf)
    bf16 = [k for k in hf if exported[k].dtype == torch.bfloat16]
    return {"pairs": len(pairs), "main_mismatched": mismatched, "model_is_checkpoint": loaded,
            "main_dtypes": sorted({str(main.dtype) for _, main in pairs}),
            "bf16_non_norm": all(k in bf16 for k in hf if "norm" not in k)}


def _after_load_child(model_dir: str, distributed: bool) -> dict:
    import torch

    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron

    torch.set_num_threads(1)
    actor = MegatronActor(_bf16_cfg(use_distributed_optimizer=distributed), model_dir)
    result = _check_after_load(actor.trainer, model_dir)
    result["optimizer"] = type(actor.trainer.optimizer.chained_optimizers[0]).__name__
    destroy_megatron()
    return result


@pytest.mark.parametrize("distributed", [False, True], ids=["mixed_precision", "distributed"])
def test_main_params_equal_loaded_weights(tiny_model_dir, distributed):
    with mp.get_context(start_method()).Pool(1) as pool:
        result = pool.apply(_after_load_child, (str(tiny_model_dir), distributed))
    expected = "DistributedOptimizer" if distributed else "Float16OptimizerWithFloat16Params"
    assert result["optimizer"] == expected
    assert result["bf16_non_norm"]
    assert result["main_dtypes"] == ["torch.float32"]
    assert result["model_is_checkpoint"]
    assert result["pairs"] > 0
    assert result["main_mismatched"] == 0


def _dp2_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron

    torch.set_num_threads(1)
    actor = MegatronActor(_bf16_cfg(use_distributed_optimizer=True, lr=1e-7), model_dir)
    result = _check_after_load(actor.trainer, model_dir)
    # Each rank owns a different shard of the main params: together they must cover every element.
    result["main_elements"] = sum(main.numel() for _, main in _main_param_pairs(actor.trainer.optimizer))
    result["model_elements"] = sum(p.numel() for p in actor.trainer.module.parameters() if p.dtype == torch.bfloat16)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_megatron()


@pytest.mark.slow  # two gloo ranks
def test_distributed_optimizer_dp2_main_params_equal_loaded_weights(tiny_model_dir, tmp_path):
    import torch.multiprocessing as tmp

    from asyncflow.models.parallel import free_port

    tmp.start_processes(_dp2_worker, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)),
                        nprocs=2, join=True, start_method=start_method())
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 2
    for r in results:
        assert r["model_is_checkpoint"] and r["pairs"] > 0
        assert r["main_mismatched"] == 0
    # The shards of the bf16 parameters partition them between the ranks (the fp32 norms have no main copy).
    assert sum(r["main_elements"] for r in results) == results[0]["model_elements"]
    assert max(r["main_elements"] for r in results) < results[0]["model_elements"]


def _sharp_model(model_dir: Path, out: Path) -> Path:
    """The tiny model with its output layer scaled up: peaked next-token distributions, so that a model that
    lost its weights is far (in KL) from the one it should be; the random tiny model is nearly uniform."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 100
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _full_logprobs(trainer, tokens):
    """log-softmax over the real vocabulary at every position [b, s, vocab] (TP=1: the whole vocabulary)."""
    import torch

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = trainer.model(tokens, positions, None)
    return torch.log_softmax(logits[..., : trainer.arch.vocab_size].float(), dim=-1)


def _kl_child(model_dir: str, distributed: bool) -> dict:
    import torch

    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron

    torch.set_num_threads(1)
    actor = MegatronActor(_bf16_cfg(lr=1e-7, use_distributed_optimizer=distributed), model_dir)
    # The reference policy: a frozen bf16 model from the same checkpoint, as the workflow builds it.
    reference = MegatronActor(_bf16_cfg(), model_dir, trainable=False)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, actor.arch.vocab_size, (4, 12), generator=gen)
    ref = _full_logprobs(reference.trainer, tokens)
    stats = actor.trainer.train_step(tokens, torch.ones(4, 11))
    act = _full_logprobs(actor.trainer, tokens)
    kl = (act.exp() * (act - ref)).sum(-1).mean().item()  # KL(actor || reference) per position
    destroy_megatron()
    return {"kl": kl, "update_ok": stats["update_ok"]}


@pytest.mark.parametrize("distributed", [False, True], ids=["mixed_precision", "distributed"])
def test_kl_to_reference_after_one_tiny_step(tiny_model_dir, tmp_path, distributed):
    model_dir = _sharp_model(Path(tiny_model_dir), tmp_path / "sharp")
    with mp.get_context(start_method()).Pool(1) as pool:
        result = pool.apply(_kl_child, (str(model_dir), distributed))
    assert result["update_ok"]
    # lr 1e-7 moves each weight by about 1e-7, well under half a bf16 ulp of any weight here: the actor
    # stays the reference up to rounding. A model that went back to its random initial weights is
    # several nats away from the sharp reference.
    assert result["kl"] < 1e-3

