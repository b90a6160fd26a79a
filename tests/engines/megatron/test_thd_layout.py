"""The layout of packed (THD) micro-batches (``engines/megatron/thd.py``): the rows concatenated without padding,
positions restarting per row, ``cu_seqlens`` at the row starts, and per-position outputs put back where the padded
path has them. The attention that reads it is Transformer Engine's (not on CPU), so only the layout is tested."""

import importlib.util

import torch

from asyncflow.engines.megatron import thd


def test_pack_and_unpack_keep_every_row_where_the_padded_path_has_it():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [13, 14, 0, 0, 0]])
    lengths = torch.tensor([3, 5, 2])
    ids, positions, labels, params = thd.pack(tokens, lengths)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert labels.tolist() == [[6, 7, 0, 9, 10, 11, 12, 0, 14, 0]]  # a row's last token has no label
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 8, 10]
    assert params.max_seqlen_q == params.max_seqlen_kv == 5
    # Any per-position output (here: 100 x label + position) lands at the padded path's [m, s-1] positions.
    padded = thd.unpack((labels * 100 + positions).float(), lengths, seq=tokens.shape[1])
    expected = torch.zeros(3, 4)
    for i, n in enumerate(lengths.tolist()):
        for t in range(n - 1):
            expected[i, t] = tokens[i, t + 1] * 100 + t
    assert torch.equal(padded, expected)


def test_off_without_transformer_engine():
    assert not thd.enabled(0)
    assert thd.enabled(4096) == (importlib.util.find_spec("transformer_engine") is not None)
