"""Evaluation while training (``asyncflow.workflow.evaluation``): the unbiased pass@k, the config rules, and fake-engine
runs with a validation file in both step-tied modes. The fake rollout engine is deterministic, so the evaluation of
the weights before training (version 0, the first thing the engine generates) is recomputed here on an engine of
the same config and must match the logged metrics exactly; later evaluations must sit at the right steps and
versions, and the validation responses must never reach the trainer (every training prompt trained exactly once).
"""

import dataclasses
import itertools
import json
import math

import pytest

from asyncflow.workflow.evaluation import pass_at_k
from tests.recipe_runs import (
    FAKE,
    REPO,
    SMALL,
    add_one_val_file,
    check_staleness_and_exactly_once,
    records,
    run_fake,
)

STEPS, PROMPTS, GROUP, K = 5, 8, 4, 3
VAL = ["1234", "9099", "0000", "5817", "4444", "7260"]  # add-one prompts; the file has one row more than val_size
VAL_SIZE, SHOWN = 5, 3


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c of them correct) that hold a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_subset_probability(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_bounds_and_large_n():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    # Where C(n, k) overflows a float, the product form stays finite and equals 1 - C(n-c,k)/C(n,k).
    assert pass_at_k(2000, 10, 500) == pytest.approx(1 - math.comb(1990, 500) / math.comb(2000, 500))
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward in verl's shape (text in), for the evaluator: 1 when the response starts with the answer."""
    return 1.0 if solution_str.startswith(ground_truth) else 0.0


def test_evaluator_schedule_and_a_verl_shaped_reward(tiny_model_dir):
    """In process, on the fake engine: the evaluator scores through the run's reward scorer (here verl's text
    signature, with the row's ground truth), and decides when the next evaluation is due."""
    from transformers import AutoTokenizer

    from asyncflow.config import VllmConfig
    from asyncflow.engines.fake import FakeRolloutEngine
    from asyncflow.rewards import RewardConfig
    from asyncflow.workflow.evaluation import EvalSpec, Evaluator

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(f"<bos>{p}>")["input_ids"] for p in VAL]
    cfg = VllmConfig(engine="fake", max_new_tokens=4)
    # Answers the fresh engine's greedy responses start with for half the prompts: greedy accuracy 1/2.
    reference = FakeRolloutEngine(cfg, tiny_model_dir)
    greedy = [tok.decode(s.response_ids, skip_special_tokens=True)
              for s in reference.generate(prompts, n=1, temperature=0.0)]
    answers = [g if i % 2 == 0 else "x" for i, g in enumerate(greedy)]
    sampled = [tok.decode(s.response_ids, skip_special_tokens=True) for s in reference.generate(prompts, n=K)]
    spec = EvalSpec(prompts=prompts, answers=answers, every=2, before=False, k=K, samples=2, correct_reward=1.0,
                    reward="tests.workflow.test_eval:verl_score", reward_on_error=-1.0, reward_cfg=RewardConfig())
    evaluator = Evaluator(spec, str(tiny_model_dir))
    assert [evaluator.due(v) for v in (0, 1, 2)] == [False, False, True]
    metrics, samples = evaluator.run(FakeRolloutEngine(cfg, tiny_model_dir), 3)
    correct = [sum(sampled[i * K + j].startswith(answers[i]) for j in range(K)) for i in range(len(VAL))]
    assert metrics["eval/greedy_acc"] == 0.5 and metrics["eval/version"] == 3.0
    assert metrics[f"eval/pass@{K}"] == pytest.approx(sum(c > 0 for c in correct) / len(VAL))
    assert metrics["eval/mean_reward"] == pytest.approx(sum(correct) / (K * len(VAL)))
    assert [s["ground_truth"] for s in samples] == answers[:2] and samples[0]["greedy"]["reward"] == 1.0
    assert not evaluator.due(3) and evaluator.due(4)  # the next multiple of eval_every after version 3
    evaluator.close()


def test_a_restarted_instance_evaluates_at_the_next_multiple_not_version_0_again(tiny_model_dir):
    """Rollout instance 0 started again by Ray after its death (``restarted``) skips ``before`` (version 0 was
    evaluated by its first incarnation) and evaluates at the first multiple of ``every`` from the first version it
    admits: that version when it is one (an evaluation its death cut short), else the next."""
    from transformers import AutoTokenizer

    from asyncflow.rewards import RewardConfig
    from asyncflow.workflow.evaluation import EvalSpec, Evaluator

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = EvalSpec(prompts=[tok("<bos>1234>")["input_ids"]], answers=["2345"], every=2, before=True, k=1,
                    samples=1, correct_reward=1.0, reward="tests.workflow.test_eval:verl_score", reward_on_error=-1.0,
                    reward_cfg=RewardConfig())
    first = Evaluator(spec, str(tiny_model_dir), restarted=False)
    assert first.due(0)
    for version, due in ((3, [False, True]), (4, [True, True])):
        again = Evaluator(spec, str(tiny_model_dir), restarted=True)
        assert [again.due(version), again.due(4)] == due, version
        again.close()
    # The newest evaluation reported before the death (the board's) is not made again: v4 was, so v6 is next.
    reported = Evaluator(spec, str(tiny_model_dir), restarted=True, evaluated=4)
    assert [reported.due(4), reported.due(5), reported.due(6)] == [False, False, True]
    reported.close()
    none_after = Evaluator(dataclasses.replace(spec, every=0), str(tiny_model_dir), restarted=True)
    assert not none_after.due(0) and not none_after.due(5)  # only ``before``, which the first incarnation made
    for evaluator in (first, none_after):
        evaluator.close()


def test_the_board_keeps_the_newest_evaluation_reported():
    import asyncio

    from asyncflow.observability import keys
    from asyncflow.workflow.board import VersionBoard

    async def reports() -> list[int]:
        board, seen = VersionBoard(), []
        seen.append(await board.evaluated())
        for metrics in ({"rollout/rows": 8.0}, {keys.EVAL_VERSION: 2.0}, {keys.EVAL_VERSION: 4.0},
                        {keys.EVAL_VERSION: 2.0}):
            await board.report({"step": 0, "metrics": metrics})
            seen.append(await board.evaluated())
        return seen

    assert asyncio.run(reports()) == [-1, -1, 2, 4, 4]


def _load(*overrides):
    from asyncflow.config import load_config

    return load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["workflow.eval_every=2"], "needs data.val_path"),
    (["workflow.eval_every=2", "data.val_path=v.jsonl", "workflow.eval_k=0"], "workflow.eval_k=0 must be at least 1"),
    (["workflow.eval_every=-1"], "workflow.eval_every=-1 must be at least 0"),
    (["data.val_size=0"], "data.val_size=0 must be at least 1"),
])
def test_config_rules_refuse(overrides, message):
    from asyncflow.config_loader import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_config_rules_accept_sync_continuous():
    cfg = _load("workflow.eval_every=2", "data.val_path=v.jsonl", "workflow.mode=sync", "rollout.continuous=true")
    assert cfg.workflow.eval_every == 2 and cfg.data.val_path == "v.jsonl"


def _eval_overrides(val):
    return [*SMALL, f"data.val_path={val}", f"data.val_size={VAL_SIZE}", "data.apply_chat_template=false",
            "workflow.eval_every=2", "workflow.eval_before_train=true", f"workflow.eval_k={K}",
            f"workflow.eval_samples={SHOWN}",
            "algorithm.kl_coef=0"]  # no reference model: one process fewer to start, and nothing here reads it


def _expected_before_training(tmp_path, model_dir, *overrides) -> dict:
    """What the version-0 evaluation must log, recomputed on a fresh fake engine of the run's config."""
    from transformers import AutoTokenizer

    from asyncflow.config import load_config
    from asyncflow.data.synthetic import Add1Task
    from asyncflow.engines.fake import FakeRolloutEngine

    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [f"model.path={model_dir}", *FAKE, *overrides])
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = Add1Task(tok)
    prompts = [[tok.bos_token_id, *tok.convert_tokens_to_ids(list(p)), task.sep_id] for p in VAL[:VAL_SIZE]]
    engine = FakeRolloutEngine(cfg.rollout, model_dir)
    greedy = [task.reward(p, s.response_ids) for p, s in zip(prompts, engine.generate(prompts, n=1, temperature=0))]
    sampled = [task.reward(prompts[i // K], s.response_ids) for i, s in enumerate(engine.generate(prompts, n=K))]
    correct = [sum(r >= 1.0 for r in sampled[i * K:(i + 1) * K]) for i in range(len(prompts))]
    return {"eval/greedy_acc": sum(r >= 1.0 for r in greedy) / len(prompts),
            "eval/greedy_reward": sum(greedy) / len(prompts),
            "eval/mean_reward": sum(sampled) / len(sampled),
            f"eval/pass@{K}": sum(c > 0 for c in correct) / len(prompts),
            "eval/pass@1": sum(c / K for c in correct) / len(prompts)}


@pytest.fixture(scope="module", params=["sync", "async"])
def evaluated(request, tmp_path_factory, tiny_model_dir, shared_ray):
    tmp = tmp_path_factory.mktemp(f"eval_{request.param}")
    overrides = _eval_overrides(add_one_val_file(tmp, VAL))
    mode = [f"workflow.mode={request.param}"]
    run = run_fake(tmp, tiny_model_dir, "run", *overrides, *mode)
    run["_expected_v0"] = _expected_before_training(tmp, tiny_model_dir, *overrides, *mode)
    run["_mode"] = request.param
    return run


def test_eval_metrics_at_the_right_steps(evaluated):
    rows = records(evaluated)
    evals = [r for r in rows if "eval/version" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/version"] == 0
    if evaluated["_mode"] == "sync":  # lock-step: step s generates with version s, so evaluations at 0, 2, 4
        assert [(r["step"], r["eval/version"]) for r in evals] == [(0, 0), (2, 2), (4, 4)]
    else:  # step s admits a version in [s - 1, s]; each evaluation at the first one past the next multiple of 2
        assert len(evals) >= 2
        for i, r in enumerate(evals):
            assert r["step"] - 1 <= r["eval/version"] <= r["step"] and r["eval/version"] >= 2 * i
        assert all(a["eval/version"] // 2 < b["eval/version"] // 2 for a, b in zip(evals, evals[1:]))
    for r in evals:
        assert r["eval/prompts"] == VAL_SIZE
        assert 0.0 <= r["eval/greedy_acc"] <= 1.0 and 0.0 <= r["eval/mean_reward"] <= 1.0
        assert r["eval/pass@1"] <= r[f"eval/pass@{K}"] <= 1.0
    # Steps without an evaluation carry no eval metric.
    assert all(not any(k.startswith("eval/") for k in r) for r in rows if r not in evals)


def test_eval_before_training_matches_a_fresh_engine(evaluated):
    first = records(evaluated)[0]
    for key, want in evaluated["_expected_v0"].items():
        assert first[key] == pytest.approx(want), key


def test_eval_rows_never_trained(evaluated):
    k = 0 if evaluated["_mode"] == "sync" else 1
    check_staleness_and_exactly_once(evaluated, k, STEPS, PROMPTS, GROUP)
    assert all(r["actor/rows"] == PROMPTS * GROUP for r in records(evaluated))


def test_eval_samples_file(evaluated):
    rows = records(evaluated)
    for r in (r for r in rows if "eval/version" in r):
        path = evaluated["_out"] / "eval_samples" / f"step_{r['step']:06d}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == SHOWN
        for line, prompt in zip(lines, VAL):
            assert line["prompt"] == f"<bos>{prompt}>" and line["version"] == r["eval/version"]
            assert len(line["sampled"]) == K and 0.0 <= line["greedy"]["reward"] <= 1.0
    assert len(list((evaluated["_out"] / "eval_samples").iterdir())) == sum("eval/version" in r for r in rows)


def test_response_length_and_entropy_every_step(evaluated):
    import math as m

    for r in records(evaluated):
        assert 1 <= r["response/length_min"] <= r["response/length_mean"] <= r["response/length_max"] <= 4
        assert 0.0 <= r["response/clip_ratio"] <= 1.0
        assert 0.0 < r["actor/entropy"] <= m.log(19) + 1e-6  # the tiny model's vocabulary


def test_a_missing_validation_file_is_one_error_line_before_the_run(tmp_path):
    import subprocess
    import sys

    missing, model = tmp_path / "val.jsonl", tmp_path / "model"
    argv = ["train", str(REPO / "recipes/tiny_cpu/grpo_async.yaml"), f"model.path={model}", f"data.val_path={missing}",
            "workflow.eval_every=2", f"observability.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "asyncflow.cli", *argv], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"asyncflow: error: {missing}: no such file or directory (data.val_path); data.val_path is the validation set "
        "of workflow.eval_every"]
    assert not model.exists()  # refused before the tiny model is made, so before Ray and the engines too
