"""Parameters held by one Megatron rank, split the way Megatron-core splits them (checked against Megatron's
own model chunks in ``tests/test_plan.py``).

Per transformer layer, with TP ranks ``t``, EP ranks ``e`` and expert-TP ranks ``et`` (= ``t``, Megatron's
default and the trainer's):

- norms (input, pre-MLP; Qwen3's q/k norms over ``head_dim``) are replicated on every rank;
- ``linear_qkv`` holds ``(heads + 2 kv_heads) x head_dim / t`` rows of ``hidden`` (plus as many biases for
  Qwen2), ``linear_proj`` ``hidden x heads x head_dim / t``;
- a dense MLP holds ``3 x ffn x hidden / t`` (gate and up in ``linear_fc1``, ``linear_fc2``);
- an MoE layer holds the router ``experts x hidden`` (replicated), its ``experts / e`` local experts of
  ``3 x moe_ffn x hidden / et`` each, and a shared expert of ``3 x shared_ffn x hidden / t`` plus its gate
  ``hidden``.

The first pipeline stage adds the word embeddings ``padded_vocab / t x hidden``; the last adds the final norm
and the output layer (also with tied embeddings when PP > 1: the last stage keeps its own copy). A critic
(``head="value"``) has a ``hidden + 1`` value head instead of the output layer. Routed-expert parameters are
counted apart: their gradients and distributed-optimizer shards live in the expert data-parallel group.
"""

from __future__ import annotations

import dataclasses

from asyncflow.models.arch import GPTArch, padded_vocab_size


@dataclasses.dataclass(frozen=True)
class StageParams:
    """Parameter counts of one rank of one pipeline stage."""

    dense: int
    """Parameters replicated over the data-parallel ranks (everything except the routed experts)."""
    expert: int
    """Routed-expert parameters (replicated over the expert data-parallel ranks only; at EP 1 that group is the
    data-parallel group, and Megatron reduces them with the dense ones)."""
    largest: int
    """Elements of this rank's largest single weight (its gradient is materialized once in the backward pass)."""

    @property
    def total(self) -> int:
        """All parameters of this rank."""
        return self.dense + self.expert


def layer_params(arch: GPTArch, tp: int = 1, ep: int = 1, etp: int | None = None) -> tuple[int, int]:
    """``(dense, expert)`` parameters of one transformer layer on one rank."""
    etp = etp or tp
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp
    dense = 2 * h + qkv_rows * h + h * arch.num_attention_heads * d // tp
    dense += qkv_rows if arch.qkv_bias else 0
    dense += 2 * d if arch.qk_layernorm else 0
    if not arch.is_moe:
        return dense + 3 * arch.ffn_hidden_size * h // tp, 0
    dense += arch.num_experts * h
    if arch.shared_expert_ffn_hidden_size:
        dense += 3 * arch.shared_expert_ffn_hidden_size * h // tp + h
    expert = arch.num_experts // ep * 3 * arch.moe_ffn_hidden_size * h // etp
    return dense, expert


def stage_params(arch: GPTArch, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, stage: int = 0,
                 vocab_divisible_by: int = 128, head: str = "lm") -> StageParams:
    """Parameters of one rank of pipeline ``stage`` (layers split evenly over the PP stages)."""
    dense, expert = layer_params(arch, tp, ep, etp)
    layers = arch.num_layers // pp
    dense, expert = dense * layers, expert * layers
    h = arch.hidden_size
    vocab_rows = padded_vocab_size(arch.vocab_size, vocab_divisible_by, tp) // tp
    largest = _largest_layer_weight(arch, tp, etp or tp)
    if stage == 0:
        dense += vocab_rows * h
        largest = max(largest, vocab_rows * h)
    if stage == pp - 1:
        dense += h  # final norm
        if head == "value":
            dense += h + 1
        elif not arch.tie_word_embeddings or pp > 1:
            dense += vocab_rows * h
            largest = max(largest, vocab_rows * h)
    return StageParams(dense=dense, expert=expert, largest=largest)


def _largest_layer_weight(arch: GPTArch, tp: int, etp: int) -> int:
    h, d = arch.hidden_size, arch.head_dim
    sizes = [(arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp * h]
    if arch.is_moe:
        sizes += [2 * arch.moe_ffn_hidden_size // etp * h, 2 * arch.shared_expert_ffn_hidden_size // tp * h]
    else:
        sizes.append(2 * arch.ffn_hidden_size // tp * h)
    return max(sizes)


def vllm_params(arch: GPTArch, tp: int = 1) -> int:
    """Parameters of one vLLM tensor-parallel rank: like Megatron's TP split, except that KV heads are
    replicated when there are fewer than TP ranks and every rank holds all experts (sliced by TP)."""
    h, d = arch.hidden_size, arch.head_dim
    kv_heads = max(1, arch.num_query_groups // tp)
    qkv_rows = (arch.num_attention_heads // tp + 2 * kv_heads) * d
    per_layer = 2 * h + qkv_rows * h + h * arch.num_attention_heads * d // tp
    per_layer += qkv_rows if arch.qkv_bias else 0
    per_layer += 2 * d if arch.qk_layernorm else 0
    if arch.is_moe:
        per_layer += arch.num_experts * h + arch.num_experts * 3 * arch.moe_ffn_hidden_size * h // tp
        if arch.shared_expert_ffn_hidden_size:
            per_layer += 3 * arch.shared_expert_ffn_hidden_size * h // tp + h
    else:
        per_layer += 3 * arch.ffn_hidden_size * h // tp
    vocab_rows = padded_vocab_size(arch.vocab_size, 64, tp) // tp  # vLLM pads the vocabulary to 64 per rank
    embeddings = vocab_rows * h * (1 if arch.tie_word_embeddings else 2)
    return per_layer * arch.num_layers + embeddings + h
