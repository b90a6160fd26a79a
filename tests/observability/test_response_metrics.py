"""The per-step response metrics: length statistics and clip ratio of the trained responses, and the policy's entropy
reported whether or not the loss has an entropy bonus (its gradient only with the bonus)."""

import math

import pytest
import torch

from asyncflow.algorithms.objective import make_objective
from asyncflow.config import AlgorithmConfig
from asyncflow.observability import keys
from asyncflow.workflow.train_services import response_metrics


def test_response_metrics_hand_computed():
    m = response_metrics([4, 1, 4, 3], max_new_tokens=4)
    assert m == {keys.RESPONSE_LEN_MEAN: 3.0, keys.RESPONSE_LEN_MAX: 4.0, keys.RESPONSE_LEN_MIN: 1.0,
                 keys.CLIP_RATIO: 0.5}
    assert response_metrics([2, 3], max_new_tokens=8)[keys.CLIP_RATIO] == 0.0
    assert response_metrics([], max_new_tokens=8) == {}  # a replica with no rows reports nothing


def _micro_batch(entropy: torch.Tensor) -> dict:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return {"mask": mask, "advantages": torch.tensor([[1.0, 1.0, 0.0]]), "behaviour_logprobs": torch.zeros(1, 3),
            "lag": torch.zeros(1, dtype=torch.long), "entropy": entropy}


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_entropy_is_reported_and_only_a_bonus_moves_the_loss(coef):
    loss_fn = make_objective(AlgorithmConfig(entropy_coef=coef, kl_coef=0.0), max_response_tokens=3)
    assert loss_fn.needs_entropy and loss_fn.entropy_grad == (coef > 0)
    logprobs = torch.log(torch.full((1, 3), 0.5))
    entropy = torch.tensor([[math.log(2), math.log(4), 9.0]])  # the padded position must not count
    loss, metrics = loss_fn(logprobs, _micro_batch(entropy))
    base, _ = loss_fn(logprobs, {k: v for k, v in _micro_batch(entropy).items() if k != "entropy"})
    assert float(metrics["entropy_sum"]) == pytest.approx(math.log(2) + math.log(4))
    assert float(loss) == pytest.approx(float(base) - coef * (math.log(2) + math.log(4)))
