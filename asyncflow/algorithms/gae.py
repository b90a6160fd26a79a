"""Generalized advantage estimation (PPO with a critic) on per-token rewards and values.

All tensors are ``[b, t]`` with position ``t`` = response token ``t``; ``mask`` is 1 on response
tokens (right-padded). ``values[:, t]`` is the critic's estimate at token ``t``; the value after the
last response token is 0 (the episode ends there). Outputs are 0 where ``mask`` is 0.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE(gamma, lambda): ``(advantages, returns)``, with returns = advantages + values.

    delta_t = r_t + gamma V_{t+1} m_{t+1} - V_t and A_t = delta_t + gamma lam m_{t+1} A_{t+1}. The
    results are training targets, so no gradient flows back into the values.
    """
    on = mask > 0
    # Padding may hold anything (even nan): 0 * nan is nan, so select rather than multiply.
    rewards = torch.where(on, token_rewards, 0.0)
    values = torch.where(on, values, 0.0)
    m = on.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    next_m = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value * next_m - values[:, t]
        next_adv = (delta + gamma * lam * next_m * next_adv) * m[:, t]
        advantages[:, t] = next_adv
        next_value, next_m = values[:, t], m[:, t]
    return advantages, (advantages + values) * m


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                          kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards ``[b, t]``: each sequence's score on its last response token, minus kl_coef * kl.

    A row without response tokens gets no reward (its score is dropped).
    """
    on = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(on, positions, -1).max(-1).values
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rewards[rows, last[rows]] = scores[rows]
    if kl is not None:
        rewards = rewards - kl_coef * torch.where(on, kl, 0.0)
    return rewards


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalize ``values`` to mean 0 and (unbiased) std 1 over the entries where ``mask`` is 1.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked-out entries are 0.
    Statistics are over this tensor only: pass the whole batch, not a micro-batch.
    """
    on = mask > 0
    m = on.to(values.dtype)
    x = torch.where(on, values, 0.0)
    n = m.sum()
    mean = x.sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
