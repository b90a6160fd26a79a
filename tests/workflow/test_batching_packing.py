"""Token-budget micro-batches (``workflow.batching``): the plan, the split that evens replicas, the merge of
TransferQueue batches; and the padding a packed step moves on long-tailed lengths. The packed run on the fake
engines is one of ``test_loop``'s runs."""

import pytest
import torch

from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.batching import MAX_PADDING, merge_batches, plan_micro_batches, split_to_count, to_micro_batch


def _padded(lengths, plan, cap, multiple=8):
    return sum(len(rows) * min(cap, -(-max(lengths[i] for i in rows) // multiple) * multiple) for rows in plan)


def test_plan_groups_rows_of_like_length_within_the_budget():
    lengths = [30, 5, 7, 100, 6, 31, 8]
    plan = plan_micro_batches(lengths, token_budget=64, cap=128)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))  # every row once
    assert plan == [[1, 4, 2, 6], [0, 5], [3]]  # shortest first; 100 tokens exceed the budget, alone
    assert _padded(lengths, plan, 128) == 4 * 8 + 2 * 32 + 104


def test_plan_is_deterministic_and_rejects_a_zero_budget():
    lengths = [9, 3, 9, 3, 12]
    assert plan_micro_batches(lengths, 24, 64) == plan_micro_batches(list(lengths), 24, 64)
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches(lengths, 0, 64)


def test_long_tailed_step_moves_at_most_1_1x_its_real_tokens():
    # 512 rows with a mean of about 1,000 tokens and a max/mean near 9 (lognormal), a cap of 9,216 tokens: the
    # padded path of a pipeline moves 512 x 9,216; packing by a 16k-token budget moves about 1.05x the real ones.
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randn(512, generator=gen) * 0.9 + 6.5).exp().clamp(16, 9216).long().tolist()
    plan = plan_micro_batches(lengths, token_budget=16384, cap=9216)
    ratio = _padded(lengths, plan, 9216) / sum(lengths)
    assert max(lengths) / (sum(lengths) / len(lengths)) > 8
    assert ratio <= 1.1
    assert 512 * 9216 / sum(lengths) > 8  # what fixed shapes would move


def test_split_to_count_halves_the_largest_micro_batches():
    plan = [[0, 1, 2, 3], [4, 5], [6]]
    assert split_to_count(plan, 3) == plan
    assert split_to_count(plan, 5) == [[0, 1], [2, 3], [4], [5], [6]]
    with pytest.raises(ValueError, match="cannot make 8 micro-batches of 7 rows"):
        split_to_count(plan, 8)


def _batch(indexes, prompts, responses, advantages, versions):
    meta = BatchMeta(partition="p", task="actor", indexes=indexes, versions=versions,
                     group_ids=[i // 2 for i in indexes])
    return Batch(meta, {"prompt_ids": prompts, "response_ids": responses,
                        "behaviour_logprobs": [torch.full((len(r),), -0.5) for r in responses],
                        "advantages": torch.tensor(advantages)})


def test_merge_and_select_give_the_micro_batch_of_the_same_rows():
    a = _batch([0, 1], [[1, 2], [3, 4, 5]], [[6], [7, 8]], [1.0, -1.0], [3, 3])
    b = _batch([2, 3], [[1], [2, 2]], [[9, 9, 9], [4]], [0.5, 0.25], [2, 3])
    merged = merge_batches([a, b])
    assert merged.indexes == [0, 1, 2, 3] and merged.meta.versions == [3, 3, 2, 3]
    assert merged.meta.group_ids == [0, 0, 1, 1]
    assert merged["advantages"].shape == (4,)  # sequence-level advantages stay one per row
    picked = merged.select([3, 0])
    direct = _batch([3, 0], [[2, 2], [1, 2]], [[4], [6]], [0.25, 1.0], [3, 3])
    got, want = to_micro_batch(picked, 8, 0, 4, fixed_shape=False), to_micro_batch(direct, 8, 0, 4, fixed_shape=False)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


# The padding a packed step moves in a whole run: ``test_packed_run_trains_every_prompt_once_and_reports_its_padding``
# of ``tests/workflow/test_loop.py`` (the loop's k=0 run is the packed one).


def test_a_micro_batch_is_closed_rather_than_padded_past_the_bound():
    # A short step whose lengths spread: the budget alone would put the 3 long rows with the 4 short ones (7 x 60
    # tokens for 4 x 10 + 3 x 50 real: 2.2x); the bound closes the short rows' micro-batch first.
    lengths = [10, 10, 10, 10, 50, 55, 60]
    plan = plan_micro_batches(lengths, token_budget=1000, cap=64, multiple=1)
    assert plan == [[0, 1, 2, 3], [4, 5, 6]]
    assert _padded(lengths, plan, 64, multiple=1) / sum(lengths) <= MAX_PADDING
