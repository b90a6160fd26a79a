"""Evaluation in the streaming modes: the sample stream (``workflow.mode: stream``) and the continuous stream with
partial rollout (``async``, ``rollout.partial``). Rollout instance 0 stops admitting, drains its engine, applies the
newest weights and evaluates them, then admits again. One fake-engine run per mode: the evaluations sit at the
versions the run reached (version 0 first, with ``eval_before_train``), each writes its samples file, and the
training contract of the mode still holds (nothing of an evaluation is trained). Plus the driver's side: an
evaluation whose step was logged before it arrived goes with the next step, and the config rules.
"""

import json

import pytest

from tests.recipe_runs import (
    REPO,
    SMALL,
    STEPS,
    add_one_val_file,
    bare_reporter,
    check_staleness_and_exactly_once,
    check_stream,
    records,
    run_fake,
    service_report,
)

PROMPTS, GROUP, K = 8, 4, 3
VAL = ["1234", "9099", "0000", "5817", "4444"]
SHOWN = 2
MODES = {
    "stream": ["workflow.mode=stream"],
    "partial": ["workflow.mode=async", "rollout.continuous=true", "rollout.partial=true"],
}


@pytest.fixture(scope="module", params=sorted(MODES))
def evaluated(request, tmp_path_factory, tiny_model_dir, shared_ray):
    tmp = tmp_path_factory.mktemp(f"eval_{request.param}")
    val = add_one_val_file(tmp, VAL)
    run = run_fake(tmp, tiny_model_dir, "run", *SMALL, *MODES[request.param], f"data.val_path={val}",
                   "rollout.engine=tests.fakes.drain_checked.DrainChecked",
                   "data.apply_chat_template=false", "workflow.eval_every=2", "workflow.eval_before_train=true",
                   f"workflow.eval_k={K}", f"workflow.eval_samples={SHOWN}",
                   "algorithm.kl_coef=0")  # no reference model: one process fewer to start, nothing here reads it
    run["_mode"] = request.param
    return run


def test_evaluations_at_the_versions_reached(evaluated):
    rows = records(evaluated)
    evals = [r for r in rows if "eval/version" in r]
    # Version 0 before the first group is admitted; version 2 (or 3, when the trainer got there first) as soon as the
    # loop sees it: with max_staleness 1 no group of step 3 can be generated before the engine takes version 2.
    assert [r["eval/version"] for r in evals[:2]] in ([0, 2], [0, 3]) and evals[0]["step"] == 0
    for i, r in enumerate(evals):
        # One evaluation per multiple of eval_every reached, at the first version past it; logged with a step the
        # rollout had not finished when it ran (steps below the version evaluated were trained before it). The
        # last one may come after the rollout of the last step is done, on a busy machine even at the run's final
        # version (STEPS, past the multiple): it is logged with the last step.
        final = r is evals[-1] and r["step"] == STEPS - 1 and r["eval/version"] == STEPS
        assert r["eval/version"] >= 2 * i and (r["eval/version"] <= r["step"] or final), r
        assert r["eval/prompts"] == len(VAL) and r["eval/pass@1"] <= r[f"eval/pass@{K}"] <= 1.0
        assert 0.0 <= r["eval/greedy_acc"] <= 1.0 and r["eval/seconds"] > 0
    assert all(a["eval/version"] // 2 < b["eval/version"] // 2 for a, b in zip(evals, evals[1:]))
    assert all(not any(k.startswith("eval/") for k in r) for r in rows if r not in evals)


def test_eval_samples_files(evaluated):
    rows = records(evaluated)
    evals = [r for r in rows if "eval/version" in r]
    folder = evaluated["_out"] / "eval_samples"
    assert sorted(p.name for p in folder.iterdir()) == [f"step_{r['step']:06d}.jsonl" for r in evals]
    for r in evals:
        lines = [json.loads(line) for line in (folder / f"step_{r['step']:06d}.jsonl").read_text().splitlines()]
        assert [line["prompt"] for line in lines] == [f"<bos>{p}>" for p in VAL[:SHOWN]]
        assert all(line["version"] == r["eval/version"] and line["step"] == r["step"] for line in lines)
        assert all(len(line["sampled"]) == K for line in lines)


def test_training_contract_holds_and_nothing_of_an_evaluation_is_trained(evaluated):
    if evaluated["_mode"] == "stream":
        check_stream(evaluated, 1, STEPS, PROMPTS, GROUP)
    else:
        check_staleness_and_exactly_once(evaluated, 1, STEPS, PROMPTS, GROUP)
    # Every step trained its own groups' rows and no validation response: exactly prompts x group rows.
    assert all(r["actor/rows"] == PROMPTS * GROUP for r in records(evaluated))


def test_one_evaluate_span_per_evaluation(evaluated):
    """The timeline shows each evaluation as rollout instance 0's ``evaluate`` span, with the version it evaluated
    (the run's engine, ``tests.fakes.drain_checked``, failed the run had one started over responses in flight)."""
    trace = json.loads((evaluated["_out"] / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X" and e["name"] == "evaluate"]
    assert {e["cat"] for e in spans} == {"rollout"}
    assert [e["args"]["version"] for e in spans] == [r["eval/version"] for r in records(evaluated)
                                                     if "eval/version" in r]


def test_a_late_evaluation_goes_with_the_next_step(tmp_path, shared_ray):
    """The driver's side: an evaluation report whose step was logged before it arrived is logged with the next
    step (its metrics and samples file), while a late rollout share is still left out; an evaluation report is no
    rollout report (a step needs one of those to be logged). On the tests' Ray: the driver logs its object store."""
    reporter = bare_reporter(tmp_path, 3)
    step0 = [service_report(s, 0, {f"{s}/x": 1.0}) for s in ("actor", "advantage", "reward", "rollout")]
    reporter.collect(step0)
    late_eval = service_report("evaluation", 0, {"eval/version": 0.0}, eval_samples=[{"version": 0, "prompt": "p"}])
    reporter.collect([late_eval, service_report("rollout", 0, {"rollout/rows": 5.0}),
                      *[service_report(s, 1, {}) for s in ("actor", "advantage", "reward", "evaluation")]])
    assert reporter.trained_steps == 1  # step 1 has no rollout report yet: the evaluation's does not count
    reporter.collect([service_report("rollout", 1, {"rollout/rows": 3.0})])
    logged = {h["step"]: h for h in reporter.history}
    assert "eval/version" not in logged[0] and logged[1]["eval/version"] == 0.0
    assert logged[1]["rollout/rows"] == 3.0  # the late share of step 0 was not added anywhere
    sample = json.loads((tmp_path / "eval_samples" / "step_000001.jsonl").read_text())
    assert sample == {"step": 1, "version": 0, "prompt": "p"}
    # Past the run's last step (workflow.steps=3) there is no step to log a late evaluation with: it is dropped.
    reporter.collect([service_report(s, 2, {}) for s in ("actor", "advantage", "reward", "rollout")])
    reporter.collect([service_report("evaluation", 2, {"eval/version": 2.0}, eval_samples=[{"version": 2}])])
    assert reporter.trained_steps == 3 and not reporter.pending
    assert sorted(p.name for p in (tmp_path / "eval_samples").iterdir()) == ["step_000001.jsonl"]
    reporter.observer.close()


def test_two_evaluations_that_end_within_one_step_are_logged_with_two_steps(tmp_path, shared_ray):
    """A fast trainer can log a step while two evaluations end (versions 2 and 4 of a 5-step run evaluated every 2
    versions): each is logged with a step of its own, the later one with the step after, never merged into one record
    (the records then showed version 4 only, seen once in ``test_evaluations_at_the_versions_reached``)."""
    reporter = bare_reporter(tmp_path, 4)
    reporter.collect([service_report(s, 0, {}) for s in ("actor", "advantage", "reward", "rollout")])
    reporter.collect([service_report("evaluation", 1, {"eval/version": 2.0}, eval_samples=[{"version": 2}]),
                      service_report("evaluation", 1, {"eval/version": 4.0}, eval_samples=[{"version": 4}])])
    for step in (1, 2):
        reporter.collect([service_report(s, step, {}) for s in ("actor", "advantage", "reward", "rollout")])
    logged = {h["step"]: h for h in reporter.history}
    assert [logged[step].get("eval/version") for step in (0, 1, 2)] == [None, 2.0, 4.0]
    for step, version in ((1, 2), (2, 4)):
        sample = json.loads((tmp_path / "eval_samples" / f"step_{step:06d}.jsonl").read_text())
        assert sample == {"step": step, "version": version}
    reporter.observer.close()


def _load(*overrides):
    from asyncflow.config import load_config

    return load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", list(overrides))


@pytest.mark.parametrize("mode", sorted(MODES) + ["continuous"])
def test_config_accepts_evaluation_in_the_streaming_modes(mode):
    extra = MODES.get(mode, ["workflow.mode=async", "rollout.continuous=true"])
    cfg = _load("workflow.eval_every=2", "workflow.eval_before_train=true", "data.val_path=v.jsonl", *extra)
    assert cfg.workflow.eval_every == 2


def test_config_still_refuses_evaluation_with_an_agent_loop():
    from asyncflow.config_loader import ConfigError

    with pytest.raises(ConfigError, match="generates single-turn responses"):
        _load("workflow.eval_every=2", "data.val_path=v.jsonl", "agent.loop=calculator")
