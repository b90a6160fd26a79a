"""Advantage estimators (registry ``ADVANTAGE_ESTIMATORS``): sequence-level scores from rewards.

Signature of an estimator: ``fn(rewards [N], group_ids [N], **kwargs) -> advantages [N]``. Each
response's advantage is broadcast over its tokens by the loss. An estimator's ``scope`` says what it
must see at once: ``"group"`` (whole GRPO groups, streamed group by group) or ``"batch"`` (the whole
global batch, e.g. for batch whitening); the advantage task asks the TransferQueue accordingly.
``"critic"`` marks a per-token estimator (GAE) that needs critic values: the advantage task computes
it with ``asyncflow.algorithms.gae`` instead of calling the registered function.

An estimator that never compares a response with the other responses of its prompt sets ``per_sample = True``
(REINFORCE++, GAE): the sample stream (``workflow.mode: stream``) then trains each response on its own, in the step
open when it finishes, instead of waiting for its prompt's whole group (``estimator_per_sample``).
"""

from __future__ import annotations

import torch

from asyncflow.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group std (unbiased, 0 for singletons) and group size."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    var = sq / (counts - 1).clamp(min=1)
    return means[inverse], var.sqrt()[inverse], counts[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO: (r - mean of the prompt's group) / (std of the group + eps); Dr.GRPO without the std."""
    mean, std, _ = _group_stats(rewards.double(), group_ids)
    adv = rewards.double() - mean
    if norm_by_std:
        denom = std + eps
        # A group whose rewards are all equal has no signal: 0, never 0/0 (eps may be 0).
        adv = torch.where(denom > 0, adv / denom.clamp(min=1e-30), torch.zeros_like(adv))
    return adv.to(rewards.dtype)


grpo.scope = "group"


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean reward of the *other* responses of its prompt, n/(n-1) (r_i - mean)."""
    mean, _, count = _group_stats(rewards.double(), group_ids)
    n = count.double()
    adv = torch.where(n > 1, (rewards.double() - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(mean))
    return adv.to(rewards.dtype)


rloo.scope = "group"


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_plus_plus(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (outcome reward): the rewards whitened over the whole global batch."""
    return _whiten(rewards.double(), eps).to(rewards.dtype)


reinforce_plus_plus.scope = "batch"
reinforce_plus_plus.per_sample = True


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_plus_plus_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the prompt's group mean, then whiten over the global batch."""
    mean, _, _ = _group_stats(rewards.double(), group_ids)
    return _whiten(rewards.double() - mean, eps).to(rewards.dtype)


reinforce_plus_plus_baseline.scope = "batch"


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_marker(rewards: torch.Tensor, group_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """GAE (PPO with a critic): computed by the advantage task from per-token critic values via
    ``asyncflow.algorithms.gae``. Registered only so that configs naming it validate."""
    raise TypeError(
        "advantage estimator 'gae' needs per-token rewards and critic values, not sequence rewards: "
        "use asyncflow.algorithms.gae.gae(token_rewards, values, mask, gamma, lam)"
    )


gae_marker.scope = "critic"
gae_marker.per_sample = True


def estimator_scope(name: str) -> str:
    """``"group"``, ``"batch"`` or ``"critic"``: what the estimator must see at once (default ``"group"``)."""
    return getattr(ADVANTAGE_ESTIMATORS.resolve(name), "scope", "group")


def estimator_per_sample(name: str) -> bool:
    """Whether the estimator scores each response without its prompt's other responses (default ``False``: a
    registered estimator is taken to need whole groups unless it says otherwise)."""
    return bool(getattr(ADVANTAGE_ESTIMATORS.resolve(name), "per_sample", False))


def compute_advantages(name: str, rewards, group_ids, **kwargs) -> torch.Tensor:
    """Look up estimator ``name`` and apply it (accepts lists or tensors)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids, dtype=torch.long)
    return ADVANTAGE_ESTIMATORS.resolve(name)(rewards, group_ids, **kwargs)
