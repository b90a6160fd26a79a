"""Per-token log-probabilities and entropies from Megatron logits, without gathering the full vocabulary."""

from __future__ import annotations

import torch


def _tp_rank() -> int:
    """This process's tensor-parallel rank; 0 when Megatron's parallel state is not initialized."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def _tp_group():
    """The tensor-parallel process group, or None when there is nothing to reduce over (TP=1, no state)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    return group if group.size() > 1 else None


def mask_padded_vocab(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Set the logits of Megatron's padded vocabulary rows to -inf on this tensor-parallel shard.

    Padded rows exist only so the vocabulary divides evenly; Hugging Face and vLLM have no such
    tokens, so leaving their logits in the softmax would shift every log-probability.
    """
    shard = logits.shape[-1]
    start = _tp_rank() * shard
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


def token_entropy(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Entropy [b, s] (float32) of the softmax of vocab-parallel ``logits`` [b, s, V/tp]; differentiable.

    With the global max m, S = sum exp(x - m) and T = sum exp(x - m) (x - m) over the whole
    vocabulary, H = log S - T / S. Each rank sums its shard and all-reduces S and T only. Backward uses
    dH/dx = -p (log p + H) on each rank's own shard, which is the right gradient because every
    tensor-parallel rank computes the same loss from the reduced H (as with Megatron's vocab-parallel
    cross entropy). Only the logits, m, S and H are kept for backward, not exp() or the products.
    """
    return _VocabParallelEntropy.apply(mask_padded_vocab(logits.float(), true_vocab), _tp_group())


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, group):
        m = logits.max(-1, keepdim=True).values  # H does not depend on m; it only keeps exp() in range
        if group is not None:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - m
        exp = shifted.exp()
        # Padded rows: exp is 0 but shifted is -inf, and 0 * -inf is nan: zero them first.
        shifted = torch.where(shifted.isneginf(), 0.0, shifted)
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        total, weighted = sums.unbind(0)
        entropy = total.log() - weighted / total
        ctx.save_for_backward(logits, m, total, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, m, total, entropy = ctx.saved_tensors
        log_p = logits - m - total.log()[..., None]
        p = log_p.exp()
        # p log p is 0 where p is 0 (padded rows): never 0 * -inf.
        grad_logits = -grad[..., None] * p * torch.where(p > 0, log_p + entropy[..., None], 0.0)
        return grad_logits, None
