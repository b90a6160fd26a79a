"""Activation memory of a Megatron transformer layer, after Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (MLSys 2023, arXiv:2205.05198), Section 4 and Table 2.

The paper counts the bytes each layer keeps for the backward pass, per micro-batch of ``b`` sequences of
``s`` tokens, for GPT-3 (hidden ``h``, ``a`` heads, 4h GeLU MLP, dropout, 16-bit activations):

| | bytes per layer |
|---|---|
| no parallelism, no recompute | ``sbh (34 + 5as/h)`` |
| tensor parallel ``t`` | ``sbh (10 + 24/t + 5as/(ht))`` |
| tensor + sequence parallel | ``sbh/t (34 + 5as/h)`` |
| tensor + sequence parallel, selective recompute | ``34 sbh/t`` |
| full recompute | ``2 sbh`` (only the layer input; ``/t`` with sequence parallelism) |

``10 sbh`` are the inputs of the two layer norms and of the two column-parallel linears (2 bytes each) plus
two dropout masks (1 byte each): tensor parallelism leaves them whole on every rank and sequence parallelism
splits them. ``24 sbh`` are split by tensor parallelism (Q, K, V, the projection input, the MLP's 4h GeLU
input and output). ``5as^2b`` is core attention (softmax output, its dropout mask and dropout output), which
selective recompute drops.

``LayerTerms`` keeps that split, per token; ``paper_terms`` is the GPT-3 case and ``layer_terms`` the Llama /
Qwen family as Megatron-core 0.16 runs it, term by term (checked against what autograd saves in
``tests/test_plan.py``):

- no dropout (``attention_dropout = hidden_dropout = 0``: no masks are kept);
- RMSNorm: Transformer Engine's fused norm keeps its input (and the linear after it keeps the norm output);
  torch's ``RMSNorm`` (the local spec, CPU) keeps one more hidden-sized tensor;
- attention: Q, K, V (``heads + 2 kv_heads`` head dims), the projection input; flash / TE fused attention
  keeps no ``s x s`` term, Megatron's unfused ``DotProductAttention`` keeps the softmax output (fp32, plus a
  16-bit copy for 16-bit models) and, with GQA, K and V repeated to all heads;
- SwiGLU MLP (``ffn`` wide): the fc1 output (``2 ffn``), SiLU output, the up half plus Megatron's
  ``glu_linear_offset`` (a new tensor), and the fc2 input: ``5 ffn``;
- MoE, in expectation under balanced routing: the router keeps fp32 logits and probabilities; every token
  reaches ``topk`` experts, and since the dispatcher gathers tokens over the TP x EP ranks each rank keeps
  ``topk`` permuted token copies and ``topk`` expert outputs (``2 topk hidden``) per token of the *whole*
  sequence, whatever TP, plus the expert MLPs (``5 moe_ffn / ETP`` each).
"""

from __future__ import annotations

import dataclasses

from asyncflow.models.arch import GPTArch


@dataclasses.dataclass(frozen=True)
class LayerTerms:
    """Bytes one transformer layer keeps for the backward pass, per token of the micro-batch."""

    replicated: float
    """Kept whole on every TP rank unless sequence parallelism splits it (the paper's ``10 h``)."""
    split: float
    """Split over the TP ranks (the paper's ``24 h``)."""
    scores: float
    """Per token *and per key position*, split over TP (the paper's ``5 a``; 0 with flash attention)."""
    core_internal: float = 0.0
    """Other core-attention internals (GQA-repeated K/V of unfused attention), split over TP; selective
    recompute drops them with ``scores``."""
    routed: float = 0.0
    """MoE tensors per token of the whole sequence on every rank (already divided by expert TP)."""
    layer_input: float = 0.0
    """The layer's input (what full recompute keeps); split by sequence parallelism (the paper's ``2 h``)."""


def paper_terms(hidden: int, heads: int) -> LayerTerms:
    """The GPT-3 layer of Korthikanti et al. (16-bit activations, 4h GeLU MLP, dropout)."""
    return LayerTerms(replicated=10 * hidden, split=24 * hidden, scores=5 * heads, layer_input=2 * hidden)


def layer_terms(arch: GPTArch, *, dtype_bytes: int, flash: bool = True, te_norms: bool = True,
                etp: int = 1) -> LayerTerms:
    """``LayerTerms`` of one layer of ``arch`` as Megatron-core runs it (see the module docstring)."""
    p = dtype_bytes
    h = arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    norm = h * p * (1 if te_norms else 2)  # what one norm keeps besides its output
    replicated = 2 * (norm + h * p)  # input norm + QKV input, pre-MLP norm + MLP (or router) input
    split = (q + 2 * kv) * p + q * p  # Q, K, V; projection input
    if arch.qk_layernorm:
        split += (q + kv) * p * (1 if te_norms else 2)
    scores, internal = 0.0, 0.0
    if not flash:
        # fp32 softmax output per head (+ the 16-bit copy the value matmul keeps)
        scores = arch.num_attention_heads * (4 + (p if p < 4 else 0))
        if arch.num_query_groups < arch.num_attention_heads:
            internal = 2 * (q - kv) * p  # K and V repeated to every query head
    routed = 0.0
    if arch.is_moe:
        replicated += 3 * arch.num_experts * 4  # fp32 router logits, scores and probabilities
        routed = arch.moe_router_topk * (2 * h * p + 5 * arch.moe_ffn_hidden_size // etp * p)
        if arch.shared_expert_ffn_hidden_size:
            split += 5 * arch.shared_expert_ffn_hidden_size * p
    else:
        split += 5 * arch.ffn_hidden_size * p
    return LayerTerms(replicated=replicated, split=split, scores=scores, core_internal=internal, routed=routed,
                      layer_input=h * p)


def layer_bytes(terms: LayerTerms, *, tokens: int, keys: int, tp: int = 1, sp: bool = False,
                recompute: str = "none") -> float:
    """Bytes one layer keeps for one micro-batch of ``tokens`` tokens (``mbs x s / CP`` on this rank) that
    attend to ``keys`` positions (the sequence length), at TP ``tp``, with or without sequence parallelism.

    ``recompute``: ``none``, ``selective`` (drops ``scores`` and ``core_internal``) or ``full`` (keeps only
    ``layer_input``; the recomputed layers' own activations are counted by the caller).
    """
    sp_div = tp if sp else 1
    if recompute == "full":
        return tokens * terms.layer_input / sp_div
    kept = terms.replicated / sp_div + terms.split / tp + terms.routed
    if recompute == "none":
        kept += (terms.core_internal + terms.scores * keys) / tp
    elif recompute != "selective":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    return tokens * kept


def head_bytes(arch: GPTArch, *, tokens: int, vocab_rows: int, dtype_bytes: int, tp: int = 1, sp: bool = False,
               te_norms: bool = True, head: str = "lm", entropy: bool = False, padded: bool = False) -> float:
    """Bytes of the last stage's head for one micro-batch: final norm and output-layer input, and the logits.

    ``vocab_rows`` is this rank's share of the padded vocabulary. The logits term is the policy's log-prob path
    (``asyncflow.engines.megatron.logprobs.token_logprobs``): Megatron's vocab-parallel cross entropy keeps an
    fp32 ``[tokens, vocab_rows]`` softmax for the backward pass, and while it runs the output layer's
    logits and their transposed copy (two in the model dtype) are alive; ``padded`` (this shard holds padded
    vocabulary rows) adds the copy that masks them, and the entropy bonus one more fp32 copy. A critic's value
    head keeps nothing vocabulary-sized.
    """
    p, h = dtype_bytes, arch.hidden_size
    norm = h * p * (1 if te_norms else 2) + h * p
    kept = tokens * norm / (tp if sp else 1)
    if head == "value":
        return kept + tokens * 8
    logits = 4 + 2 * p + (p if padded else 0) + (4 if entropy else 0)
    return kept + tokens * vocab_rows * logits


def in_flight(stage: int, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose activations pipeline ``stage`` holds at once under 1F1B: ``PP - stage`` (the first
    stage runs PP forward passes before its first backward pass), at most the micro-batches of the step."""
    return max(1, min(pp - stage, num_microbatches))
