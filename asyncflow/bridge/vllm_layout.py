"""vLLM's tensor-parallel parameter layout ("kernel format") and the plan that fills it from Megatron shards.

vLLM rank ``t`` of ``T`` holds, for the Llama/Qwen families:

- ``qkv_proj`` = ``[q_t; k_t; v_t]``: query heads ``[t*H/T, (t+1)*H/T)``; KV heads ``[t*K/T, ...)`` when
  ``K >= T``, else the one KV head ``t // (T/K)`` (replicated over ``T/K`` ranks); biases alike;
- ``gate_up_proj`` = ``[gate_t; up_t]`` (also each routed expert's slab of ``w13_weight`` and the
  shared expert's), ``o_proj`` / ``down_proj`` / ``w2_weight`` split on the input dimension;
- ``embed_tokens`` / ``lm_head``: vocabulary padded to a multiple of 64, then split into T row blocks
  (padding rows are zero);
- norms, the MoE router and the shared-expert gate replicated.

``vllm_boxes`` writes that down as Hugging Face boxes per vLLM parameter; ``reference_shard`` cuts the
same shards from full Hugging Face tensors in the plainest way (and is checked against vLLM's own weight
loaders in tests); ``kernel_plan`` intersects the boxes with the Megatron ``shards.pieces`` so that each
vLLM rank's shard is copied from the few Megatron shards that hold it, never from a gathered tensor.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from asyncflow.bridge.hf_layout import hf_param_shapes, param_info
from asyncflow.bridge.shards import Box, MRank, ParallelLayout, index, pieces
from asyncflow.models.arch import GPTArch

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclasses.dataclass(frozen=True)
class Segment:
    """Box ``hf_box`` of Hugging Face tensor ``hf`` lands at ``dst_prefix`` + ``dst_box`` of a vLLM param."""

    hf: str
    hf_box: Box
    dst_box: Box
    dst_prefix: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class CopyOp:
    """Copy ``src_box`` of Megatron rank ``src``'s shard of ``src_name`` into a vLLM parameter."""

    src: MRank
    src_name: str
    src_box: Box
    dst_name: str
    dst_prefix: tuple[int, ...]
    dst_box: Box


def validate_vllm_tp(arch: GPTArch, tp: int) -> None:
    """Raise ``ValueError`` when vLLM cannot run ``arch`` at tensor-parallel size ``tp``."""
    heads, kv = arch.num_attention_heads, arch.num_query_groups
    if heads % tp or (kv % tp if kv >= tp else tp % kv):
        raise ValueError(
            f"vLLM tp={tp} needs heads ({heads}) divisible and KV heads ({kv}) divisible or dividing"
        )
    ffns = (
        [arch.moe_ffn_hidden_size, arch.shared_expert_ffn_hidden_size]
        if arch.is_moe
        else [arch.ffn_hidden_size]
    )
    if any(f % tp for f in ffns if f):
        raise ValueError(f"vLLM tp={tp} must divide the MLP intermediate sizes {ffns}")


def _kv_heads(arch: GPTArch, tp: int, rank: int) -> range:
    kv = arch.num_query_groups
    if kv >= tp:
        return range(rank * kv // tp, (rank + 1) * kv // tp)
    head = rank // (tp // kv)
    return range(head, head + 1)


def _rows(start: int, stop: int, shape: tuple[int, ...]) -> Box:
    return ((start, stop), *((0, n) for n in shape[1:]))


def _column(hf_names, shapes, rows_of, prefix=()) -> tuple[list[Segment], int]:
    """Stack row ranges of several Hugging Face tensors (q/k/v or gate/up) into one column shard."""
    segs, at = [], 0
    for name in hf_names:
        start, stop = rows_of(name)
        shape = shapes[name]
        segs.append(Segment(name, _rows(start, stop, shape), _rows(at, at + stop - start, shape), prefix))
        at += stop - start
    return segs, at


def vllm_boxes(arch: GPTArch, tp: int, rank: int) -> dict[str, tuple[tuple[int, ...], list[Segment]]]:
    """vLLM parameter name -> (shape on ``rank``, the Hugging Face boxes it is made of)."""
    validate_vllm_tp(arch, tp)
    shapes, h, hd = hf_param_shapes(arch), arch.hidden_size, arch.head_dim
    out: dict[str, tuple[tuple[int, ...], list[Segment]]] = {}

    def replicated(vname: str, hf: str) -> None:
        out[vname] = (
            shapes[hf],
            [Segment(hf, _rows(0, shapes[hf][0], shapes[hf]), _rows(0, shapes[hf][0], shapes[hf]))],
        )

    def vocab(vname: str, hf: str) -> None:
        padded = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        per = padded // tp
        start, stop = rank * per, min((rank + 1) * per, arch.vocab_size)
        segs = [Segment(hf, ((start, stop), (0, h)), ((0, stop - start), (0, h)))] if stop > start else []
        out[vname] = ((per, h), segs)

    def row(vname: str, hf: str, prefix=()) -> list[Segment]:
        rows, cols = shapes[hf]
        n = cols // tp
        return [Segment(hf, ((0, rows), (rank * n, (rank + 1) * n)), ((0, rows), (0, n)), prefix)]

    def gate_up(base: str, prefix=()) -> tuple[list[Segment], int]:
        n = shapes[base + "gate_proj.weight"][0] // tp
        return _column(
            [base + "gate_proj.weight", base + "up_proj.weight"],
            shapes,
            lambda _: (rank * n, (rank + 1) * n),
            prefix,
        )

    vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    q_per = arch.num_attention_heads // tp
    kv = _kv_heads(arch, tp, rank)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        replicated(p + "input_layernorm.weight", p + "input_layernorm.weight")
        replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            names = [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
            segs, rows = _column(
                names,
                shapes,
                lambda n: (
                    (rank * q_per * hd, (rank + 1) * q_per * hd)
                    if ".q_proj." in n
                    else (kv.start * hd, kv.stop * hd)
                ),
            )
            out[f"{p}self_attn.qkv_proj.{kind}"] = ((rows, h) if kind == "weight" else (rows,), segs)
        out[p + "self_attn.o_proj.weight"] = (
            (h, arch.num_attention_heads * hd // tp),
            row(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight"),
        )
        if arch.qk_layernorm:
            replicated(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight")
            replicated(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight")
        mlps = [("mlp.", arch.ffn_hidden_size)] if not arch.is_moe else []
        if arch.is_moe:
            replicated(p + "mlp.gate.weight", p + "mlp.gate.weight")
            inter = arch.moe_ffn_hidden_size // tp
            w13, w2 = [], []
            for j in range(arch.num_experts):
                w13 += gate_up(f"{p}mlp.experts.{j}.", (j,))[0]
                w2 += row(
                    f"{p}mlp.experts.{j}.down_proj.weight", f"{p}mlp.experts.{j}.down_proj.weight", (j,)
                )
            out[p + "mlp.experts.w13_weight"] = ((arch.num_experts, 2 * inter, h), w13)
            out[p + "mlp.experts.w2_weight"] = ((arch.num_experts, h, inter), w2)
            if arch.shared_expert_ffn_hidden_size:
                mlps.append(("mlp.shared_expert.", arch.shared_expert_ffn_hidden_size))
                replicated(p + "mlp.shared_expert_gate.weight", p + "mlp.shared_expert_gate.weight")
        for base, inter in mlps:
            segs, rows = gate_up(p + base)
            out[f"{p}{base}gate_up_proj.weight"] = ((rows, h), segs)
            out[f"{p}{base}down_proj.weight"] = (
                (h, inter // tp),
                row(p + base + "down_proj.weight", p + base + "down_proj.weight"),
            )
    replicated("model.norm.weight", "model.norm.weight")
    if not arch.tie_word_embeddings:
        vocab("lm_head.weight", "lm_head.weight")
    return out


def reference_shard(
    arch: GPTArch, hf_state: dict[str, torch.Tensor], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Reference: vLLM rank ``rank``'s kernel-format tensors cut from full Hugging Face tensors.

    Written independently of ``vllm_boxes`` (plain head arithmetic and ``torch.cat``) so the tests compare
    two derivations; tests also compare it with what vLLM's own weight loaders produce.
    """
    hd, out = arch.head_dim, {}
    q_per = arch.num_attention_heads // tp
    kv = _kv_heads(arch, tp, rank)
    padded = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING

    def split(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank]

    for name, t in hf_state.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])])
            out[name] = split(full, 0)
        elif ".q_proj." in name:
            k, v = hf_state[name.replace("q_proj", "k_proj")], hf_state[name.replace("q_proj", "v_proj")]
            q = t[rank * q_per * hd : (rank + 1) * q_per * hd]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [q, k[kv.start * hd : kv.stop * hd], v[kv.start * hd : kv.stop * hd]]
            )
        elif name.endswith("gate_proj.weight") and ".experts." not in name:
            up = hf_state[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([split(t, 0), split(up, 0)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")) and ".experts." not in name:
            out[name] = split(t, 1)
        elif ".experts." in name or any(s in name for s in (".k_proj.", ".v_proj.", "up_proj")):
            continue
        else:
            out[name] = t.clone()
    for layer in range(arch.num_layers if arch.is_moe else 0):
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(arch.num_experts)
        out[p + "w13_weight"] = torch.stack(
            [
                torch.cat(
                    [
                        split(hf_state[f"{p}{j}.gate_proj.weight"], 0),
                        split(hf_state[f"{p}{j}.up_proj.weight"], 0),
                    ]
                )
                for j in experts
            ]
        )
        out[p + "w2_weight"] = torch.stack([split(hf_state[f"{p}{j}.down_proj.weight"], 1) for j in experts])
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None."""
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(x0 >= x1 for x0, x1 in box) else box


def shift(box: Box, inner: Box, frm: Box) -> Box:
    """Where sub-box ``inner`` of ``frm`` lands in ``box`` (same extents as ``frm``)."""
    return tuple((b0 + i0 - f0, b0 + i1 - f0) for (b0, _), (i0, i1), (f0, _) in zip(box, inner, frm))


def hf_sources(arch: GPTArch, layout: ParallelLayout) -> dict[str, list[tuple[MRank, str, object]]]:
    """Hugging Face name -> the (sender rank, Megatron name, Piece) that hold it, deduplicated."""
    shapes = hf_param_shapes(arch)
    found: dict[str, list] = defaultdict(list)
    for rank in layout.ranks():
        for name in layout.rank_param_names(arch, rank):
            if not layout.is_sender(arch, rank, name):
                continue
            for piece in pieces(arch, layout, param_info(arch, name), rank.tp, shapes):
                found[piece.hf].append((rank, name, piece))
    return found


def kernel_plan(arch: GPTArch, layout: ParallelLayout, tp: int, rank: int) -> list[CopyOp]:
    """Copies that fill vLLM rank ``rank``'s kernel-format parameters straight from Megatron shards."""
    sources = hf_sources(arch, layout)
    ops = []
    for vname, (_, segments) in vllm_boxes(arch, tp, rank).items():
        for seg in segments:
            for src, mname, piece in sources[seg.hf]:
                common = intersect(seg.hf_box, piece.hf_box)
                if common is None:
                    continue
                ops.append(
                    CopyOp(
                        src,
                        mname,
                        shift(piece.shard_box, common, piece.hf_box),
                        vname,
                        seg.dst_prefix,
                        shift(seg.dst_box, common, seg.hf_box),
                    )
                )
    return ops


def apply_kernel_plan(
    arch: GPTArch,
    tp: int,
    rank: int,
    ops: list[CopyOp],
    shards: dict[MRank, dict[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Run ``ops`` against Megatron shards held in memory (tests, single-host tools); padding stays zero."""
    out = {name: torch.zeros(shape, dtype=dtype) for name, (shape, _) in vllm_boxes(arch, tp, rank).items()}
    for op in ops:
        dst = out[op.dst_name][op.dst_prefix] if op.dst_prefix else out[op.dst_name]
        dst[index(op.dst_box)] = shards[op.src][op.src_name][index(op.src_box)]
    return out
