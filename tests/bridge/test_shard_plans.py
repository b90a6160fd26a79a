"""Every shard plan against the slow, obviously correct reference: gather everything, then re-split.

Grid: five architectures (GQA with fewer KV groups than TP, MQA with tied embeddings, MHA with QK-norm,
Qwen3-MoE, Qwen2-MoE with a shared expert) x Megatron (TP, PP incl. uneven stages, EP) x vLLM TP.
"""

from __future__ import annotations

import pytest
import torch

from asyncflow.bridge import hf_layout, shards, vllm_layout
from asyncflow.bridge.shards import MRank, ParallelLayout
from tests.bridge.archs import ARCHS, random_hf_state

DENSE_LAYOUTS = [
    ParallelLayout(1, 1),
    ParallelLayout(2, 1),
    ParallelLayout(1, 3),
    ParallelLayout(4, 1),
    ParallelLayout(2, 2, layers_per_stage=(1, 2)),
    ParallelLayout(2, 3),
    ParallelLayout(8, 1),
]
MOE_LAYOUTS = [
    ParallelLayout(1, 1, 2),
    ParallelLayout(2, 2, 2, layers_per_stage=(2, 1)),
    ParallelLayout(2, 1, 4),
    ParallelLayout(1, 3, 1),
]
VLLM_TP = [1, 2, 4, 8]


def _cases():
    for arch_id, arch in ARCHS.items():
        for layout in MOE_LAYOUTS if arch.is_moe else DENSE_LAYOUTS:
            try:
                layout.validate(arch)
            except ValueError:
                continue
            yield pytest.param(arch, layout, id=f"{arch_id}-tp{layout.tp}pp{layout.pp}ep{layout.ep}")


def _reference_megatron(arch, layout, hf_state):
    """Each rank's shards by the reference: full Megatron tensor from HF, then chunked."""
    padded = layout.padded_vocab(arch)
    out = {}
    for rank in layout.ranks():
        out[rank] = {}
        for name in layout.rank_param_names(arch, rank):
            full = hf_layout.hf_to_mcore(arch, name, hf_state, padded)
            out[rank][name] = shards.shard(arch, layout, name, full, rank.tp)
    return out


def _gather_hf(arch, layout, megatron):
    """Reference export: gather every TP shard, unshard, convert to Hugging Face."""
    hf = {}
    for rank in layout.ranks():
        if rank.tp:
            continue
        for name in layout.rank_param_names(arch, rank):
            parts = [megatron[MRank(t, rank.pp, rank.ep)][name] for t in range(layout.tp)]
            hf.update(hf_layout.mcore_to_hf(arch, name, shards.unshard(arch, layout, name, parts)))
    return hf


@pytest.mark.parametrize("arch,layout", list(_cases()))
def test_megatron_shards_and_round_trip(arch, layout):
    layout.validate(arch)
    hf_state = random_hf_state(arch)
    shapes = hf_layout.hf_param_shapes(arch)
    reference = _reference_megatron(arch, layout, hf_state)
    covered = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    for rank, params in reference.items():
        for name, ref in params.items():
            built = shards.shard_from_hf(
                arch, layout, name, rank.tp, shapes, lambda hf, box: hf_state[hf][shards.index(box)]
            )
            assert torch.equal(built, ref), (rank, name)
            if layout.is_sender(arch, rank, name):
                info = hf_layout.param_info(arch, name)
                for piece in shards.pieces(arch, layout, info, rank.tp, shapes):
                    covered[piece.hf][shards.index(piece.hf_box)] += 1
                    assert torch.equal(
                        ref[shards.index(piece.shard_box)], hf_state[piece.hf][shards.index(piece.hf_box)]
                    )
    # The senders' pieces tile every Hugging Face tensor exactly once: nothing missing, nothing twice.
    for name, count in covered.items():
        assert torch.all(count == 1), name
    gathered = _gather_hf(arch, layout, reference)
    assert gathered.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(gathered[name], tensor), name


@pytest.mark.parametrize("arch,layout", list(_cases()))
def test_kernel_plan_matches_gather_then_resplit(arch, layout):
    hf_state = random_hf_state(arch, seed=1)
    megatron = _reference_megatron(arch, layout, hf_state)
    gathered = _gather_hf(arch, layout, megatron)
    for tp in VLLM_TP:
        try:
            vllm_layout.validate_vllm_tp(arch, tp)
        except ValueError:
            continue
        for rank in range(tp):
            ops = vllm_layout.kernel_plan(arch, layout, tp, rank)
            got = vllm_layout.apply_kernel_plan(arch, tp, rank, ops, megatron)
            want = vllm_layout.reference_shard(arch, gathered, tp, rank)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (tp, rank, name)
            # Direct cuts: every copy reads from one Megatron shard that holds it, none is a full tensor
            # unless the parameter is replicated.
            assert all(op.src in megatron for op in ops)


def test_te_names_map_to_local_names():
    arch = ARCHS["qwen3_moe"]
    assert (
        hf_layout.canonical_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
        == "decoder.layers.1.input_layernorm.weight"
    )
    assert (
        hf_layout.canonical_name("decoder.layers.1.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.1.pre_mlp_layernorm.weight"
    )
    assert (
        hf_layout.canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight3")
        == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    # EP rank 1 of 2 holds global experts 2 and 3; stage-local layer 0 of a stage starting at layer 2.
    assert (
        hf_layout.to_global_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", 2, 2)
        == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    info = hf_layout.param_info(arch, "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight")
    assert info.hf == (
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    )


@pytest.mark.parametrize(
    "bad,match",
    [
        (ParallelLayout(3, 1), "must divide the attention heads"),
        (ParallelLayout(1, 2), "does not divide"),
        (ParallelLayout(1, 1, 3), "must divide the number of experts"),
    ],
)
def test_invalid_layouts_say_why(bad, match):
    arch = ARCHS["qwen3_moe"] if bad.ep > 1 else ARCHS["qwen2_gqa"]
    with pytest.raises(ValueError, match=match):
        bad.validate(arch)


def _to_te(name: str) -> str:
    """Rename a local-spec Megatron name to the Transformer Engine spec naming (grouped-GEMM experts)."""
    import re

    name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    if ".mlp.experts." not in name and ".mlp.router" not in name:
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    return re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", r"experts.\2.weight\1", name)


@pytest.mark.parametrize("arch_id", ["qwen2_gqa", "qwen3_moe"])
def test_te_spec_state_dict_exports_like_local(arch_id):
    arch = ARCHS[arch_id]
    layout = ParallelLayout(1, 1)
    hf_state = random_hf_state(arch, seed=2)
    local = _reference_megatron(arch, layout, hf_state)[MRank(0, 0)]
    te = {_to_te(n): t for n, t in local.items()}
    assert any("layer_norm_weight" in n for n in te) and te.keys() != local.keys()
    exported = dict(hf_layout.export_hf(arch, te))
    assert exported.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(exported[name], tensor), name
    padded = layout.padded_vocab(arch)
    for name, tensor in te.items():
        assert torch.equal(hf_layout.hf_to_mcore(arch, name, hf_state, padded), tensor), name
