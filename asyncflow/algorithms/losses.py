"""Policy and value losses, KL estimators, loss aggregation (``POLICY_LOSSES``, ``VALUE_LOSSES``, ``KL_ESTIMATORS``).

All tensors are per token, ``[b, t]``, aligned so that position ``t`` scores response token ``t``;
``mask`` is 1 on response tokens. A policy loss returns the per-token loss (aggregated by
``aggregate``) and a dict of per-token diagnostics (off-policy losses: ``is_weight``, the truncated
importance weight, and ``is_truncated``, 1 where the cap cut it); so does a value (critic) loss,
``fn(values, old_values, returns, *, clip) -> (per_token_loss, info)``.

Off-policy correction (``max_staleness >= 1``): rollout logprobs (``behaviour``) come from weights up
to k versions old. ``decoupled_ppo`` clips against the *proximal* policy (the trainer's weights at the
start of the step) and re-weights by the truncated importance ratio proximal/behaviour; ``tis`` is a
policy gradient with the truncated ratio current/behaviour. With k = 0 both reduce to PPO.
"""

from __future__ import annotations

import torch

from asyncflow.registry import Registry

POLICY_LOSSES = Registry("policy loss")
VALUE_LOSSES = Registry("value loss")
KL_ESTIMATORS = Registry("KL estimator")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    clip_frac = ((ratio - clipped).abs() > 0).float()
    return loss, ratio, clip_frac


def _truncated_weight(target_logprobs, behaviour_logprobs, is_cap):
    """``min(target/behaviour, is_cap)`` per token (detached) and 1.0 where the cap cut the ratio."""
    raw = torch.exp(target_logprobs.detach() - behaviour_logprobs)
    return raw.clamp(max=is_cap), (raw > is_cap).float()


@POLICY_LOSSES.register("ppo")
def ppo(logprobs, old_logprobs, behaviour_logprobs, advantages, *, clip_low=0.2, clip_high=0.2, is_cap=2.0):
    """PPO clipped surrogate against ``old_logprobs`` (ignores ``behaviour_logprobs``)."""
    loss, ratio, clip_frac = _clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    return loss, {"ratio": ratio.detach(), "clip_frac": clip_frac}


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(logprobs, old_logprobs, behaviour_logprobs, advantages, *, clip_low=0.2, clip_high=0.2,
                  is_cap=2.0):
    """PPO clipped against the proximal policy, weighted by min(proximal/behaviour, is_cap) (detached)."""
    loss, ratio, clip_frac = _clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    weight, truncated = _truncated_weight(old_logprobs, behaviour_logprobs, is_cap)
    return loss * weight, {"ratio": ratio.detach(), "clip_frac": clip_frac, "is_weight": weight,
                           "is_truncated": truncated}


@POLICY_LOSSES.register("tis")
def truncated_is(logprobs, old_logprobs, behaviour_logprobs, advantages, *, clip_low=0.2, clip_high=0.2,
                 is_cap=2.0):
    """Policy gradient with the truncated importance ratio min(current/behaviour, is_cap) (detached)."""
    weight, truncated = _truncated_weight(logprobs, behaviour_logprobs, is_cap)
    loss = -weight * advantages * logprobs
    return loss, {"is_weight": weight, "is_truncated": truncated}


@VALUE_LOSSES.register("clipped")
def clipped_value_loss(values, old_values, returns, *, clip=0.2):
    """PPO's clipped value loss 0.5 max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2).

    ``clip_frac`` is 1 where the clipped term is the larger one (the clip binds and stops the gradient).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return loss, {"clip_frac": (clipped_loss > unclipped_loss).float()}


@VALUE_LOSSES.register("mse")
def mse_value_loss(values, old_values, returns, *, clip=0.2):
    """0.5 (v - R)^2 (ignores ``old_values`` and ``clip``)."""
    return 0.5 * (values - returns) ** 2, {}


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs, ref_logprobs):
    """log pi - log pi_ref (unbiased, can be negative)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs, ref_logprobs):
    """0.5 (log pi - log pi_ref)^2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs, ref_logprobs):
    """exp(ref - pi) - (ref - pi) - 1: non-negative, low variance (Schulman's k3)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def kl_penalty(name: str, logprobs, ref_logprobs):
    """Per-token KL estimate by estimator ``name``."""
    return KL_ESTIMATORS.resolve(name)(logprobs, ref_logprobs)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: int,
              max_tokens: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the batch loss, so that shares summed over micro-batches give it.

    ``total_tokens`` / ``total_seqs`` are counted over the whole global batch (not the micro-batch), so
    the result does not depend on how the batch was split.
    """
    if mode == "token-mean":
        return (per_token * mask).sum() / max(total_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(total_seqs, 1)
    if mode == "seq-mean-token-sum":
        per_seq = (per_token * mask).sum(-1) / (max_tokens or 1)
        return per_seq.sum() / max(total_seqs, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
