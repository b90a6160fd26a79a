"""The mode and split search (``simulator.search.mode_search``) and ``asyncflow simulate --modes``: workflow mode
(stream, async), rollout model (chunked only in async), rollout shares from a quarter to three quarters, trainer
DP sizes that do not divide the step's rows, rollout TP, and what the recipe check says against each choice.

Costs are round numbers (``test_stream``'s), or the published H100 figures for the CLI: behaviour is checked, not
hardware."""

from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.recipes_check import load_recipe
from asyncflow.simulator.costs import CostModel, RolloutCosts, TrainCosts
from asyncflow.simulator.search import (
    ModeChoice,
    expert_overrides,
    mode_search,
    recipe_best,
    recipe_problems,
    share_splits,
)
from asyncflow.simulator.workload import Workload

REPO = Path(__file__).resolve().parents[2]
MODEL = CostModel(rollout=RolloutCosts(step_s=0.01, per_seq_s=1e-4, per_ctx_token_s=1e-6, prefill_per_token_s=2e-5),
                  train=TrainCosts(per_micro_s=0.02, per_token_s=1e-4, optimizer_s=0.05))


def _w(**kw) -> Workload:
    base = dict(mode="async", steps=4, warmup_steps=2, prompts_per_step=3, samples_per_prompt=4, rollout_instances=1,
                max_num_seqs=8, data_parallel=1, micro_batch_size=1, reference=False, prompt_len=6,
                max_new_tokens=64, lengths="lognormal:6:1.2", placement="devices", packing=True, ppo_epochs=1)
    base.update(kw)
    return Workload(**base)


def test_share_splits_span_a_quarter_to_three_quarters_with_any_dp():
    assert share_splits(8, trainer_mp=1, rollout_tp=1) == [(2, 6), (3, 5), (4, 4), (5, 3), (6, 2)]
    # Trainer replicas of 16 GPUs on 64: DP 1-3 leave rollout 48, 32 and 16 GPUs, in engines of TP 8.
    assert share_splits(64, trainer_mp=16, rollout_tp=8) == [(2, 3), (4, 2), (6, 1)]
    wide = share_splits(256, trainer_mp=2, rollout_tp=1, points=12)
    assert len(wide) == 12 and wide[0][0] == 64 and wide[-1][0] == 192


def test_mode_search_covers_both_workflow_modes_every_rollout_model_and_tp():
    w = _w()  # 12 rows a step: DP 5 does not divide them
    choices = mode_search(w, MODEL, devices=8, trainer_mp=1, rollout_tp=1, staleness=(1, 2),
                          workflow_modes=("stream", "async"), models=("chunked", "continuous", "partial"),
                          tp_models={1: MODEL, 2: MODEL})
    seen = {(c.workflow_mode, c.rollout_model) for c in choices}
    assert seen == {("stream", "continuous"), ("stream", "partial"), ("async", "chunked"), ("async", "continuous"),
                    ("async", "partial")}  # the stream generates continuously: never chunked
    assert {c.rollout_tp for c in choices} == {1, 2} and {c.max_staleness for c in choices} == {1, 2}
    # A packed trainer takes any DP (the replicas' shares differ by a row), in either mode; a padded one deals a
    # step's rows evenly over its replicas.
    assert 5 in {c.trainer_dp for c in choices if c.workflow_mode == "stream"}
    assert 5 in {c.trainer_dp for c in choices if c.workflow_mode == "async"}
    padded = mode_search(_w(packing=False), MODEL, devices=8, trainer_mp=1, rollout_tp=1, staleness=(1,),
                         workflow_modes=("async",), models=("chunked",))
    assert padded and all(12 % c.trainer_dp == 0 for c in padded)
    rates = [c.result.samples_per_s for c in choices]
    assert rates == sorted(rates, reverse=True)
    assert recipe_best(choices) is choices[0]  # no recipe: nothing to refuse


def test_choice_overrides_name_the_mode_rollout_model_and_split():
    choice = ModeChoice("chunked", 2, 4, 2, 4, result=None, workflow_mode="async", micro_batch_tokens=5120,
                        extra=("trainer.expert_parallel=4",))
    assert choice.overrides() == ["workflow.mode=async", "workflow.max_staleness=2", "rollout.continuous=false",
                                  "rollout.partial=false", "workflow.rollout_instances=4",
                                  "rollout.tensor_parallel=2", "trainer.data_parallel=4",
                                  "trainer.micro_batch_tokens=5120", "trainer.expert_parallel=4"]


def test_recipe_problems_move_cluster_env_with_the_split_and_name_what_a_recipe_refuses():
    recipe, _ = load_recipe(REPO / "recipes/qwen2.5-7b")
    mp = recipe.cfg.trainer.tensor_parallel
    ok = ModeChoice("partial", 2, 8, 1, 4, None, "stream").overrides()
    assert recipe_problems(recipe, ok, 16, mp) == []
    # Booleans parse as the config loader does ("false" is False).
    off = ModeChoice("chunked", 1, 8, 1, 4, None, "async").overrides()
    assert recipe_problems(recipe, off, 16, mp) == []
    # DP 3 does not divide the step's 1,024 rows: the recipe's packed trainer takes them, a padded one does not.
    uneven = ModeChoice("partial", 2, 10, 1, 3, None).overrides()
    assert recipe_problems(recipe, uneven, 16, mp) == []
    padded = recipe_problems(recipe, [*uneven, "trainer.micro_batch_tokens=0"], 16, mp)
    assert any("must be a multiple of trainer.micro_batch_size x trainer.data_parallel = 1 x 3" in p for p in padded)
    heads = recipe_problems(recipe, ModeChoice("partial", 2, 1, 8, 4, None).overrides(), 16, mp)
    assert any("rollout.tensor_parallel=8 does not divide num_attention_heads=28" in p for p in heads)


def test_expert_parallelism_shrinks_to_the_trainer_ranks_of_a_split():
    moe, _ = load_recipe(REPO / "recipes/qwen3-30b-a3b")  # TP2, EP8: the expert grid needs 16 trainer ranks
    assert expert_overrides(moe, 8) == []
    assert expert_overrides(moe, 4) == ["trainer.expert_parallel=4"]
    assert expert_overrides(moe, 3) == ["trainer.expert_parallel=1"]
    dense, _ = load_recipe(REPO / "recipes/qwen2.5-7b")
    assert expert_overrides(dense, 3) == []


def test_simulate_modes_with_published_costs_prints_the_recipes_choice(tmp_path, capsys):
    rc = main(["simulate", str(REPO / "recipes/qwen2.5-7b"), "workflow.prompts_per_step=4", "workflow.steps=3",
               "--costs", "published:h100", "--lengths", "heavytail", "--prompt-len", "200", "--modes",
               "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "predicted from published:h100 (published H100 figures" in text and "prompts of 200 tokens" in text
    assert "lognormal:98:1.3" in text  # heavytail: mean max_new_tokens / 18 (4096 / 18 = 228, median 98)
    assert "| stream | partial |" in text and "| async | chunked |" in text
    assert "for the recipe: workflow.mode=" in text and "cluster.env: TRAINER_DEVICES=" in text


@pytest.mark.parametrize("costs, message", [("published:tpu", "published figures exist for h100, h20"),
                                            ("published:h100", "needs a recipe directory")])
def test_published_costs_refusals_are_one_line(tmp_path, capsys, costs, message):
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/grpo_async.yaml") if "recipe" in message
               else str(REPO / "recipes/qwen2.5-7b"), "--costs", costs, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_a_lone_continuous_engine_applies_a_version_published_while_it_swapped():
    """One continuous engine, a trainer that publishes the next version while the engine applies the last: the
    engine, empty and behind, applies it and admits again (it once waited for a change that never came, and every
    search over one engine stalled)."""
    from asyncflow.simulator.costs import WeightSyncCosts
    from asyncflow.simulator.sim import simulate

    w = _w(mode="stream", steps=6, prompts_per_step=4, rollout_model="continuous", max_staleness=1, max_num_seqs=64,
           data_parallel=2)
    model = CostModel(rollout=MODEL.rollout, train=TrainCosts(per_token_s=1e-5),
                      weight_sync=WeightSyncCosts(apply_fixed_s=0.5))
    result = simulate(w, model)
    assert len(result.step_end_s) == 6 and len(result.trained) == len(set(result.trained)) == 6 * 4
