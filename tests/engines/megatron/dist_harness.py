"""Spawn N gloo processes that each build a MegatronTrainer; used by the multi-process tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from asyncflow.models.parallel import free_port
from tests.forkserver import start_method


def fixed_batch(batch: int = 8, seq: int = 12, vocab: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """The same token batch (and loss mask with some positions off) in every process."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq - 1)
    mask[:, :3] = 0  # prompt positions are not trained
    return tokens, mask


def _worker(rank, world, port, tp, pp, model_dir, ckpt_in, ckpt_out, out_dir, steps):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.parallel import destroy_megatron

    trainer = MegatronTrainer(
        MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, micro_batch_size=2, lr=1e-2), model_dir
    )
    if ckpt_in:
        trainer.load_dist_checkpoint(ckpt_in)
    else:
        trainer.load_hf(model_dir)
    if ckpt_out:
        trainer.save_dist_checkpoint(ckpt_out)
    tokens, mask = fixed_batch()
    before = trainer.logprobs(tokens)
    losses = [trainer.train_step(tokens, mask)["loss"] for _ in range(steps)]
    after = trainer.logprobs(tokens)
    if before is not None:  # last pipeline stage
        result = {"losses": losses, "logprobs_before": before.tolist(), "logprobs_after": after.tolist()}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_megatron()


def run(world, tp, pp, model_dir, out_dir, ckpt_in=None, ckpt_out=None, steps=2) -> list[dict]:
    """Run the worker on ``world`` processes; return the results of every last-stage rank."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = (world, free_port(), tp, pp, str(model_dir), ckpt_in and str(ckpt_in),
            ckpt_out and str(ckpt_out), str(out_dir), steps)
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method=start_method())
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
