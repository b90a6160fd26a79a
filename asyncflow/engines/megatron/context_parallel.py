"""Context parallelism (``trainer.context_parallel`` = CP > 1): each CP rank holds 2 of 2 x CP sequence chunks.

Megatron's ``get_batch_on_this_cp_rank`` does the split (chunks ``r`` and ``2CP-1-r`` on rank ``r``, which
balances causal attention's work); this module prepares a micro-batch for it and undoes it on the way out:

- ``split``: the next-token labels are shifted *before* the split (position t's label is token t+1, which
  may sit in another rank's chunk), every field aligned with the log-prob positions (``[m, s-1]``: masks,
  advantages, behaviour and reference logprobs) is padded to ``s`` and split the same way, and the sequence
  is padded to a multiple of 2 x CP first;
- ``gather``: per-position outputs (``old_logprobs``) are all-gathered over the CP group and put back in
  sequence order; scalar metrics are summed over it (``*_max`` ones take the maximum), so every CP rank
  reports what a rank without CP would.

The loss is a sum over this rank's tokens divided by the global normaliser; Megatron's DDP averages the
gradients over the data x context parallel group, which the caller compensates (``MegatronActor.train_step``).

Runs here only as far as the split and gather (tested on CPU with a real gloo CP group): the attention over
CP ranks (ring attention) is Transformer Engine's and needs CUDA; the local layer spec asserts CP = 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_length(seq: int, cp: int) -> int:
    """``seq`` rounded up to a multiple of ``2 x cp`` (the chunk count of the split)."""
    return -(-seq // (2 * cp)) * (2 * cp)


def split(mb: dict, seq: int, cp: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """This CP rank's part of micro-batch ``mb`` with ``tokens`` ``[m, seq]``.

    Returns ``(local_mb, positions, labels)``: ``local_mb['tokens']`` and every ``[m, seq-1]`` field cut to this
    rank's ``2 x seq'/(2CP)`` positions (``seq'`` = ``padded_length``), the global positions of those tokens,
    and their next-token labels (0 past the end, where every mask is 0).
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    full = padded_length(seq, cp)
    tokens = F.pad(mb["tokens"], (0, full - seq))
    batch = {"tokens": tokens, "labels": F.pad(tokens[:, 1:], (0, 1)),
             "position_ids": torch.arange(full, device=tokens.device).expand(tokens.shape[0], -1)}
    aligned = [k for k, v in mb.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq - 1]
    for key in aligned:
        batch[key] = F.pad(mb[key], (0, 0) * (mb[key].dim() - 2) + (0, full - (seq - 1)))
    local = get_batch_on_this_cp_rank(batch)
    out = {**mb, "tokens": local["tokens"]}
    out.update({key: local[key] for key in aligned})
    return out, local["position_ids"], local["labels"]


def gather_positions(local: torch.Tensor, seq: int, cp: int, group) -> torch.Tensor:
    """Per-position values ``[m, 2 x chunk]`` of every CP rank back in sequence order, cut to ``[m, seq-1]``
    (the log-prob positions of a ``seq``-token row)."""
    chunk = local.shape[1] // 2
    parts = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    ordered: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):  # rank r holds chunks r and 2CP-1-r
        ordered[rank], ordered[2 * cp - 1 - rank] = part[:, :chunk], part[:, chunk:]
    return torch.cat(ordered, dim=1)[:, : seq - 1]


def reduce_metrics(metrics: dict, seq: int, cp: int, group) -> dict:
    """Every CP rank's metrics of one micro-batch combined: per-position tensors gathered, scalars summed
    (``*_max``: the maximum, NaN when every rank had none)."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
        elif value.dim() >= 2:
            out[key] = gather_positions(value, seq, cp, group)
        elif key.endswith("_max"):
            v = torch.nan_to_num(value.detach().float().clone(), nan=float("-inf"))
            torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX, group=group)
            out[key] = torch.where(torch.isinf(v), torch.full_like(v, float("nan")), v)
        else:
            v = value.detach().clone()
            torch.distributed.all_reduce(v, group=group)
            out[key] = v
    return out
