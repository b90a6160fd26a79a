"""DAPO dynamic sampling: the driver's planner and the advantage task's group filter (its config rules:
tests/test_config.py)."""

import pytest
import torch

from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.sampling import DynamicSampling, SamplingBudgetError


def test_planner_tops_up_by_keep_rate_then_seals():
    ds = DynamicSampling(prompts_per_step=4, group_size=2, max_factor=4.0)  # target 8 rows
    ds.fed(0, 4)
    assert ds.plan() == ({}, [])  # 8 rows in flight: wait for them to be judged
    ds.progress({0: (2, 8)})  # one group of four kept: keep rate 1/4
    feed, seal = ds.plan()
    # deficit 6 rows at a keep rate of 1/4 -> 24 rows -> 12 prompts, capped by 4 x 4 - 4 = 12
    assert feed == {0: 12} and seal == []
    ds.fed(0, 12)
    assert ds.plan() == ({}, [])  # 24 rows pending cover the deficit
    ds.progress({0: (8, 20)})
    assert ds.plan() == ({}, [0])  # full: seal once
    assert ds.plan() == ({}, [])


def test_planner_group_ids_never_collide_across_steps():
    ds = DynamicSampling(prompts_per_step=4, group_size=2, max_factor=2.0)
    assert ds.next_group_id(0) == 0
    ds.fed(0, 4)
    assert ds.next_group_id(0) == 4
    ds.fed(0, 4)
    assert ds.next_group_id(0) == 8 == ds.next_group_id(1)  # step 1 starts after step 0's budget of 8
    ds.fed(1, 4)
    assert ds.next_group_id(1) == 12


def test_planner_fails_with_the_setting_named_when_nothing_has_signal():
    ds = DynamicSampling(prompts_per_step=2, group_size=2, max_factor=2.0)
    ds.fed(0, 2)
    ds.progress({0: (0, 4)})
    feed, _ = ds.plan()
    assert feed == {0: 2}  # the budget allows 4 prompts in all
    ds.fed(0, 2)
    ds.progress({0: (0, 8)})
    with pytest.raises(SamplingBudgetError, match="max_sampling_factor"):
        ds.plan()


def test_batch_select_keeps_rows_and_metadata_aligned():
    meta = BatchMeta("p", "t", [10, 11, 12, 13], [0, 0, 1, 1], [5, 5, 6, 6], [1, 2, 3, 4])
    batch = Batch(meta, {"rewards": torch.tensor([0.0, 1.0, 1.0, 1.0]),
                         "response_ids": [torch.tensor([1]), torch.tensor([2]), torch.tensor([3]), torch.tensor([4])]})
    sub = batch.select([0, 1])
    assert sub.indexes == [10, 11] and sub.meta.group_ids == [5, 5] and sub.meta.versions == [0, 0]
    assert sub["rewards"].tolist() == [0.0, 1.0] and [t.item() for t in sub["response_ids"]] == [1, 2]
