"""The off-policy correction (``decoupled_ppo``) per token, through the real micro-batch layout, and its
diagnostics (importance-weight mean and max, fraction truncated at ``is_cap``)."""

import math

import pytest
import torch

from asyncflow.algorithms.objective import make_objective
from asyncflow.config import AlgorithmConfig
from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.batching import to_micro_batch
from asyncflow.workflow.train_services import _actor_metrics

PROMPTS = [[1, 2, 3], [4, 5]]
RESPONSES = [[6, 7], [8, 9, 10]]


def _micro_batch(behaviour: list[list[float]]) -> dict:
    meta = BatchMeta(partition="p", task="actor", indexes=[0, 1], versions=[0, 0], group_ids=[0, 0])
    batch = Batch(meta=meta, data={"prompt_ids": PROMPTS, "response_ids": RESPONSES,
                                   "behaviour_logprobs": [torch.tensor(b) for b in behaviour],
                                   "advantages": torch.tensor([1.0, -1.0])})
    return to_micro_batch(batch, seq_len=8, pad_id=0, train_version=1, fixed_shape=True)


def _objective(**kw):
    return make_objective(AlgorithmConfig(kl_coef=0.0, is_cap=2.0, **kw), max_response_tokens=4)


def test_behaviour_logprobs_weight_each_response_token_and_nothing_else():
    # Proximal logprobs are 0 everywhere (the first pass: old = current); behaviour log(1/w) gives weight w.
    weights = [[1.0, 4.0], [0.5, 1.5, 2.0]]
    mb = _micro_batch([[-math.log(w) for w in row] for row in weights])
    logprobs = torch.zeros(2, 7, requires_grad=True)
    loss, metrics = _objective()(logprobs, mb)
    loss.backward()
    # Response token j of a row with a P-token prompt sits at position P-1+j; its gradient is -A x min(w, 2).
    expected = torch.zeros(2, 7)
    expected[0, 2:4] = -torch.tensor([1.0, 2.0])
    expected[1, 1:4] = torch.tensor([0.5, 1.5, 2.0])
    assert torch.allclose(logprobs.grad, expected)
    assert metrics["is_weight_sum"].item() == pytest.approx(1.0 + 2.0 + 0.5 + 1.5 + 2.0)
    assert metrics["is_weight_max"].item() == pytest.approx(2.0)
    assert metrics["is_truncated_sum"].item() == 1.0  # only the 4.0; 2.0 itself is not cut


def test_step_metrics_report_mean_max_and_truncated_fraction():
    fn = _objective()
    outs = []
    for row_weights in ([[1.0, 4.0], [0.5, 1.5, 2.0]], [[3.0, 3.0], [1.0, 1.0, 1.0]]):
        mb = _micro_batch([[-math.log(w) for w in row] for row in row_weights])
        _, metrics = fn(torch.zeros(2, 7), mb)
        outs.append(metrics)
    metrics = _actor_metrics([{"micro": outs, "grad_norm": 0.0}], [mb, mb], 1.0)
    assert metrics["actor/tokens"] == 10
    assert metrics["actor/is_weight_mean"] == pytest.approx((7.0 + 2.0 + 2.0 + 3.0) / 10)
    assert metrics["actor/is_weight_max"] == pytest.approx(2.0)
    assert metrics["actor/is_truncated_frac"] == pytest.approx(3 / 10)


def test_on_policy_rows_have_weight_one_and_nothing_truncated():
    """max_staleness 0: the rollout's logprobs are the proximal policy's, so every weight is exactly 1."""
    behaviour = [[-0.3, -1.2], [-0.1, -2.0, -0.7]]
    mb = _micro_batch(behaviour)
    proximal = mb["behaviour_logprobs"].clone()  # what the trainer recomputes for the same weights
    _, metrics = _objective()(proximal, mb)
    assert metrics["is_weight_sum"].item() == pytest.approx(5.0)
    assert metrics["is_weight_max"].item() == pytest.approx(1.0)
    assert metrics["is_truncated_sum"].item() == 0.0


def test_plain_ppo_reports_no_importance_weights():
    mb = _micro_batch([[-0.3, -1.2], [-0.1, -2.0, -0.7]])
    _, metrics = _objective(policy_loss="ppo")(torch.zeros(2, 7), mb)
    assert "is_weight_sum" not in metrics


def test_micro_batch_without_response_tokens_has_nan_max():
    mb = _micro_batch([[-0.3, -1.2], [-0.1, -2.0, -0.7]])
    mb["mask"] = torch.zeros_like(mb["mask"])
    _, metrics = _objective()(torch.zeros(2, 7), mb)
    assert math.isnan(metrics["is_weight_max"].item())
    assert metrics["is_weight_sum"].item() == 0.0
