"""Advantage estimators, policy losses, KL estimators and aggregation against hand-computed values."""

import math

import pytest
import torch

from asyncflow.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, aggregate, compute_advantages, kl_penalty
from asyncflow.registry import Registry, RegistryError, load_object


def test_grpo_advantages_hand_computed():
    # group 0: rewards 1, 0 -> mean .5, std (unbiased) .7071; group 1: all equal -> 0 advantage
    adv = compute_advantages("grpo", [1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1], eps=0.0)
    s = math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0])
    no_std = compute_advantages("grpo", [1.0, 0.0, 0.25, 0.75], [7, 7, 3, 3], norm_by_std=False)
    assert no_std.tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25])


def test_ppo_clip_hand_computed():
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    loss, info = POLICY_LOSSES.get("ppo")(lp, old, old, adv, clip_low=0.2, clip_high=0.2)
    # ratio 1.5 -> clipped 1.2 (min of 1.5, 1.2) ; ratio .5 -> min(.5, .8) = .5
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5])
    assert info["clip_frac"].tolist() == [[1.0, 1.0]]
    loss_neg, _ = POLICY_LOSSES.get("ppo")(lp, old, old, -adv)
    # negative advantage: -min(-1.5, -1.2) = 1.5 ; -min(-.5, -.8) = .8
    assert loss_neg[0].tolist() == pytest.approx([1.5, 0.8])


def test_decoupled_ppo_weights_by_truncated_proximal_over_behaviour():
    lp = torch.zeros(1, 3, requires_grad=True)
    prox = torch.zeros(1, 3)
    behaviour = torch.log(torch.tensor([[1.0, 0.5, 0.1]]))  # weights 1, 2, 10 -> capped at 2
    adv = torch.ones(1, 3)
    loss, info = POLICY_LOSSES.get("decoupled_ppo")(lp, prox, behaviour, adv, is_cap=2.0)
    assert info["is_weight"][0].tolist() == pytest.approx([1.0, 2.0, 2.0])
    assert loss[0].tolist() == pytest.approx([-1.0, -2.0, -2.0])
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -2.0, -2.0])  # weight is detached


def test_tis_gradient_is_truncated_ratio_times_advantage():
    lp = torch.log(torch.tensor([[0.5, 0.9]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25, 0.1]]))  # ratios 2, 9 -> capped at 3
    loss, info = POLICY_LOSSES.get("tis")(lp, lp.detach(), behaviour, torch.ones(1, 2), is_cap=3.0)
    assert info["is_weight"][0].tolist() == pytest.approx([2.0, 3.0])
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-2.0, -3.0])


def test_kl_estimators():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert kl_penalty("k1", lp, ref).item() == pytest.approx(math.log(2))
    assert kl_penalty("k2", lp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty("k3", lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_penalty("k3", ref, ref).item() == 0.0


def test_aggregation_modes_sum_over_micro_batches():
    per_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_tok, mask, "token-mean", 4, 2).item() == pytest.approx(10 / 4)
    assert aggregate(per_tok, mask, "seq-mean-token-mean", 4, 2).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_tok, mask, "seq-mean-token-sum", 4, 2, max_tokens=3).item() == pytest.approx((6 + 4) / 3 / 2)
    halves = sum(aggregate(per_tok[i : i + 1], mask[i : i + 1], "token-mean", 4, 2) for i in range(2))
    assert halves.item() == pytest.approx(10 / 4)  # split-invariant
    with pytest.raises(ValueError, match="valid: token-mean"):
        aggregate(per_tok, mask, "mean", 4, 2)


def test_registry_errors_list_valid_names_and_dotted_paths_load():
    with pytest.raises(RegistryError, match="valid: gae, grpo"):
        ADVANTAGE_ESTIMATORS.get("gae-typo")
    assert ADVANTAGE_ESTIMATORS.resolve("asyncflow.algorithms.advantages:grpo") is ADVANTAGE_ESTIMATORS.get("grpo")
    with pytest.raises(RegistryError, match="cannot import"):
        load_object("no_such_pkg.mod:fn")
    reg = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a")(sum)


def test_rloo_hand_computed():
    # group 0: rewards 1, 0, 0.5 -> leave-one-out baselines 0.25, 0.75, 0.5
    adv = compute_advantages("rloo", [1.0, 0.0, 0.5, 0.3], [0, 0, 0, 9])
    assert adv.tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0])  # a singleton group has no baseline


def test_reinforce_plus_plus_whitens_over_the_batch():
    adv = compute_advantages("reinforce_pp", [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], eps=0.0)
    s = math.sqrt(1 / 3)  # unbiased std of [.5, -.5, .5, -.5]
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s])
    base = compute_advantages("reinforce_pp_baseline", [1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], eps=0.0)
    # centred per group: .5, -.5, 0, 0 -> whitened over the batch (mean 0, std sqrt(1/6))
    s = math.sqrt(1 / 6)
    assert base.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0])


def test_estimator_scopes():
    from asyncflow.algorithms.advantages import estimator_scope

    assert estimator_scope("grpo") == "group" and estimator_scope("rloo") == "group"
    assert estimator_scope("reinforce_pp") == "batch" and estimator_scope("reinforce_pp_baseline") == "batch"
