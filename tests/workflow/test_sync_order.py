"""Sync mode's lock-step order within a step, and the TransferQueue consumer tasks, for each run shape."""

from asyncflow.workflow.pipeline import consumer_tasks, sync_order


def test_grpo_runs_the_groups_in_pipeline_order():
    assert sync_order(["rollout", "reward", "advantage", "actor"], dynamic_sampling=False) == [
        ("rollout", None), ("reward", None), ("advantage", None), ("actor", None)]


def test_under_dynamic_sampling_the_reference_scores_after_the_advantage_kept_the_rows():
    groups = ["rollout", "reward", "reference", "advantage", "actor"]
    assert sync_order(groups, dynamic_sampling=False)[2] == ("reference", None)
    assert sync_order(groups, dynamic_sampling=True) == [
        ("rollout", None), ("reward", None), ("advantage", None), ("reference", None), ("actor", None)]


def test_the_critic_s_values_come_before_gae_and_its_update_after_the_actor():
    groups = ["rollout", "reward", "reference", "advantage", "actor", "critic"]
    assert sync_order(groups, dynamic_sampling=False) == [
        ("rollout", None), ("reward", None), ("reference", None), ("critic", "values"), ("advantage", None),
        ("actor", None), ("critic", "critic")]
    assert consumer_tasks(dict.fromkeys(groups, [])) == [
        "rollout", "reward", "reference", "advantage", "actor", "values", "critic"]
