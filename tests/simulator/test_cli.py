"""``asyncflow simulate``: the table, the Gantt chart, and the split search under the planner's memory limits.

The cost files here are written by the test with round numbers (not measurements): what is checked is the
command's behaviour, not the hardware.
"""

import json
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.simulator.costs import CostFile, CostModel, RolloutCosts, TrainCosts, load_costs
from asyncflow.simulator.search import candidate_splits, costs_for_tp
from asyncflow.simulator.workload import Workload

REPO = Path(__file__).resolve().parents[2]
MODEL = CostModel(rollout=RolloutCosts(step_s=0.01, per_seq_s=1e-4, per_ctx_token_s=1e-7),
                  train=TrainCosts(per_micro_s=0.01, per_token_s=1e-5, optimizer_s=0.02, ref_per_token_s=3e-6))


@pytest.fixture
def cost_file(tmp_path):
    return CostFile({"1": MODEL, "2": MODEL, "device": MODEL}, {"host": "test"}).save(tmp_path / "costs.json")


def test_cost_file_round_trips(cost_file):
    costs = load_costs(cost_file)
    assert costs.variant(1) == MODEL
    with pytest.raises(KeyError, match="has no variant"):
        costs.variant("7")
    data = json.loads(cost_file.read_text())
    data["variants"]["1"]["rollout"]["per_token"] = 1.0
    cost_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown config key"):
        load_costs(cost_file)


@pytest.mark.parametrize("mode", ["continuous", "partial"])
def test_simulate_picks_the_recipes_rollout_model(cost_file, tmp_path, capsys, mode):
    from asyncflow.config import load_config
    from asyncflow.simulator.workload import from_config

    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [f"rollout.{mode}=true", "rollout.partial_kv=keep",
                                                                   "rollout.enable_prefix_caching=false"])
    assert from_config(cfg).rollout_model == mode and from_config(cfg).partial_kv == "keep"
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), "workflow.task=add1_longtail",
               "rollout.max_new_tokens=128",
               "rollout.max_model_len=160", f"rollout.{mode}=true", "--costs", str(cost_file), "--steps", "6",
               "--out", str(tmp_path / "sim")])
    assert rc == 0 and "as configured (async, k=1)" in capsys.readouterr().out
    # Multi-turn agent loops have no cost model: a clear error, not a chunked prediction.
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/tool_async.yaml"), "--costs", str(cost_file)])
    assert rc == 2 and "multi-turn rollouts are not simulated" in capsys.readouterr().err


def test_simulate_tiny_recipe_prints_table_and_draws_gantt(cost_file, tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), "workflow.task=add1_longtail",
               "rollout.max_new_tokens=128",
               "rollout.max_model_len=160", "trainer.micro_batch_size=32", "workflow.prompts_per_step=16",
               "--costs", str(cost_file), "--steps", "6", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "as configured (async, k=1)" in text and "sync, k=0" in text and "async, k=2" in text
    assert (out / "timeline.png").stat().st_size > 10_000
    trace = json.loads((out / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"generate", "train", "stage_weights", "ref_logprobs", "score", "advantages"} <= names


def test_split_search_respects_planner_memory(cost_file, tmp_path, capsys):
    # 16 prompts a step, not the recipe's 128: the same candidate splits and memory verdicts, an eighth of the rows.
    rc = main(["simulate", str(REPO / "recipes/qwen2.5-7b"), "workflow.steps=3", "rollout.max_new_tokens=256",
               "rollout.max_model_len=1280", "trainer.reference_placement=colocated", "workflow.prompts_per_step=16",
               "--costs", str(cost_file),
               "--out", str(tmp_path),
               "--lengths", "lognormal:64:1"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "split search over 16 devices" in text and "best: workflow.rollout_instances=" in text
    # TP2 x DP1 trainer ranks hold a 7B model with Adam states on one replica and a resident reference: no.
    assert "does not fit" in text


def test_candidate_splits_cover_the_devices():
    w = Workload(prompts_per_step=128, samples_per_prompt=8, micro_batch_size=1)
    for instances, tp, dp in candidate_splits(64, w, trainer_mp=2, devices_per_node=8):
        assert instances * tp + dp * 2 == 64 and 1024 % dp == 0
    model, measured = costs_for_tp(CostFile({"device": MODEL}), 4)
    assert not measured and model.rollout.per_seq_s < MODEL.rollout.per_seq_s


def test_scaled_costs_scale_the_simulated_step():
    from asyncflow.simulator.sim import simulate

    w = Workload(mode="sync", max_staleness=0, steps=4, prompts_per_step=4, samples_per_prompt=4,
                 rollout_chunk=16, micro_batch_size=4, lengths="constant:8", max_new_tokens=8, placement="devices")
    base = simulate(w, MODEL).step_time_s
    assert simulate(w, MODEL.scaled(3.0)).step_time_s == pytest.approx(3 * base)


def test_published_h100_decode_step_is_the_weight_read_roofline():
    from asyncflow.models.arch import GPTArch
    from asyncflow.recipes_check import load_recipe
    from asyncflow.simulator import published as pub

    recipe, _ = load_recipe(REPO / "recipes/qwen2.5-7b")
    arch: GPTArch = recipe.arch
    costs = pub.h100_costs(arch, trainer_devices_per_replica=2)
    one = costs.variant("device-tp1").rollout
    n = pub.active_params(arch)
    # Batch 1, no context: the step overhead plus one read of the bf16 weights at 77% of HBM bandwidth, plus
    # one token's 2 x N FLOPs at a third of peak.
    step = one.decode_step(1, 0)
    assert step == pytest.approx(pub.STEP_OVERHEAD_S + 2 * n / (pub.H100_HBM_BYTES_S * pub.MEM_EFFICIENCY)
                                 + 2 * n / (pub.H100_BF16_FLOPS * pub.INFER_COMPUTE_EFFICIENCY))
    assert 7e9 < n < 8e9  # Qwen2.5-7B: 7.6 B parameters
    moe, _ = load_recipe(REPO / "recipes/qwen3-30b-a3b")
    assert 2.5e9 < pub.active_params(moe.arch) < 4e9  # "A3B": about 3.3 B active of 30 B


def test_simulate_modes_searches_the_sample_stream_against_the_colocated_baseline(cost_file, tmp_path, capsys):
    rc = main(["simulate", str(REPO / "recipes/qwen2.5-7b"), "workflow.steps=3", "rollout.max_new_tokens=64",
               "rollout.max_model_len=1088", "trainer.reference_placement=colocated", "workflow.prompts_per_step=4",
               "--costs", str(cost_file), "--out", str(tmp_path), "--lengths", "lognormal:16:1", "--modes"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "mode search over 16 devices" in text and "against the colocated baseline" in text
    assert "best: workflow.mode=stream" in text
