"""DAPO dynamic sampling: the driver's planner, the advantage task's group filter, the config checks."""

import pytest
import torch

from asyncflow.config import ConfigError, load_config
from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.pipeline import check_algorithm
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


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.dynamic_sampling=true", "algorithm.advantage=reinforce_pp"], "group estimator"),
    (["algorithm.dynamic_sampling=true", "algorithm.advantage=gae"], "group estimator"),
    (["algorithm.dynamic_sampling=true", "algorithm.kl_mode=reward"], "kl_mode"),
])
def test_incompatible_settings_are_rejected_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_algorithm(load_config(None, overrides))


def test_compatible_settings_pass():
    check_algorithm(load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.kl_coef=0",
                                       "algorithm.clip_high=0.28"]))
    check_algorithm(load_config(None, ["algorithm.advantage=gae", "algorithm.whiten_advantages=true"]))


def test_keeping_the_kv_cache_across_a_weight_swap_needs_the_prefix_cache_off():
    from asyncflow.workflow.pipeline import check_rollout

    keep = ["rollout.partial=true", "rollout.partial_kv=keep"]
    with pytest.raises(ConfigError, match="enable_prefix_caching=false"):
        check_rollout(load_config(None, keep))
    check_rollout(load_config(None, keep + ["rollout.enable_prefix_caching=false"]))
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(None, ["rollout.partial_kv=reuse"])


def test_a_step_that_splits_into_no_whole_micro_batches_is_rejected_before_anything_starts(tmp_path):
    from asyncflow.workflow.loop import train
    from asyncflow.workflow.pipeline import check_batching

    sizes = ["workflow.prompts_per_step=4", "workflow.samples_per_prompt=8"]  # 32 rows
    check_batching(load_config(None, sizes + ["trainer.micro_batch_size=8", "trainer.data_parallel=2"]))
    with pytest.raises(ConfigError, match="trainer.micro_batch_size 64 x trainer.data_parallel 1"):
        check_batching(load_config(None, sizes + ["trainer.micro_batch_size=64"]))
    gae = sizes + ["algorithm.advantage=gae", "trainer.micro_batch_size=8", "critic.micro_batch_size=3"]
    with pytest.raises(ConfigError, match="critic.micro_batch_size 3"):
        check_batching(load_config(None, gae))
    # ``train`` checks first: no model is made, no Ray started
    model = tmp_path / "model"
    with pytest.raises(ConfigError, match="rows per step"):
        train(load_config(None, sizes + ["trainer.micro_batch_size=64", f"model.path={model}"]))
    assert not model.exists()
