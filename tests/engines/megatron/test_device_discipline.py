"""Every tensor that enters the model, a loss or a collective is on the engine's device; results come back on CPU.

The engine is told its device is ``cuda:0`` (``engine_device`` patched in the child, as a GPU rank would
return); Megatron's CPU patches map that device back to the CPU, and ``device_probe.DeviceProbe`` keeps
the shadow device each tensor would have on a GPU machine. Covered, on one gloo process with the real
Megatron engine: the reference forward (``compute_logprobs``), two actor steps with the real GRPO/PPO
objective (KL and entropy terms on, the second epoch reusing the first's ``old_logprobs``), the critic's
values and value-loss step, and the normaliser's ``all_reduce`` in ``MegatronActor.train_step``.

Collectives seen: the normaliser's two ``all_reduce`` calls, Megatron's vocab-parallel cross entropy and
``finalize_model_grads`` / the optimizer's reductions. Not exercised here: ``token_entropy``'s
``all_reduce`` (it runs only at TP > 1, which needs two processes), pipeline send/recv (PP > 1) and the
weight bridge. What no CPU run can show: anything CUDA itself does (kernels, NCCL, streams, memory) and
Megatron's own device choices, which the probe trusts; only a GPU run proves those.

This test failed on the code before the engine moved tensors (tokens, positions and the normaliser made
on the CPU and never moved, results handed back on the device, the critic's value head made on the CPU),
with 44 violations, among them::

    embedding mixes host and engine tensors at asyncflow/engines/megatron/trainer.py:243
    host tensor (2, 16) enters the actor model at asyncflow/engines/megatron/trainer.py:243
    host tensor (2, 15) enters the actor loss at asyncflow/engines/megatron/trainer.py:235
    host tensor (1,) enters torch.distributed.all_reduce at asyncflow/engines/megatron/actor.py:59
    linear mixes host and engine tensors at asyncflow/engines/megatron/trainer.py:333
    compute_logprobs returns an engine tensor (4, 15) (not moved to CPU)
"""

import multiprocessing as mp

import pytest
import torch

from asyncflow.transfer_queue.batch import Batch, BatchMeta

pytestmark = pytest.mark.slow  # every test reads a module fixture of spawned Megatron ranks

ROWS, MBS = 4, 2


def _batches(critic_values=None) -> list[Batch]:
    """Four rows of ragged prompts and responses, as the TransferQueue hands them over (CPU)."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for i in range(ROWS):
        prompt = torch.randint(4, 19, (3 + i % 2,), generator=gen)
        response = torch.randint(4, 19, (2 + i,), generator=gen)
        rows.append({"prompt_ids": prompt, "response_ids": response,
                     "behaviour_logprobs": -torch.rand(len(response), generator=gen),
                     "ref_logprobs": -torch.rand(len(response), generator=gen),
                     "returns": torch.rand(len(response), generator=gen)})
    for i, row in enumerate(rows):
        row["advantages"] = float(i % 3) - 1.0
        if critic_values is not None:
            row["values"] = critic_values[i]
    out = []
    for start in range(0, ROWS, MBS):
        part = rows[start:start + MBS]
        data = {k: [r[k] for r in part] for k in part[0]}
        data["advantages"] = torch.tensor(data["advantages"])
        out.append(Batch(BatchMeta("p", "actor", list(range(start, start + MBS)), versions=[0] * MBS), data))
    return out


def _child(model_dir: str) -> dict:
    torch.set_num_threads(1)
    import megatron_patches

    megatron_patches.apply()  # first: the probe must sit above the patches' device mode
    from asyncflow.models import device

    device.engine_device = lambda: torch.device("cuda", 0)  # what rank 0 of a GPU machine gets
    from asyncflow.algorithms.objective import make_objective, make_value_objective
    from asyncflow.config import AlgorithmConfig, MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.engines.megatron.critic import MegatronCritic
    from asyncflow.models.parallel import destroy_megatron
    from asyncflow.workflow.batching import pack_tokens, response_slices, to_critic_micro_batch, to_micro_batch
    from tests.engines.megatron.device_probe import DeviceProbe

    cfg = MegatronConfig(micro_batch_size=MBS, lr=1e-3)
    algo = AlgorithmConfig(kl_coef=0.1, kl_mode="loss", entropy_coef=0.01)
    seq = 16
    with DeviceProbe() as probe:  # tensors made before it would count as engine tensors
        batches = _batches()
        prompts = [p for b in batches for p in b["prompt_ids"]]
        responses = [r for b in batches for r in b["response_ids"]]
        tokens, _ = pack_tokens(prompts, responses, seq, 0)
        actor = MegatronActor(cfg, model_dir)
        probe.watch_model(actor.trainer.model.module, "the actor model")
        probe.expect_host("compute_logprobs", actor.compute_logprobs(tokens))

        loss_fn = probe.checked_loss(make_objective(algo, max_response_tokens=8), "the actor loss")
        micro = [to_micro_batch(b, seq, 0, train_version=0, fixed_shape=False) for b in batches]
        first = actor.train_step(iter(micro), len(micro), loss_fn)
        for mb, out in zip(micro, first["micro"]):  # the second epoch, as ActorService runs it
            mb["old_logprobs"] = out["old_logprobs"]
        second = actor.train_step(iter(micro), len(micro), loss_fn)
        probe.expect_host("MegatronActor.train_step", first["micro"], second["micro"])

        critic = MegatronCritic(cfg, model_dir)
        probe.watch_model(critic.trainer.model.module, "the critic model")
        values = critic.compute_values(tokens)
        probe.expect_host("compute_values", values)
        critic_batches = _batches(response_slices(values, prompts, responses))
        critic_micro = [to_critic_micro_batch(b, seq, 0, fixed_shape=False) for b in critic_batches]
        value_loss = probe.checked_loss(make_value_objective(algo), "the critic loss")
        critic.train_step(iter(critic_micro), len(critic_micro), value_loss)
    destroy_megatron()
    return {"violations": sorted(set(probe.violations)), "entries": probe.entries,
            "collectives": sorted(set(probe.collectives))}


@pytest.fixture(scope="module")
def result(tiny_model_dir):
    # Spawn, not tests.forkserver: the child patches engine_device before it imports the engine.
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child, (str(tiny_model_dir),))


def test_the_probe_saw_every_entry_point(result):
    entries = result["entries"]
    # compute_logprobs + 2 steps x 2 micro-batches; compute_values + 2 micro-batches
    assert entries["the actor model"] == 2 + 4 and entries["the critic model"] == 2 + 2
    assert entries["the actor loss"] == 4 and entries["the critic loss"] == 2
    callers = [caller for name, caller in result["collectives"] if name == "all_reduce"]
    assert any("engines/megatron/actor.py" in c for c in callers), result["collectives"]  # the normaliser


def test_no_host_tensor_reaches_the_model_a_loss_or_a_collective(result):
    violations = result["violations"]
    assert not violations, f"{len(violations)} device violations:\n" + "\n".join(violations[:40])
