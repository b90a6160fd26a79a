"""``asyncflow plan`` counts the weight relay's device buffers: a ``bucket_mb`` send buffer on each exporting
trainer rank and one receiving buffer per exporting rank on a rollout device, with the NCCL relay only."""

from pathlib import Path

from asyncflow.planner.plan import plan_recipe

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _terms(plan, task):
    return next(t for t in plan.tasks if t.task == task).terms


def test_plan_counts_the_nccl_relay_buffers_of_sender_and_receiver():
    base = plan_recipe(ROOT / "recipes/qwen3-30b-a3b", ["weight_sync.backend=gloo"])
    nccl = plan_recipe(ROOT / "recipes/qwen3-30b-a3b", ["weight_sync.backend=nccl", "weight_sync.bucket_mb=256"])
    cfg = nccl.recipe.cfg.trainer
    sources = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.expert_parallel
    assert _terms(nccl, "trainer rank")["weight relay buffer"] == 256 * MIB
    assert _terms(nccl, "rollout device")["weight relay buffers"] == sources * 256 * MIB
    for task in ("trainer rank", "rollout device"):  # the totals grow by exactly those buffers
        grown = sum(_terms(nccl, task).values()) - sum(_terms(base, task).values())
        assert grown == (256 * MIB if task == "trainer rank" else sources * 256 * MIB)
    # gloo's buffers are host memory, and a forced shm transport never relays: nothing on the devices
    assert "weight relay buffer" not in _terms(base, "trainer rank")
    shm = plan_recipe(ROOT / "recipes/qwen3-30b-a3b", ["weight_sync.backend=nccl", "weight_sync.transport=shm"])
    assert "weight relay buffers" not in _terms(shm, "rollout device")
