"""The sample stream on the real stack (Megatron trainer, vLLM rollout): the real engines meet the interface the
stream uses (continuous batching through ``RolloutEngine.stream``, partial rollout's weight swaps, the trainer's
data-parallel gather of trained groups). Its semantics are tested on the fake engines (``test_stream``).
"""

import json

import pytest

from tests.recipe_runs import GROUP, PROMPTS, STEPS, check_stream, records, run_recipe

pytestmark = pytest.mark.slow


def test_stream_mode_on_vllm_and_megatron(tmp_path):
    # Partial rollout: vLLM swaps weights under responses in flight, so rows span versions and the per-token
    # bound is checked on vLLM's own token versions. With evaluation: instance 0 drains its vLLM stream, then
    # generates the validation set on the same engine (test_eval_stream has the semantics on the fake engines).
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"<bos>{p}>", "ground_truth": str(int(p) + 1111)}) + "\n"
                           for p in ("1234", "5678", "2020")))
    run = run_recipe(tmp_path, "stream", 1, "stream", "rollout.partial=true", "algorithm.kl_coef=0",
                     f"data.val_path={val}", "data.apply_chat_template=false", "workflow.eval_every=2",
                     "workflow.eval_before_train=true", "workflow.eval_k=2", "workflow.eval_samples=1")
    check_stream(run, 1, STEPS, PROMPTS, GROUP)
    metrics = records(run)
    for m in metrics:
        assert m["staleness/token_lag_max"] <= 1 and m["rollout/rows"] == PROMPTS * GROUP
        assert m["actor/rows"] == PROMPTS * GROUP  # no validation response was trained
    evals = [m for m in metrics if "eval/version" in m]
    assert [m["eval/version"] for m in evals[:2]] in ([0, 2], [0, 3]) and evals[0]["step"] == 0
    assert all(m["eval/prompts"] == 3 for m in evals)
    assert sorted(p.name for p in (run["_out"] / "eval_samples").iterdir()) == [
        f"step_{m['step']:06d}.jsonl" for m in evals]
    assert run["fresh_logprob_gap_max"] < 1e-4  # vLLM and Megatron agree on the tokens of the trained version
    assert max(m["ray/object_store_bytes"] for m in metrics) < 100_000
