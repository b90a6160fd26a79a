"""The sample stream on the real stack (Megatron trainer, vLLM rollout): the real engines meet the interface the
stream uses (continuous batching through ``RolloutEngine.stream``, partial rollout's weight swaps, the trainer's
data-parallel gather of trained groups). Its semantics are tested on the fake engines (``test_stream``).
"""

import pytest

from tests.recipe_runs import GROUP, PROMPTS, STEPS, check_stream, records, run_recipe

pytestmark = pytest.mark.slow


def test_stream_mode_on_vllm_and_megatron(tmp_path):
    # Partial rollout: vLLM swaps weights under responses in flight, so rows span versions and the per-token
    # bound is checked on vLLM's own token versions.
    run = run_recipe(tmp_path, "stream", 1, "stream", "rollout.partial=true", "algorithm.kl_coef=0")
    check_stream(run, 1, STEPS, PROMPTS, GROUP)
    metrics = records(run)
    for m in metrics:
        assert m["staleness/token_lag_max"] <= 1 and m["rollout/rows"] == PROMPTS * GROUP
    assert run["fresh_logprob_gap_max"] < 1e-4  # vLLM and Megatron agree on the tokens of the trained version
    assert max(m["ray/object_store_bytes"] for m in metrics) < 100_000
