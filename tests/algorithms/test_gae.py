"""GAE, outcome token rewards, masked whitening and value losses against hand-computed values."""

import pytest
import torch

from asyncflow.algorithms import VALUE_LOSSES, gae, outcome_token_rewards, whiten
from asyncflow.algorithms.advantages import compute_advantages, estimator_scope


def test_gae_hand_computed_two_rows_of_different_lengths():
    # gamma = .9, lam = .8, so gamma * lam = .72. The value after the last response token is 0.
    # Row 0 (3 tokens; the padded column holds garbage that must be ignored): r = 0, 0, 1; V = .5, .6, .7
    #   t=2: delta = 1 - .7 = .3                          A2 = .3
    #   t=1: delta = .9 * .7 - .6 = .03                   A1 = .03 + .72 * .3 = .246
    #   t=0: delta = .9 * .6 - .5 = .04                   A0 = .04 + .72 * .246 = .21712
    #   returns = A + V = .71712, .846, 1.0
    # Row 1 (4 tokens): r = .1, 0, 0, -1; V = .2, .4, -.1, .3
    #   t=3: delta = -1 - .3 = -1.3                       A3 = -1.3
    #   t=2: delta = .9 * .3 + .1 = .37                   A2 = .37 - .72 * 1.3 = -.566
    #   t=1: delta = .9 * -.1 - .4 = -.49                 A1 = -.49 - .72 * .566 = -.89752
    #   t=0: delta = .1 + .9 * .4 - .2 = .26              A0 = .26 - .72 * .89752 = -.3862144
    #   returns = -.1862144, -.49752, -.666, -1.0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.1, 0.0, 0.0, -1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, float("nan")], [0.2, 0.4, -0.1, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3, 0.0])
    assert adv[1].tolist() == pytest.approx([-0.3862144, -0.89752, -0.566, -1.3])
    assert ret[0].tolist() == pytest.approx([0.71712, 0.846, 1.0, 0.0])
    assert ret[1].tolist() == pytest.approx([-0.1862144, -0.49752, -0.666, -1.0])


def test_gae_with_gamma_lam_one_and_outcome_rewards_is_score_minus_value():
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    values = torch.randn(3, 5, generator=gen)
    scores = torch.tensor([1.0, -0.5, 2.0])
    adv, ret = gae(outcome_token_rewards(scores, mask), values, mask)
    assert torch.allclose(ret, scores[:, None] * mask)
    assert torch.allclose(adv, (scores[:, None] - values) * mask, atol=1e-6)


def test_outcome_token_rewards_places_score_on_last_token_and_subtracts_kl():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    scores = torch.tensor([2.0, -1.0, 7.0])
    assert outcome_token_rewards(scores, mask).tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]
    kl = torch.tensor([[0.5, 1.0, 9.0], [0.0, 2.0, -1.0], [1.0, 1.0, 1.0]])
    rewards = outcome_token_rewards(scores, mask, kl=kl, kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.9, 0.0], [0.0, -0.2, -0.9], [0.0, 0.0, 0.0]]))


def test_whiten_is_masked():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = whiten(values, mask)
    kept = out[mask > 0]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-6)
    assert out[0, 2].item() == 0.0
    # entries 1..5: mean 3, unbiased std sqrt(2.5)
    assert kept.tolist() == pytest.approx([(v - 3) / 2.5**0.5 for v in (1, 2, 3, 4, 5)])
    unshifted = whiten(values, mask, shift_mean=False)[mask > 0]
    assert unshifted.tolist() == pytest.approx([(v - 3) / 2.5**0.5 + 3 for v in (1, 2, 3, 4, 5)])


def test_value_losses_hand_computed():
    # clip .2. token 0: v=1, old=.5 -> clipped .7, R=2: max((1-2)^2, (.7-2)^2) = 1.69 -> .845 (clip binds)
    #          token 1: v=.5, old=.45 (inside the clip), R=0: .25 both -> .125
    #          token 2: v=1, old=.5 -> clipped .7, R=0: max(1, .49) = 1 -> .5 (clipped, but does not bind)
    values = torch.tensor([[1.0, 0.5, 1.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.45, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    loss, info = VALUE_LOSSES.get("clipped")(values, old, returns, clip=0.2)
    assert loss[0].tolist() == pytest.approx([0.845, 0.125, 0.5])
    assert info["clip_frac"][0].tolist() == [1.0, 0.0, 0.0]
    loss.sum().backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5, 1.0])  # d/dv .5 (v-R)^2 = v-R unless clipped
    mse, _ = VALUE_LOSSES.get("mse")(values, old, returns, clip=0.2)
    assert mse[0].tolist() == pytest.approx([0.5, 0.125, 0.5])


def test_gae_is_a_critic_scoped_registry_marker():
    assert estimator_scope("gae") == "critic"
    with pytest.raises(TypeError, match="critic values"):
        compute_advantages("gae", [1.0, 0.0], [0, 0])


def test_objective_entropy_bonus_and_value_objective_hand_computed():
    from asyncflow.algorithms.objective import make_objective, make_value_objective
    from asyncflow.config import AlgorithmConfig

    mb = {"mask": torch.tensor([[1.0, 1.0, 0.0]]), "advantages": torch.tensor([[1.0, 1.0, 0.0]]),
          "behaviour_logprobs": torch.zeros(1, 3), "lag": torch.tensor([0]),
          "entropy": torch.tensor([[0.5, 1.5, 9.0]])}
    logprobs = torch.zeros(1, 3)
    plain = make_objective(AlgorithmConfig(kl_coef=0.0, policy_loss="ppo"), 3)
    bonus = make_objective(AlgorithmConfig(kl_coef=0.0, policy_loss="ppo", entropy_coef=0.1), 3)
    # The trainer computes the entropy for every step's metric (actor/entropy); its gradient only for the bonus.
    assert plain.needs_entropy and bonus.needs_entropy and not plain.entropy_grad and bonus.entropy_grad
    loss0, metrics0 = plain(logprobs, mb)
    loss1, metrics = bonus(logprobs, mb)
    # ratio 1, advantage 1 -> -1 per token, 2 tokens; the bonus subtracts 0.1 x (0.5 + 1.5), masked token ignored
    assert loss0.item() == pytest.approx(-2.0) and loss1.item() == pytest.approx(-2.2)
    assert metrics["entropy_sum"].item() == pytest.approx(2.0) and metrics["normalizer"].item() == 2
    assert metrics0["entropy_sum"].item() == pytest.approx(2.0)  # reported without the bonus, which leaves the loss

    value = make_value_objective(AlgorithmConfig(value_loss="mse"))
    vmb = {"mask": torch.tensor([[1.0, 1.0, 0.0]]), "returns": torch.tensor([[1.0, 0.0, 5.0]]),
           "old_values": torch.zeros(1, 3)}
    loss, metrics = value(torch.tensor([[0.5, 0.5, 0.0]]), vmb)
    assert loss.item() == pytest.approx(0.5 * 0.25 * 2)  # 0.5 (v - R)^2 on the two response tokens
    assert metrics["normalizer"].item() == 2 and metrics["abs_err_sum"].item() == pytest.approx(1.0)
