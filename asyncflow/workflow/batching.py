"""TransferQueue rows -> fixed-shape Megatron micro-batches (tokens plus per-token RL tensors).

Position ``t`` of the ``[m, s-1]`` tensors scores token ``t+1``; response token ``j`` of a row whose
prompt has ``P`` tokens sits at position ``P - 1 + j``. Every micro-batch of a run has the same ``s``
(``max_prompt_len + max_new_tokens``) when pipeline stages exchange fixed shapes; without pipeline
parallelism each micro-batch is padded only to its own longest row (``fit_seq_len``).
"""

from __future__ import annotations

import torch

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


def to_critic_micro_batch(batch, seq_len: int, pad_id: int, fixed_shape: bool = True) -> dict[str, torch.Tensor]:
    """A TransferQueue ``Batch`` of critic rows (``values`` at rollout time, GAE ``returns``) as tensors."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    if not fixed_shape:
        seq_len = fit_seq_len(prompts, responses, seq_len)
    tokens, mask = pack_tokens(prompts, responses, seq_len, pad_id)
    return {"tokens": tokens, "mask": mask, "old_values": place_per_token(batch["values"], prompts, seq_len),
            "returns": place_per_token(batch["returns"], prompts, seq_len)}


def to_micro_batch(batch, seq_len: int, pad_id: int, train_version: int, fixed_shape: bool = True
                   ) -> dict[str, torch.Tensor]:
    """A TransferQueue ``Batch`` of actor rows as the tensors ``make_objective``'s loss reads."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    if not fixed_shape:
        seq_len = fit_seq_len(prompts, responses, seq_len)
    tokens, mask = pack_tokens(prompts, responses, seq_len, pad_id)
    if "loss_mask" in batch:  # multi-turn: an agent loop's observation tokens are context, not actions
        mask = mask * place_per_token(batch["loss_mask"], prompts, seq_len)
    mb = {
        "tokens": tokens,
        "mask": mask,
        "advantages": _advantages(batch["advantages"], prompts, mask, seq_len),
        "behaviour_logprobs": place_per_token(batch["behaviour_logprobs"], prompts, seq_len),
        "lag": train_version - torch.as_tensor(batch.meta.versions, dtype=torch.long),
    }
    if "ref_logprobs" in batch:
        mb["ref_logprobs"] = place_per_token(batch["ref_logprobs"], prompts, seq_len)
    if "token_versions" in batch:  # partial rollout: each token's lag (a row spans weight versions)
        mb["token_lag"] = (train_version - place_per_token(batch["token_versions"], prompts, seq_len)) * mask
    return mb
