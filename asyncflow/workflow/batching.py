"""TransferQueue rows -> fixed-shape Megatron micro-batches (tokens plus per-token RL tensors).

Position ``t`` of the ``[m, s-1]`` tensors scores token ``t+1``; response token ``j`` of a row whose
prompt has ``P`` tokens sits at position ``P - 1 + j``. Every micro-batch of a run has the same ``s``
(``max_prompt_len + max_new_tokens``) when pipeline stages exchange fixed shapes; without pipeline
parallelism each micro-batch is padded only to its own longest row (``fit_seq_len``).

With a token budget (``micro_batch_tokens`` > 0: sequence packing) the rows of a step are grouped by length
(``plan_micro_batches``) instead of taken ``micro_batch_size`` at a time, and every micro-batch is padded to its
own longest row, under pipeline parallelism too (the engine then exchanges variable shapes).
"""

from __future__ import annotations

import torch

from asyncflow.transfer_queue.batch import Batch, BatchMeta

ACTOR_FIELDS = ["prompt_ids", "response_ids", "behaviour_logprobs", "advantages"]
"""Fields the actor update needs (plus ``ref_logprobs`` when the KL is a loss term)."""


def _row_tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def fit_seq_len(prompts, responses, cap: int, multiple: int = 8) -> int:
    """The longest row of this micro-batch rounded up to ``multiple`` (at most ``cap``).

    Only without pipeline parallelism: stages exchange fixed shapes, so PP > 1 always pads to ``cap``.
    With long-tailed responses this saves most of the padding compute.
    """
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    return min(cap, -(-longest // multiple) * multiple)


def pack_tokens(prompts, responses, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens`` [m, seq_len] and the response ``mask`` [m, seq_len - 1]."""
    tokens = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), seq_len - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p, r = _row_tensor(p).long(), _row_tensor(r).long()
        if len(p) + len(r) > seq_len:
            raise ValueError(f"row {i}: prompt {len(p)} + response {len(r)} tokens exceed seq_len {seq_len}")
        tokens[i, : len(p)] = p
        tokens[i, len(p) : len(p) + len(r)] = r
        mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return tokens, mask


def place_per_token(values, prompts, seq_len: int) -> torch.Tensor:
    """Per-response-token values (ragged rows) placed at their logprob positions [m, seq_len - 1]."""
    out = torch.zeros(len(prompts), seq_len - 1)
    for i, (v, p) in enumerate(zip(values, prompts)):
        v = _row_tensor(v).float()
        start = len(p) - 1
        out[i, start : start + len(v)] = v
    return out


def response_slices(logprobs: torch.Tensor, prompts, responses) -> list[torch.Tensor]:
    """Cut each row's response-token logprobs out of ``[m, seq_len - 1]`` (the inverse of ``place``)."""
    return [logprobs[i, len(p) - 1 : len(p) - 1 + len(r)].clone() for i, (p, r) in enumerate(zip(prompts, responses))]


def _advantages(values, prompts, mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Sequence-level advantages ([N]: broadcast over the response) or per-token ones (GAE: ragged rows)."""
    if isinstance(values, list) or _row_tensor(values).dim() > 1:
        return place_per_token(values, prompts, seq_len) * mask
    return _row_tensor(values).float().reshape(-1)[:, None] * mask


def to_critic_micro_batch(batch, seq_len: int, pad_id: int, fixed_shape: bool = True, multiple: int = 8
                          ) -> dict[str, torch.Tensor]:
    """A TransferQueue ``Batch`` of critic rows (``values`` at rollout time, GAE ``returns``) as tensors (widths
    rounded up to ``multiple`` unless ``fixed_shape``)."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    if not fixed_shape:
        seq_len = fit_seq_len(prompts, responses, seq_len, multiple)
    tokens, mask = pack_tokens(prompts, responses, seq_len, pad_id)
    return {"tokens": tokens, "mask": mask, "old_values": place_per_token(batch["values"], prompts, seq_len),
            "returns": place_per_token(batch["returns"], prompts, seq_len),
            "row_tokens": torch.tensor(row_tokens(prompts, responses))}


def to_micro_batch(batch, seq_len: int, pad_id: int, train_version: int, fixed_shape: bool = True,
                   multiple: int = 8) -> dict[str, torch.Tensor]:
    """A TransferQueue ``Batch`` of actor rows as the tensors ``make_objective``'s loss reads (widths rounded up to
    ``multiple`` unless ``fixed_shape``)."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    if not fixed_shape:
        seq_len = fit_seq_len(prompts, responses, seq_len, multiple)
    tokens, mask = pack_tokens(prompts, responses, seq_len, pad_id)
    if "loss_mask" in batch:  # multi-turn: an agent loop's observation tokens are context, not actions
        mask = mask * place_per_token(batch["loss_mask"], prompts, seq_len)
    mb = {
        "tokens": tokens,
        "mask": mask,
        "advantages": _advantages(batch["advantages"], prompts, mask, seq_len),
        "behaviour_logprobs": place_per_token(batch["behaviour_logprobs"], prompts, seq_len),
        "lag": train_version - torch.as_tensor(batch.meta.versions, dtype=torch.long),
        "row_tokens": torch.tensor(row_tokens(prompts, responses)),  # packed (THD) attention cuts rows by them
    }
    if "ref_logprobs" in batch:
        mb["ref_logprobs"] = place_per_token(batch["ref_logprobs"], prompts, seq_len)
    if "token_versions" in batch:  # partial rollout: each token's lag (a row spans weight versions)
        mb["token_lag"] = (train_version - place_per_token(batch["token_versions"], prompts, seq_len)) * mask
    return mb


def row_tokens(prompts, responses) -> list[int]:
    """Real tokens of each row (prompt + response)."""
    return [len(p) + len(r) for p, r in zip(prompts, responses)]


MAX_PADDING = 1.1
"""A packed micro-batch computes on at most this many times what its rows would each padded to their own width
(their length rounded up to the kernels' multiple): rows of like length share one, and where lengths spread (a
long tail) micro-batches get fewer rows instead of more padding."""


def plan_micro_batches(lengths: list[int], token_budget: int, cap: int, multiple: int = 8) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``token_budget`` padded tokens each (rows x the group's longest
    row rounded up to ``multiple``, at most ``cap``); a row longer than the budget goes alone.

    Rows are taken shortest first, so each micro-batch holds rows of like length (length-bucketed padding), and a
    micro-batch is closed early rather than padded past ``MAX_PADDING`` times its rows' own widths; the plan depends
    only on ``lengths``, so every model-parallel rank of a replica, which reads the same rows, makes the same plan.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be at least 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    alone = 0  # what the rows of ``current`` would take each padded to its own width: rounding is not spread
    for i in order:
        width = min(cap, -(-lengths[i] // multiple) * multiple)  # the longest so far: rows come shortest first
        padded = (len(current) + 1) * width
        if current and (padded > token_budget or padded > MAX_PADDING * (alone + width)):
            plan.append(current)
            current, alone = [], 0
        current.append(i)
        alone += width
    if current:
        plan.append(current)
    return plan


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """``plan`` (shortest rows first) with its largest micro-batches halved until it has ``count`` of them (so
    that every data-parallel replica runs the same number); fails when there are fewer rows than ``count``."""
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        largest = max(reversed(range(len(plan))), key=lambda k: len(plan[k]))  # ties: the longer rows
        rows = plan[largest]
        if len(rows) < 2:
            raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, plan))} rows")
        plan[largest:largest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return plan


def merge_batches(batches: list) -> Batch:
    """Several TransferQueue batches of one partition as one (rows in order), to be regrouped by
    ``plan_micro_batches`` and ``Batch.select``. A field whose rows all have one shape is stacked (sequence-level
    advantages stay ``[N]``); ragged fields become lists of rows."""
    first = batches[0].meta
    meta = BatchMeta(first.partition, first.task, [i for b in batches for i in b.meta.indexes],
                     [v for b in batches for v in b.meta.versions], [g for b in batches for g in b.meta.group_ids],
                     [n for b in batches for n in b.meta.lengths])
    data = {}
    for name in batches[0].keys():
        rows = [row for b in batches for row in _rows(b[name])]
        same = rows and all(isinstance(r, torch.Tensor) for r in rows) and len({r.shape for r in rows}) == 1
        data[name] = torch.stack(rows) if same else rows
    return Batch(meta, data)


def _rows(value) -> list:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if hasattr(value, "to_list"):  # a packed ragged field
        return value.to_list()
    return list(value)

