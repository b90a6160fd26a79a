"""The Megatron critic: a value head on the policy's model family, at its own TP/PP.

Values and a value-loss training step at TP=2 and PP=2 (gloo processes) match TP=1; the trunk is loaded
from the Hugging Face checkpoint, the lm_head is not used, and the value head starts at zero.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow.models.parallel import free_port
from tests.engines.megatron.dist_harness import fixed_batch
from tests.forkserver import start_method

TOL = 1e-5


def _worker(rank, world, port, tp, pp, model_dir, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.algorithms.objective import make_value_objective
    from asyncflow.config import AlgorithmConfig, CriticConfig
    from asyncflow.engines.megatron.critic import MegatronCritic
    from asyncflow.models.parallel import destroy_megatron

    critic = MegatronCritic(CriticConfig(tensor_parallel=tp, pipeline_parallel=pp, micro_batch_size=2, lr=1e-2),
                            model_dir)
    head = critic.trainer.model.module.output_layer if pp == 1 or rank >= world // 2 else None
    zero_at_start = None
    if head is not None:  # the last stage: same seeded head on every rank, so the runs are comparable
        zero_at_start = bool((head.weight == 0).all() and (head.bias == 0).all())
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    tokens, mask = fixed_batch()
    before = critic.compute_values(tokens)
    returns = torch.linspace(0, 1, mask.shape[1]).expand_as(mask).contiguous()
    old = before if before is not None else torch.zeros_like(mask)
    micro = [{"tokens": tokens[i:i + 2], "mask": mask[i:i + 2], "returns": returns[i:i + 2],
              "old_values": old[i:i + 2]} for i in range(0, 8, 2)]
    stats = critic.train_step(iter(micro), len(micro), make_value_objective(AlgorithmConfig(value_clip=10.0)))
    after = critic.compute_values(tokens)
    if before is not None:
        vf = sum(float(o["vf_sum"]) for o in stats["micro"]) / stats["normalizer"]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(
            {"before": before.tolist(), "after": after.tolist(), "vf": vf, "zero_at_start": zero_at_start}))
    destroy_megatron()


def _run(tp, pp, model_dir, out_dir) -> list[dict]:
    out_dir.mkdir(parents=True)
    mp.start_processes(_worker, args=(tp * pp, free_port(), tp, pp, str(model_dir), str(out_dir)), nprocs=tp * pp,
                       join=True, start_method=start_method())
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    return _run(1, 1, tiny_model_dir, tmp_path_factory.mktemp("critic") / "tp1")[0]


@pytest.mark.slow
def test_critic_learns_and_starts_from_zero(reference):
    assert reference["zero_at_start"]
    before, after = torch.tensor(reference["before"]), torch.tensor(reference["after"])
    assert before.abs().max() > 1e-3 and (before - after).abs().max() > 1e-3  # the step moved the values
    assert reference["vf"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_critic_parallel_matches_tp1(reference, tiny_model_dir, tmp_path, tp, pp):
    results = _run(tp, pp, tiny_model_dir, tmp_path / "out")
    assert len(results) == tp
    for res in results:
        assert res["vf"] == pytest.approx(reference["vf"], abs=TOL)
        for key in ("before", "after"):
            diff = (torch.tensor(res[key]) - torch.tensor(reference[key])).abs().max().item()
            assert diff < TOL, f"{key}: max |diff| {diff}"
