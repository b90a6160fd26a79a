"""The sample stream (``workflow.mode: stream``) on the fake engines: everything but the models is real.

Checked: no token is trained more than k versions after the version that made it; every step trains
``prompts_per_step`` whole groups and no prompt is trained twice (group ids count the prompts in stream order);
a response held back for versions (``tests.fakes.slowed.LongTail``) does not hold its step up, its group goes
stale, is counted and its prompt is generated again and trained once (without partial rollout the engine cannot
take newer weights while it holds the response: the group is dropped once it can only go stale); under a per-sample
estimator (REINFORCE++, GAE) the same holds per response, and a held response goes stale alone while the other
responses of its prompt are trained as they finish; DAPO's dynamic
sampling keeps only groups with signal; multi-turn groups (``agent.loop``, ``tests.workflow.stream_tool_loop``) keep
the same contract across turns, their observations are masked out of the loss and a tool that fails or outlives
agent.tool_timeout_s ends its trajectory; the ledger's rules; the config's refusals. The real engines meet the same
interface on the slow run of ``test_stream_real``.
"""

import pytest

from asyncflow.workflow.stream_ledger import StreamLedger
from tests.recipe_runs import GROUP, PROMPTS, SMALL, check_stream, records, run_fake

STREAM = ["workflow.mode=stream"]
LONG_TAIL = ["rollout.engine=tests.fakes.slowed.LongTail", "rollout.partial=true"]
LONG_STEPS = 8
STREAM_STEPS = 4
TOOL_RUN = [*SMALL, "workflow.steps=4", "workflow.task=calc", "algorithm.reward=calc", "rollout.max_new_tokens=12",
            "rollout.max_model_len=32", "rollout.partial=true", "agent.loop=tests.workflow.stream_tool_loop:make_loop",
            "agent.max_turns=3", "agent.tool_timeout_s=0.5", "algorithm.reward_on_error=-1", "algorithm.kl_coef=0"]
STREAM_RUN = [*SMALL, "workflow.rollout_instances=2", f"workflow.steps={STREAM_STEPS}", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, shared_ray):
    tmp = tmp_path_factory.mktemp("stream")
    return {
        # Two rollout engines: each claims steps for the groups it finishes, and both report shares of a step.
        # Checkpoints after steps 2 and 4: ``test_resume_...`` resumes it.
        "stream": run_fake(tmp, tiny_model_dir, "stream", *STREAM, *STREAM_RUN),
        "stream_k0": run_fake(tmp, tiny_model_dir, "stream_k0", *STREAM, *SMALL, "workflow.max_staleness=0",
                              "algorithm.kl_coef=0"),
        "long_tail": run_fake(tmp, tiny_model_dir, "long_tail", *STREAM, *SMALL, *LONG_TAIL,
                              f"workflow.steps={LONG_STEPS}", "algorithm.kl_coef=0"),
        "long_tail_cont": run_fake(tmp, tiny_model_dir, "long_tail_cont", *STREAM, *SMALL, LONG_TAIL[0],
                                   f"workflow.steps={LONG_STEPS}", "algorithm.kl_coef=0"),
        # The reward lags behind rollout: the last step's claims are made before its drops, the groups that finish
        # meanwhile find every step full, and the step each drop reopens needs their prompts back in the stream.
        "dapo": run_fake(tmp, tiny_model_dir, "dapo", *STREAM, "workflow.steps=4",
                         "algorithm.reward=tests.rewards.slow_add1:make_slow_add1", recipe="dapo_async.yaml"),
        # Multi-turn groups under partial rollout: a trajectory's turns span versions.
        "tool": run_fake(tmp, tiny_model_dir, "tool", *STREAM, *TOOL_RUN),
        # A per-sample estimator: the stream takes responses one by one (workflow.stream_unit=auto), each a unit
        # of its own group id, a prompt's GROUP units in a row.
        "per_sample": run_fake(tmp, tiny_model_dir, "per_sample", *STREAM, *SMALL, *LONG_TAIL,
                               f"workflow.steps={LONG_STEPS}", "algorithm.kl_coef=0",
                               "algorithm.advantage=reinforce_pp"),
        # PPO: the critic's values and GAE per response, one by one too.
        "per_sample_gae": run_fake(tmp, tiny_model_dir, "per_sample_gae", *STREAM, *SMALL, *LONG_TAIL,
                                   "workflow.steps=4", "critic.micro_batch_size=8", recipe="ppo_async.yaml"),
    }


@pytest.mark.parametrize("name,k,steps,prompts", [
    ("stream", 1, STREAM_STEPS, PROMPTS), ("stream_k0", 0, 5, PROMPTS), ("long_tail", 1, LONG_STEPS, PROMPTS),
    ("long_tail_cont", 1, LONG_STEPS, PROMPTS), ("dapo", 1, 4, 32), ("tool", 1, 4, PROMPTS),
    ("per_sample", 1, LONG_STEPS, PROMPTS * GROUP), ("per_sample_gae", 1, 4, PROMPTS * GROUP)])
def test_staleness_bound_and_each_prompt_trained_once(runs, name, k, steps, prompts):
    group = {"dapo": 8, "per_sample": 1, "per_sample_gae": 1}.get(name, GROUP)
    check_stream(runs[name], k, steps, prompts, group)
    # Per token, as the rollout saw it: the oldest token put into step s is at most k versions old.
    for m in records(runs[name]):
        assert 0 <= m["staleness/token_lag_min"] <= m["staleness/token_lag_max"] <= k, m


def test_rollout_runs_ahead_up_to_its_bound(runs):
    assert max(runs["stream"]["lags_max_per_step"]) == 1
    assert max(runs["stream_k0"]["lags_max_per_step"]) == 0


def test_a_long_response_does_not_hold_its_step_and_its_group_is_generated_again(runs):
    # Group 0's first response comes back only once the engine serves version 2: steps 0 and 1 train the other
    # groups meanwhile, group 0 finishes beyond its bound (version 0 + k < 2), is counted as stale, and its prompt,
    # generated again, is trained once in a later step. The same holds for group 16 (admitted at version 0 as a
    # spare, or at version 1: then it comes back at version 3).
    run = runs["long_tail"]
    trained = {g: int(step) for step, groups in run["trained_groups"].items() for g in groups}
    assert trained[0] >= 2 and trained[16] >= 2
    assert run["stale_groups"] >= 2
    stale = [m["stream/stale_groups"] for m in records(run)]
    assert sum(stale) == run["stale_groups"]


def test_without_partial_rollout_groups_that_can_only_go_stale_are_dropped_not_drained(runs):
    # The engine holds group 0's first response until it serves version 2, and takes a newer version only once it
    # is empty. Steps 0 and 1 fill with the other groups; group 0 (admitted at version 0) can then only go stale, so
    # the loop drops it with the newer weights staged, and its prompt, generated again, is trained in a later step
    # (draining it instead would wait forever).
    run = runs["long_tail_cont"]
    trained = {g: int(step) for step, groups in run["trained_groups"].items() for g in groups}
    assert trained[0] >= 2
    assert run["stale_groups"] >= 1
    assert sum(m["stream/stale_groups"] for m in records(run)) == run["stale_groups"]


def test_a_per_sample_estimator_trains_a_long_response_apart_from_its_siblings(runs):
    # Unit u is response u % GROUP of prompt u // GROUP. The long tail holds unit 0 (and every 16th) until the
    # engine serves version 2: it goes stale and is generated again alone, while the other responses of its prompt
    # were trained as they finished. In group units (the long_tail run) a prompt's responses share one step.
    run = runs["per_sample"]
    trained = {u: int(step) for step, units in run["trained_groups"].items() for u in units}
    assert trained[0] >= 2 and trained[16] >= 2
    assert run["stale_groups"] >= 2  # counted in units
    steps_of = {}  # prompt -> the steps its trained responses went to (a run ends with some not trained yet)
    for u, step in trained.items():
        steps_of.setdefault(u // GROUP, set()).add(step)
    assert len(steps_of[0]) > 1 or len(steps_of[4]) > 1  # a held response's prompt trained over more than one step
    for m in records(run):
        assert m["actor/rows"] == PROMPTS * GROUP
    grouped = {g: int(step) for step, groups in runs["long_tail"]["trained_groups"].items() for g in groups}
    assert grouped[0] >= 2  # the long_tail run's group 0 (4 responses) waited for its held response


def test_dapo_in_stream_mode_trains_only_groups_with_signal(runs):
    metrics = records(runs["dapo"])
    assert [m["step"] for m in metrics] == list(range(4))
    for m in metrics:
        assert m["actor/rows"] == 256 and m["sampling/kept_rows"] == 256
        assert m["actor/flat_groups"] == 0
    assert sum(m["sampling/judged_rows"] for m in metrics) > 4 * 256  # flat groups were dropped and replaced


def test_multi_turn_groups_mask_observations_and_end_trajectories_whose_tool_fails_or_times_out(runs):
    # Every model turn is one token and every answered call appends OBSERVATION tokens, so a trajectory whose tool
    # answered runs max_turns turns, and one whose tool raised (a % 4 == 0) or outlived agent.tool_timeout_s
    # (a % 4 == 1) ended after its first turn, its reward algorithm.reward_on_error.
    from tests.workflow.stream_tool_loop import OBSERVATION

    turns, ok_rows = 3, 0
    for m in records(runs["tool"]):
        rows, errors, timeouts = m["rollout/rows"], m["agent/errors"], m["agent/tool_timeouts"]
        ok = rows - errors - timeouts
        ok_rows += ok
        assert m["agent/turns_mean"] * rows == pytest.approx(turns * ok + errors + timeouts)
        assert m["agent/observations"] == (turns - 1) * ok
        # The observations are in the rows but not in the loss: the actor trains the model's tokens only.
        assert m["rollout/tokens"] == turns * ok + errors + timeouts + OBSERVATION * m["agent/observations"]
        assert m["actor/tokens"] == turns * ok + errors + timeouts
        assert m["reward/mean"] <= 1.0 - (errors + timeouts) * 2.0 / rows + 1e-6  # -1 each, at most 1 else
    total = sum(m["rollout/rows"] for m in records(runs["tool"]))
    assert 0 < ok_rows < total
    assert sum(m["agent/errors"] for m in records(runs["tool"])) > 0
    assert sum(m["agent/tool_timeouts"] for m in records(runs["tool"])) > 0


def test_resume_trains_the_prompts_the_checkpoint_had_not_trained(runs, tmp_path, tiny_model_dir):
    # The 4-step stream run, with its checkpoints after steps 2 and 4, resumed to 6 steps (into an output
    # directory of its own, from the first run's checkpoints): the resumed run starts at step 4 with the prompts fed
    # but not trained before the checkpoint (in the stream, in either engine or in step 4's partition), then goes on
    # from the stream's cursor. Over both runs no prompt is trained twice. The resumed run has one engine and no
    # reference model (kl_coef=0): fewer processes to start, and which prompts it trains depends on neither.
    import json
    from collections import Counter

    from asyncflow.config import load_config
    from asyncflow.workflow.loop import train
    from tests.recipe_runs import FAKE, REPO

    first = runs["stream"]
    checkpoints = first["_out"] / "checkpoints"
    meta = json.loads((checkpoints / f"step_{STREAM_STEPS:06d}" / "meta.json").read_text())
    pending = [gid for gid, *_ in meta["stream_pending"]]
    assert pending and meta["stream_next_group"] > max(pending)
    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
        *STREAM, *STREAM_RUN, *FAKE, f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path}",
        "workflow.steps=6", f"checkpoint.dir={checkpoints}", "workflow.rollout_instances=1", "algorithm.kl_coef=0"])
    resumed = train(cfg, resume=True)
    assert resumed["first_step"] == STREAM_STEPS and resumed["steps"] == 2
    # The resumed run's record starts with the checkpoint's: every step, each prompt's group once and whole.
    trained = resumed["trained_groups"]
    assert sorted(map(int, trained)) == list(range(6))
    assert set(Counter(g for groups in trained.values() for g in groups).values()) == {GROUP}
    before = {g for step in range(STREAM_STEPS) for g in first["trained_groups"][str(step)]}
    after = {g for step in range(STREAM_STEPS, 6) for g in resumed["trained_groups"][str(step)]}
    assert not before & after
    assert set(pending) & after  # the untrained prompts of the first run came back


def test_resume_refuses_a_stream_unit_other_than_the_checkpoints(runs, tmp_path, tiny_model_dir):
    # The checkpoint's pending records are whole groups; a run that would take single responses cannot feed them.
    from asyncflow.config import load_config
    from asyncflow.config_loader import ConfigError
    from asyncflow.workflow.loop import train
    from tests.recipe_runs import FAKE, REPO

    checkpoints = runs["stream"]["_out"] / "checkpoints"
    cfg = load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
        *STREAM, *STREAM_RUN, *FAKE, f"model.path={tiny_model_dir}", f"observability.output_dir={tmp_path}",
        "workflow.steps=8", f"checkpoint.dir={checkpoints}", "workflow.rollout_instances=1", "algorithm.kl_coef=0",
        "algorithm.advantage=reinforce_pp"])  # 8: past the resume test's checkpoints too, whichever ran first
    with pytest.raises(ConfigError, match="the checkpoint's sample stream moved units of 4 responses, this run's of 1"):
        train(cfg, resume=True)


# ---------------------------------------------------------------------------------------------- the ledger


def test_ledger_fills_steps_in_order_and_turns_late_groups_away():
    ledger = StreamLedger(first=0, last=3, groups_per_step=2, group_size=4, max_staleness=1)
    assert ledger.reserve(10, version=0) == 4  # steps 0 and 1 at version 0 (k=1)
    assert [ledger.claim(0)[:2] for _ in range(3)] == [("ok", 0), ("ok", 0), ("ok", 1)]
    assert ledger.reserve(10, version=0) == 0  # the window is full: 3 claimed + 1 in flight
    assert ledger.reserve(10, version=1) == 2  # version 1 may fill step 2
    assert ledger.claim(1)[:2] == ("ok", 1)
    assert ledger.claim(1) == ("ok", 2, 2)
    # The last group of version 0 finishes now: step 2 is open, beyond 0 + k.
    assert ledger.claim(0) == ("stale", 2, 2)
    assert ledger.reserve(1, version=0) == 0  # it could only go stale
    assert ledger.state()["stale"] == {2: 1}
    assert ledger.claim(2) == ("ok", 2, 3)
    assert ledger.claim(2)[0] == "full"


def test_ledger_spares_and_released_reservations():
    ledger = StreamLedger(first=0, last=2, groups_per_step=4, group_size=2, max_staleness=0, spare=1)
    assert ledger.reserve(10, version=0) == 5  # step 0's four groups and one spare
    ledger.release(2)
    assert ledger.reserve(10, version=0) == 2


def test_ledger_reopens_a_step_when_dynamic_sampling_drops_a_group():
    ledger = StreamLedger(first=0, last=2, groups_per_step=2, group_size=4, max_staleness=1)
    assert [ledger.claim(0)[:2] for _ in range(2)] == [("ok", 0), ("ok", 0)]
    assert ledger.open_step() == 1
    ledger.judged(0, kept=4, judged=8)  # one group of step 0 had no signal
    assert ledger.open_step() == 0
    assert ledger.claim(1)[:2] == ("ok", 0)
    assert ledger.open_step() == 1


# ---------------------------------------------------------------------------------------------- refusals


def test_config_refuses_what_the_stream_does_not_run():
    from asyncflow.config import load_config
    from asyncflow.config_loader import ConfigError
    from tests.recipe_runs import REPO

    recipe = REPO / "recipes/tiny_cpu/grpo_async.yaml"
    with pytest.raises(ConfigError, match="rollout.max_num_seqs=4 must be at least"):
        load_config(recipe, [*STREAM, "rollout.max_num_seqs=4"])
    assert load_config(recipe, [*STREAM, "agent.loop=calculator"]).agent.loop == "calculator"  # multi-turn groups
    with pytest.raises(ConfigError, match="workflow.stream_spare=-1.0 must be at least 0"):
        load_config(recipe, [*STREAM, "workflow.stream_spare=-1"])
    with pytest.raises(ConfigError, match="workflow.stream_unit=sample trains responses apart from their group; "
                                          "algorithm.advantage='grpo' compares"):
        load_config(recipe, [*STREAM, "workflow.stream_unit=sample"])


def test_stream_unit_follows_the_estimator():
    from asyncflow.config import load_config
    from asyncflow.config_rules import stream_unit
    from tests.recipe_runs import REPO

    def unit_of(mode: str, adv: str, choice: str) -> int:
        return stream_unit(load_config(REPO / "recipes/tiny_cpu/grpo_async.yaml", [
            f"workflow.mode={mode}", "workflow.samples_per_prompt=4", f"algorithm.advantage={adv}",
            f"workflow.stream_unit={choice}"]))

    unit = {(mode, adv, choice): unit_of(mode, adv, choice)
            for mode in ("stream", "async") for adv in ("grpo", "reinforce_pp")
            for choice in ("auto", "group", "sample")
            if (mode, adv, choice) != ("stream", "grpo", "sample")}  # refused (test above)
    assert unit.pop(("stream", "reinforce_pp", "auto")) == 1
    assert unit.pop(("stream", "reinforce_pp", "sample")) == 1
    assert set(unit.values()) == {4}  # group estimators, stream_unit=group, and the step-tied modes
