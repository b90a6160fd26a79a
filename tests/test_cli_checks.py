"""``asyncflow train`` refuses what it can see is wrong before it starts anything (Ray, the TransferQueue,
vLLM): a missing model path (once, a mistyped path silently trained a new random tiny model) and a parallel
layout the model or the devices cannot take (once, found minutes later inside an actor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.recipes_check import check_run

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes/tiny_cpu/grpo_async.yaml"


def _refused(capsys, argv: list[str]) -> list[str]:
    """Run the command line; it must return 2 without starting Ray; the ``asyncflow: error:`` lines it printed."""
    ray_before = ray.is_initialized()
    assert main(argv) == 2  # a run that started would never return 2
    assert ray.is_initialized() == ray_before
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("asyncflow: error: ") for line in err), err
    return err


def test_make_tiny_if_missing_is_off_by_default_and_on_in_the_tiny_recipes():
    assert load_config().model.make_tiny_if_missing is False
    for recipe in sorted((REPO / "recipes/tiny_cpu").glob("*.yaml")):
        assert load_config(recipe).model.make_tiny_if_missing, recipe.name
    for recipe in sorted(REPO.glob("recipes/*/config.yaml")):
        assert not load_config(recipe).model.make_tiny_if_missing, recipe.parent.name


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_missing_model_path_is_an_error_not_a_random_model(tmp_path, capsys, command):
    missing = tmp_path / "Qwen2.5-7B-Instuct"
    err = _refused(capsys, [command, f"model.path={missing}", f"observability.output_dir={tmp_path / 'run'}",
                            f"demo.output_dir={tmp_path / 'demo'}"])
    assert err[0].startswith(f"asyncflow: error: model.path {missing} does not exist")
    assert not missing.exists()


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.tensor_parallel=4"], "grpo_async.yaml: trainer.tensor_parallel=4 does not divide "
                                    "num_attention_heads=2"),
    (["ray.accelerator=GPU", "ray.local_devices=1", "trainer.tensor_parallel=2"],
     "grpo_async.yaml: trainer.tensor_parallel=2 exceeds ray.local_devices=1"),
    (["ray.accelerator=GPU", "ray.local_devices=2", "trainer.data_parallel=2", "workflow.rollout_instances=1"],
     "grpo_async.yaml: too many devices: trainer + rollout = 3 > ray.local_devices = 2"),
], ids=["tp-vs-heads", "tp-vs-devices", "too-many-devices"])
def test_an_impossible_layout_fails_before_anything_starts(tiny_model_dir, tmp_path, capsys, overrides, expected):
    err = _refused(capsys, ["train", str(TINY), f"model.path={tiny_model_dir}",
                            f"observability.output_dir={tmp_path / 'run'}", *overrides])
    assert any(line.startswith(f"asyncflow: error: {expected}") for line in err), err
    assert not (tmp_path / "run").exists()


def test_every_tiny_recipe_passes_the_checks_of_train(tiny_model_dir):
    for recipe in sorted((REPO / "recipes/tiny_cpu").glob("*.yaml")):
        overrides = [f"model.path={tiny_model_dir}"]
        assert check_run(load_config(recipe, overrides), recipe, overrides) == [], recipe.name


def test_a_cluster_recipe_gets_the_recipe_check_with_its_overrides(tmp_path):
    recipe = REPO / "recipes/qwen2.5-7b/config.yaml"
    model = tmp_path / "model"
    model.mkdir()
    facts = json.loads((recipe.parent / "model_arch.json").read_text())
    (model / "config.json").write_text(json.dumps(facts))
    overrides = [f"model.path={model}"]
    assert check_run(load_config(recipe, overrides), recipe, overrides) == []
    overrides.append("trainer.tensor_parallel=3")
    problems = check_run(load_config(recipe, overrides), recipe, overrides)
    assert "qwen2.5-7b: trainer.tensor_parallel=3 does not divide num_attention_heads=28" in problems
    (model / "config.json").write_text(json.dumps(dict(facts, num_hidden_layers=2)))
    problems = check_run(load_config(recipe, overrides[:1]), recipe, overrides[:1])
    assert problems and "model_arch.json says" in problems[0]


def test_the_plan_example_of_docs_recipes_is_what_plan_prints(capsys):
    """docs/recipes.md shows ``asyncflow plan recipes/qwen2.5-7b`` and its output; the output once went stale (a row
    added, totals changed) while the doc kept the old table."""
    doc = (REPO / "docs/recipes.md").read_text()
    start = doc.index("```\nqwen2.5-7b: ") + 4
    shown = doc[start:doc.index("```\n", start)]
    assert main(["plan", str(REPO / "recipes/qwen2.5-7b")]) == 0
    assert capsys.readouterr().out == shown
    assert main(["plan", str(REPO / "recipes/qwen2.5-7b"), "trainer.use_distributed_optimizer=false"]) == 1
    fix = capsys.readouterr().out.strip().splitlines()[-1]
    assert fix in " ".join(doc.split()), fix
