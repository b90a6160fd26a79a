"""The async rollout modes end to end on the fake engines (``asyncflow.engines.fake``, tokens slowed down so that
versions arrive mid-rollout): continuous batching with partial rollout, on long-tailed responses (more rows per step
than engine slots, so slots free up and refill), with two rollout engines pulling from the same steps.

The workflow's guarantees hold per token: every token of a trained row comes from a version that admitted
its step (token lag <= max_staleness), every prompt is trained exactly once with its whole group, and the
engine's running set stays well filled. Continuous batching without partial rollout runs the same stream; its
own guarantee (weights never change under running sequences) is checked on the multi-turn runs of
``tests/agents/test_tool_runs.py``, which stream that way.

The real engines meet the interface these modes use in the real-stack run of ``test_stream_real``: vLLM's stream
swapping weights at a token boundary under responses in flight (partial rollout), rows spanning versions, and the
trainer's logprobs equal to vLLM's on the tokens of the version trained. Two real rollout instances share steps in
the two-host runs (``tests/cluster``), and the relay transport is in ``test_e2e``'s TP2 x PP2 run.
"""

from collections import Counter

import pytest

from tests.recipe_runs import SMALL, records, run_fake

# Two engines of SEQS slots each and 64 rows a step: each engine has 8x as many rows as slots, so a step's
# rollout is several waves long. Training streams alongside it and publishes a version a short tail after the
# step's last row; that tail must be shorter than the next step's rollout for a version to arrive mid-rollout
# (with 16 slots, two waves, the two were close and a run could see no swap at all; 4 slots give a margin of ~4x).
STEPS, PROMPTS, GROUP, SEQS = 4, 16, 4, 4
# No reference model (kl_coef=0): one trainer process fewer per run; nothing here reads its logprobs.
LONGTAIL = ["workflow.task=add1_longtail", "rollout.max_new_tokens=48", "rollout.max_model_len=64",
            f"rollout.max_num_seqs={SEQS}", f"workflow.steps={STEPS}", "algorithm.kl_coef=0", "rollout.partial=true",
            f"workflow.prompts_per_step={PROMPTS}", "workflow.rollout_instances=2"]
# A step's rollout outlasts the training tail of the previous one.
SLOW_TOKENS = "rollout.engine=tests.fakes.slowed.SlowTokens"


@pytest.fixture(scope="module")
def partial(tmp_path_factory, tiny_model_dir, shared_ray):
    """The partial-rollout run's summary (a step's metrics merge both engines' reports: counts add up, a max is
    the larger one, a mean the mean)."""
    return run_fake(tmp_path_factory.mktemp("modes"), tiny_model_dir, "partial", *SMALL, *LONGTAIL, SLOW_TOKENS)


def test_token_staleness_bound_and_exactly_once(partial):
    assert partial["steps"] == STEPS
    assert max(partial["lags_max_per_step"]) <= 1
    rows = records(partial)
    assert max(r["staleness/token_lag_max"] for r in rows) <= 1
    assert all(r["staleness/token_lag_min"] >= 0 for r in rows)
    trained = partial["trained_groups"]
    assert sorted(map(int, trained)) == list(range(STEPS))
    counts = Counter(g for groups in trained.values() for g in groups)
    assert set(counts) == set(range(STEPS * PROMPTS)) and set(counts.values()) == {GROUP}
    for step, groups in trained.items():
        assert {g // PROMPTS for g in groups} == {int(step)}


def test_engine_stays_full(partial):
    # Sampled from each engine after every engine step while the step had rows in flight; the tail of the last
    # step drains, so the mean over a step (and over the two engines) is below SEQS but well above half.
    for r in records(partial):
        assert r["rollout/in_flight_max"] == SEQS
        assert r["rollout/in_flight_mean"] > SEQS / 2, r["rollout/in_flight_mean"]


def test_partial_rollout_spans_versions(partial):
    rows = records(partial)
    # A step's rollout (several waves) lasts longer than the training tail after the previous step's last row,
    # so newer versions arrive mid-rollout and are swapped in at a token boundary: some step then mixes tokens
    # of two versions.
    assert sum(r["rollout/weight_swaps"] for r in rows) >= 1
    assert any(r["staleness/token_lag_min"] < r["staleness/token_lag_max"] for r in rows)
    # Tokens made by the version being trained, including those of rows that began on an older version
    # (generated after the swap): the trainer's logprob equals the rollout's behaviour logprob.
    assert sum(r.get("check/fresh_spanning_tokens", 0) for r in rows) > 0
    assert partial["fresh_logprob_gap_max"] < 1e-5
