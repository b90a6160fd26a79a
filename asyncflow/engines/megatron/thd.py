"""Packed (THD) attention for sequence packing, only where Transformer Engine is present.

With ``micro_batch_tokens`` the workflow pads each micro-batch to its own longest row (length-bucketed padding,
which is what runs on CPU). Where Transformer Engine's attention is available the trainer goes one step further:
the rows of a micro-batch are concatenated into one ``[1, T]`` sequence with no padding between them, and
``PackedSeqParams`` (``cu_seqlens``) keeps attention and RoPE inside each row. ``pack`` builds that input from the
padded micro-batch and its real row lengths (``row_tokens``); ``unpack`` puts per-position outputs back into the
padded ``[m, s-1]`` layout the loss reads, so nothing downstream changes.

UNTESTED: this path needs CUDA and Transformer Engine, which the CPU stack does not have; the padded path next to
it is the one the multi-rank tests check (``tests/engines/megatron/test_packing.py``). Context parallelism is not
combined with it (``features.problems`` refuses ``micro_batch_tokens`` with CP > 1).
"""

from __future__ import annotations

import torch


def enabled(micro_batch_tokens: int) -> bool:
    """Packing is on and Transformer Engine (whose attention reads ``cu_seqlens``) is installed."""
    from asyncflow.models.megatron import have_transformer_engine

    return bool(micro_batch_tokens) and have_transformer_engine()


def pack(tokens: torch.Tensor, lengths: torch.Tensor):
    """``(ids [1, T], positions [1, T], labels [1, T], PackedSeqParams)`` of the rows of ``tokens`` [m, s], each cut
    to its real length; positions restart at 0 in every row and the label of a row's last token is 0 (masked)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = lengths.to(torch.int32)
    rows = [tokens[i, : int(n)] for i, n in enumerate(lengths)]
    ids = torch.cat(rows).unsqueeze(0)
    positions = torch.cat([torch.arange(len(r), device=tokens.device) for r in rows]).unsqueeze(0)
    labels = torch.cat([torch.cat([r[1:], r.new_zeros(1)]) for r in rows]).unsqueeze(0)
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device=tokens.device)
    cu[1:] = torch.cumsum(lengths.to(tokens.device), 0)
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    return ids, positions, labels, params


def unpack(values: torch.Tensor, lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """Per-position ``values`` [1, T] of ``pack``'s sequence as ``[m, seq-1]`` (position t of row i scores its token
    t+1; 0 past each row's end, where every mask is 0)."""
    out = values.new_zeros(len(lengths), seq - 1)
    start = 0
    for i, n in enumerate(lengths.tolist()):
        out[i, : n - 1] = values[0, start : start + n - 1]
        start += n
    return out
