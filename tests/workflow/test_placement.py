"""The device layout of clusters, on a local Ray cluster that declares accelerators this machine does not have,
with the fake engines (``asyncflow.engines.fake``): the placement is the workflow's, the engines only have to
join their groups where they are put.

Checked: each trainer rank gets its own device, rollout engines get theirs, the reference shares the actor's
devices, and the trainer groups (TP=2) form at their rank 0's node address.
"""

from pathlib import Path

from asyncflow.config import load_config
from tests.recipe_runs import FAKE

REPO = Path(__file__).resolve().parents[2]


def test_device_layout_places_ranks_on_their_own_devices(tiny_model_dir, tmp_path, shared_ray):
    """On NPUs (the colocated test below declares GPUs): the layout depends on the resource name only."""
    import ray

    from asyncflow.workflow.pipeline import start_pipeline

    accelerator = "NPU"
    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
        f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE,
        f"ray.accelerator={accelerator}", "ray.local_devices=4", "ray.num_cpus=4", "ray.cpus_per_device=1",
        "trainer.tensor_parallel=2", "workflow.steps=2", "workflow.prompts_per_step=16"])
    pipe = start_pipeline(cfg, Path(tiny_model_dir), max_prompt_len=6)
    try:
        where = {name: [ray.get(h.where.remote()) for h in group] for name, group in pipe.groups.items()}
    finally:
        pipe.close()
    rollout = where["rollout"][0]["devices"][accelerator]
    actor = [w["devices"][accelerator] for w in where["actor"]]
    assert len(rollout) == 1 and all(len(ids) == 1 for ids in actor)
    assert len({ids[0] for ids in actor}) == 2 and not set(rollout) & {ids[0] for ids in actor}
    assert [w["devices"][accelerator] for w in where["reference"]] == actor  # takes turns on the actor's devices
    assert not where["reward"][0]["devices"] and not where["advantage"][0]["devices"]
    # The group meets at the node of its rank 0 (the CPU layout uses 127.0.0.1 instead).
    assert {w["master_addr"] for w in where["actor"]} == {where["actor"][0]["node_ip"]}
    # Each group has one port (looked up on its rank 0's node), and the two groups do not share it.
    ports = {name: {w["master_port"] for w in where[name]} for name in ("actor", "reference")}
    assert all(len(p) == 1 and None not in p for p in ports.values()) and ports["actor"] != ports["reference"]


def _colocated_cfg(tiny_model_dir, tmp_path, *extra):
    return load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
        f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path / 'run'}", *FAKE, "ray.accelerator=GPU",
        "ray.local_devices=4", "ray.num_cpus=4", "ray.cpus_per_device=1", "workflow.mode=sync",
        "trainer.tensor_parallel=2", "workflow.rollout_instances=2", "trainer.reference_placement=own",
        "workflow.steps=2", "workflow.prompts_per_step=8", *extra])


def test_sync_on_devices_colocates_rollout_with_the_trainer(tiny_model_dir, tmp_path, shared_ray):
    """The colocated baseline: rollout engine i runs on trainer device i; a reference placed ``own`` gets
    devices of its own."""
    import ray

    from asyncflow.workflow.pipeline import start_pipeline

    pipe = start_pipeline(_colocated_cfg(tiny_model_dir, tmp_path), Path(tiny_model_dir), max_prompt_len=6)
    try:
        where = {name: [ray.get(h.where.remote()) for h in group] for name, group in pipe.groups.items()}
    finally:
        pipe.close()
    actor = [w["devices"]["GPU"] for w in where["actor"]]
    reference = [w["devices"]["GPU"] for w in where["reference"]]
    assert all(len(ids) == 1 for ids in actor + reference) and len({ids[0] for ids in actor}) == 2
    assert not {ids[0] for ids in reference} & {ids[0] for ids in actor}  # its own devices
    # Engine i takes turns on trainer rank i's device: Ray's share and the devices vLLM is shown agree.
    assert [w["devices"]["GPU"] for w in where["rollout"]] == actor
    assert [w["visible"] for w in where["rollout"]] == [ids[0] for ids in actor]


# The colocated baseline's memory swap between phases is checked on the run of tests/tools/test_gpu_check.py
# (the GPU check's sync run, on one declared device).
