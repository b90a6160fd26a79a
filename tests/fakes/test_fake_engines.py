"""The fake engines (``asyncflow.engines.fake``) keep the promises the workflow tests rely on: trainer and rollout
compute the same function of the same version, bit for bit; a training step changes it; a version reaches the
rollout only through the staging segment, and a torn or overwritten read is detected; segments are removed."""

from pathlib import Path

import pytest
import torch

from asyncflow.algorithms.objective import make_objective
from asyncflow.bridge.staging import StaleStagingError
from asyncflow.config import AlgorithmConfig, MegatronConfig, VllmConfig
from asyncflow.engines.fake import FakeCriticEngine, FakeRolloutEngine, FakeTrainEngine
from asyncflow.workflow.batching import pack_tokens


@pytest.fixture
def engines(tiny_model_dir):
    trainer = FakeTrainEngine(MegatronConfig(lr=0.05), tiny_model_dir)
    rollout = FakeRolloutEngine(VllmConfig(max_new_tokens=6, max_num_seqs=4), tiny_model_dir)
    return trainer, rollout


def _trainer_logprobs(trainer, samples) -> list[torch.Tensor]:
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    tokens, _ = pack_tokens(prompts, responses, max(len(p) + len(r) for p, r in zip(prompts, responses)), 0)
    out = trainer.compute_logprobs(tokens)
    return [out[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]


def _train_once(trainer, samples) -> None:
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    tokens, mask = pack_tokens(prompts, responses, max(len(p) + len(r) for p, r in zip(prompts, responses)), 0)
    behaviour = torch.zeros_like(mask)
    for i, (p, s) in enumerate(zip(prompts, samples)):
        behaviour[i, len(p) - 1 : len(p) - 1 + len(s.response_ids)] = torch.tensor(s.response_logprobs)
    mb = {"tokens": tokens, "mask": mask, "behaviour_logprobs": behaviour,
          "advantages": torch.linspace(-1, 1, len(samples))[:, None] * mask, "lag": torch.zeros(len(samples))}
    out = trainer.train_step(iter([mb]), 1, make_objective(AlgorithmConfig(kl_coef=0.0), 6))
    assert out["grad_norm"] > 0 and len(out["micro"]) == 1


def test_rollout_and_trainer_agree_on_every_version_that_went_through_the_segment(engines):
    trainer, rollout = engines
    prompts = [[2, 5, 6, 7, 8, 18], [2, 9, 4, 4, 1, 18], [2, 4, 4, 5, 6, 18]]
    samples = rollout.generate(prompts, n=2)
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(2)]
    for got, sample in zip(_trainer_logprobs(trainer, samples), samples):
        assert torch.equal(got, torch.tensor(sample.response_logprobs))  # the same bits, not merely close
    writer, plan = trainer.weight_stager(1.0, "t")
    try:
        _train_once(trainer, samples)
        trainer.version += 1
        changed = _trainer_logprobs(trainer, samples)
        assert not torch.equal(changed[0], torch.tensor(samples[0].response_logprobs))
        writer.stage(1)
        staging = {"plan": plan, "segments": {"0.0.0": writer.segment}}
        stats = rollout.apply_staged(staging, 1)
        assert rollout.weight_version == 1 and stats["buckets"] == 1 and stats["bytes_per_rank"][0] > 0
        fresh = rollout.generate(prompts, n=1)
        assert all(s.weight_version == 1 for s in fresh)
        for got, sample in zip(_trainer_logprobs(trainer, fresh), fresh):
            assert torch.equal(got, torch.tensor(sample.response_logprobs))
        # Version 3 overwrote slot 1: reading version 1 from it again is detected, not applied.
        writer.stage(2)
        writer.stage(3)
        with pytest.raises(StaleStagingError):
            rollout.apply_staged(staging, 1)
        assert rollout.weight_version == 1
    finally:
        writer.close()
    assert not Path("/dev/shm", writer.segment).exists()


def test_stream_swaps_weights_at_a_token_boundary(engines):
    trainer, rollout = engines
    stream = rollout.stream(ignore_eos=True)
    for i in range(6):  # more than the 4 slots: the rest wait
        stream.add(i, [2, 1 + i, 5, 6, 7, 18], 6)
    assert stream.running() == 4 and stream.free == 0
    stream.step()
    rollout.version = 7  # what an apply would set; the table is unchanged here
    stream.swap_weights(lambda: None)
    done = []
    while len(stream):
        done += stream.step()
    assert len(done) == 6
    spanning = [s for _, s in done if len(set(s.token_versions)) == 2]
    assert spanning and all(s.weight_version == 0 and s.token_versions[-1] == 7 for s in spanning)


def test_critic_starts_at_zero_and_learns_values(tiny_model_dir):
    from asyncflow.algorithms.objective import make_value_objective

    critic = FakeCriticEngine(MegatronConfig(lr=0.1), tiny_model_dir)
    tokens = torch.tensor([[2, 5, 6, 7, 8, 18, 6, 7]])
    assert torch.equal(critic.compute_values(tokens), torch.zeros(1, 7))
    mask = torch.ones(1, 7)
    mb = {"tokens": tokens, "mask": mask, "old_values": torch.zeros(1, 7), "returns": torch.ones(1, 7)}
    for _ in range(5):
        critic.train_step(iter([mb]), 1, make_value_objective(AlgorithmConfig()))
    assert critic.compute_values(tokens).mean() > 0.1


def test_faults_come_from_the_environment(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ASYNCFLOW_FAKE_FAIL_APPLY", "2")
    monkeypatch.setenv("ASYNCFLOW_FAKE_TOKEN_S", "0.001")
    rollout = FakeRolloutEngine(VllmConfig(), tiny_model_dir)
    assert rollout.faults.token_s == 0.001 and rollout.faults.die_applying is None
    with pytest.raises(RuntimeError, match="weight version 3"):
        rollout.apply_staged({"plan": {}, "segments": {}}, 3)
    assert rollout.weight_version == 0


def test_the_table_optimizer_makes_torch_adams_updates_and_state():
    """The fake trainers' Adam (torch's functional Adam, without ``torch.optim.Optimizer`` and its import of
    ``torch._dynamo``) moves the table as ``torch.optim.Adam`` does, bit for bit, and keeps the same state."""
    from asyncflow.engines.fake import _TableAdam

    start = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    table_adam, torch_adam = _TableAdam(ours, 0.05, (0.9, 0.98)), torch.optim.Adam([theirs], lr=0.05, betas=(0.9, 0.98))
    for step in range(12):
        for param, opt in ((ours, table_adam), (theirs, torch_adam)):
            opt.zero_grad()
            ((param ** 3).sum() + step * param.sum()).backward()
            opt.step()
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, start)
    state, reference = table_adam.state_dict(), torch_adam.state_dict()["state"][0]
    assert all(torch.equal(state[k], reference[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    restored = _TableAdam(torch.nn.Parameter(ours.detach().clone()), 0.05, (0.9, 0.98))
    restored.load_state_dict(state)
    assert all(torch.equal(restored.state_dict()[k], state[k]) for k in state)
