"""Per-token log-probabilities from Megatron logits, without gathering the full vocabulary on one rank."""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Set the logits of Megatron's padded vocabulary rows to -inf on this tensor-parallel shard.

    Padded rows exist only so the vocabulary divides evenly; Hugging Face and vLLM have no such
    tokens, so leaving their logits in the softmax would shift every log-probability.
    """
    from megatron.core import parallel_state

    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    first_padded = true_vocab - start
    if first_padded >= shard:
        return logits
    logits = logits.clone()
    logits[..., max(first_padded, 0) :] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """log p(targets) for vocab-parallel ``logits`` [b, s, V/tp] via Megatron's vocab-parallel cross entropy."""
    from megatron.core import tensor_parallel

    logits = mask_padded_vocab(logits, true_vocab)
    # Megatron's kernel wants [s, b, V/tp] and returns the loss (= -log p) as [s, b].
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous().float(), targets.transpose(0, 1).contiguous()
    )
    return -loss.transpose(0, 1)
