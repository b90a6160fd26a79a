"""Per-device memory of one Megatron trainer rank and of one vLLM rollout device, term by term.

Trainer rank (one pipeline stage; ``trainer_rank`` returns the heaviest):

- weights: this rank's parameters (``asyncflow.planner.params``) in ``params_dtype``;
- gradients: Megatron DDP's fp32 gradient buffer (the trainer reduces gradients in fp32): 4 bytes each;
- optimizer states: Adam's two fp32 moments, plus an fp32 master copy for 16-bit parameters: 12 bytes per
  parameter (8 for fp32), divided by the data-parallel size with the distributed optimizer. Together these
  are Megatron's documented bytes per parameter (docs.nvidia.com/megatron-core/developer-guide/latest/
  api-guide/dist_optimizer.html; ``DistributedOptimizer`` in ``megatron/core/optimizer/distrib_optimizer.py``):
  bf16 parameters with fp32 gradients 18 without / 6 + 12/d with it, fp32 parameters 16 / 8 + 8/d. Routed
  experts are sharded over their own data-parallel group, TP x DP x CP / (ETP x EP) ranks;
- activations: ``asyncflow.planner.activations`` per layer, times the layers of the stage, times the
  micro-batches 1F1B keeps in flight (``PP - stage``); with full recompute, the kept layer inputs;
- logits (last stage); with full recompute, the larger of the logits and one recomputed chunk (the backward
  pass frees the head's tensors before it recomputes the last chunk);
- workspace: the largest weight's gradient before Megatron adds it to the fp32 buffer, unfused attention's
  score buffer, the MoE all-gather dispatcher's token buffer;
- the reference model when it shares the trainer's devices (its weights and one forward micro-batch), and a
  critic with the trainer's parallel sizes (which shares them too);
- the weight relay's send buffer (``weight_sync.backend: nccl``): one ``bucket_mb`` CUDA buffer per exporting
  rank, through which each staged version streams to the other nodes (``asyncflow.bridge.relay``);
- runtime reserve: CUDA context, NCCL communicators and allocator fragmentation, an assumed constant per
  process (``RESERVE_GIB``), not a measurement.

Rollout device (one of the ``rollout.tensor_parallel`` devices of a vLLM engine): weights / TP, the
activation peak of vLLM's profiling forward pass (``max_num_batched_tokens`` tokens), the reserve, and the
KV cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens: ``layers x 2 x kv_heads/TP x head_dim x
bytes`` per token, and with the NCCL relay the receiving buffers of the node's relay receiver (one ``bucket_mb``
buffer per exporting trainer rank, on the device of the node's first engine). All of it must fit in
``gpu_memory_utilization x`` the device.
"""

from __future__ import annotations

import dataclasses
import math

from asyncflow.bridge.config import WeightSyncConfig
from asyncflow.config import CriticConfig, MegatronConfig, MegatronEngineConfig, VllmConfig
from asyncflow.models.arch import GPTArch, padded_vocab_size
from asyncflow.planner.activations import head_bytes, in_flight, layer_bytes, layer_terms
from asyncflow.planner.params import layer_params, stage_params, vllm_params

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RESERVE_GIB = {"train": 4.0, "forward": 1.5, "vllm": 2.0}
"""Assumed memory outside the estimated tensors, per process: CUDA context and libraries, NCCL buffers,
allocator fragmentation (``train``: a Megatron trainer; ``forward``: a forward-only Megatron process such as
the reference model; ``vllm``: non-torch memory and CUDA graphs of a vLLM worker)."""
VLLM_MAX_NUM_BATCHED_TOKENS = 16384
"""vLLM's default token budget of one forward pass for the ``LLM`` class on >= 70 GiB GPUs other than A100
(``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py); its profiling run uses it."""


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """What a training step looks like to one trainer rank, beyond ``MegatronConfig``."""

    seq: int
    """Tokens per row: the longest prompt plus ``max_new_tokens`` (pipeline stages exchange fixed shapes, so
    with PP > 1 every micro-batch is padded to this width; with PP = 1 it is the worst case)."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step on one data-parallel rank."""
    flash: bool = True
    """Fused (flash) attention, as with Transformer Engine on GPUs; False: Megatron's unfused attention."""
    te_norms: bool = True
    """Transformer Engine's norms (GPUs); False: torch's RMSNorm of the local spec (CPU)."""
    entropy: bool = False
    """The loss reads the policy's entropy (``algorithm.entropy_coef > 0``)."""
    reference_rows: int = 0
    """Rows of one reference ``compute_logprobs`` call (``workflow.score_chunk``): a streamed reference keeps the
    hidden states of all of them on the device of every pipeline stage (``engines.megatron.layer_major``)."""


@dataclasses.dataclass
class Breakdown:
    """Memory of one device of one task, term by term (bytes), against what that device offers."""

    task: str
    """``trainer rank``, ``rollout device``, ..."""
    layout: str
    """The parallel layout, for the table header."""
    terms: dict[str, float]
    """Bytes per term, in display order."""
    budget: float
    """Bytes this task may use on its device (the device, or ``gpu_memory_utilization x`` the device)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """One-line remarks (which stage, the KV-cache concurrency that fits, ...)."""

    @property
    def total(self) -> float:
        """Sum of the terms."""
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        """The total is within the budget."""
        return self.total <= self.budget


def _etp(mcfg: MegatronEngineConfig) -> int:
    return mcfg.tensor_parallel  # the trainer never sets expert_tensor_parallel_size: Megatron uses TP


def trainer_terms(arch: GPTArch, mcfg: MegatronEngineConfig, shape: TrainShape, stage: int = 0,
                  head: str = "lm") -> dict[str, float]:
    """Bytes of one trainer rank of pipeline ``stage``: weights, gradients, optimizer states, activations,
    logits (last stage) and workspace. No reserve, reference or critic (see ``trainer_rank``)."""
    p = DTYPE_BYTES[mcfg.params_dtype]
    tp, pp, dp, ep, cp = (mcfg.tensor_parallel, mcfg.pipeline_parallel, mcfg.data_parallel, mcfg.expert_parallel,
                          mcfg.context_parallel)
    # the critic (CriticConfig) has no sequence parallelism
    etp, sp, mbs = _etp(mcfg), getattr(mcfg, "sequence_parallel", False), mcfg.micro_batch_size
    params = stage_params(arch, tp=tp, pp=pp, ep=ep, etp=etp, stage=stage,
                          vocab_divisible_by=mcfg.make_vocab_size_divisible_by, head=head)
    master = 4 if p < 4 else 0
    dense_shards = dp * cp if mcfg.use_distributed_optimizer else 1
    expert_shards = max(1, tp * dp * cp // (etp * ep)) if mcfg.use_distributed_optimizer else 1
    terms = {
        "weights": params.total * p,
        "gradients": params.total * 4,
        "optimizer states": (master + 8) * (params.dense / dense_shards + params.expert / expert_shards),
    }
    tokens = shape.seq // cp * mbs
    lt = layer_terms(arch, dtype_bytes=p, flash=shape.flash, te_norms=shape.te_norms, etp=etp)
    layers = arch.num_layers // pp
    micro = in_flight(stage, pp, shape.num_microbatches)
    per_layer = dict(tokens=tokens, keys=shape.seq, tp=tp, sp=sp)
    logits = 0.0
    if stage == pp - 1:
        vocab = padded_vocab_size(arch.vocab_size, mcfg.make_vocab_size_divisible_by, tp)
        logits = head_bytes(arch, tokens=tokens, vocab_rows=vocab // tp, dtype_bytes=p, tp=tp, sp=sp,
                            te_norms=shape.te_norms, head=head, entropy=shape.entropy, padded=vocab > arch.vocab_size)
    if mcfg.recompute == "full":
        chunk = min(mcfg.recompute_num_layers, layers)
        kept = math.ceil(layers / chunk) * layer_bytes(lt, recompute="full", **per_layer)
        terms["activations"] = micro * kept
        # The head's tensors are freed before the backward pass reaches the first recomputed chunk.
        terms["logits or recomputed layers"] = max(logits, chunk * layer_bytes(lt, recompute="none", **per_layer))
    else:
        terms["activations"] = micro * layers * layer_bytes(lt, recompute=mcfg.recompute, **per_layer)
        if logits:
            terms["logits"] = logits
    workspace = params.largest * p
    if not shape.flash:  # Megatron's global buffer for the [mbs x heads/TP, s, s] attention scores
        workspace += mbs * arch.num_attention_heads // tp * shape.seq**2 * p
    if arch.is_moe and mcfg.moe_token_dispatcher == "allgather" and (tp > 1 or ep > 1):
        workspace += tokens * ep * arch.hidden_size * p  # tokens gathered over TP x EP (a global buffer)
    terms["workspace"] = workspace
    return terms


def reference_terms(arch: GPTArch, mcfg: MegatronConfig, shape: TrainShape, stage: int,
                    placement: str) -> dict[str, float]:
    """Bytes the reference model adds to a device: ``colocated`` / ``own`` (weights and one forward
    micro-batch: the logits of its log-prob pass, or one layer's activations on other stages), ``offload``
    (weights in host memory: the embedding and output layer plus two layers' weights on the device, and the
    hidden states of a whole call's rows, run layer-major on every pipeline stage), ``none``."""
    if placement == "none":
        return {}
    p = DTYPE_BYTES[mcfg.params_dtype]
    tp, pp = mcfg.tensor_parallel, mcfg.pipeline_parallel
    params = stage_params(arch, tp=tp, pp=pp, ep=mcfg.expert_parallel, etp=_etp(mcfg), stage=stage,
                          vocab_divisible_by=mcfg.make_vocab_size_divisible_by)
    tokens = shape.seq // mcfg.context_parallel * mcfg.micro_batch_size
    vocab = padded_vocab_size(arch.vocab_size, mcfg.make_vocab_size_divisible_by, tp) // tp
    forward = tokens * vocab * (4 + 2 * p) if stage == pp - 1 else tokens * (arch.hidden_size * p * 4)
    weights = params.total * p
    if placement == "offload":
        # LayerStreamer: embedding, final norm and output layer for the whole forward, plus the layer in use
        # (counted twice: the caching allocator may still hold the previous layer's blocks).
        layer = sum(layer_params(arch, tp, mcfg.expert_parallel, _etp(mcfg)))
        weights = (params.total - arch.num_layers // pp * layer + 2 * layer) * p
    terms = {"reference weights": weights, "reference forward": forward}
    if placement == "offload" and mcfg.context_parallel == 1:
        # layer_major, on each stage (a later stage receives them all before its first layer): rows (padded to
        # whole micro-batches) x seq x hidden, split over TP by sequence parallelism.
        rows = math.ceil(shape.reference_rows / mcfg.micro_batch_size) * mcfg.micro_batch_size
        split = tp if mcfg.sequence_parallel else 1
        terms["reference hidden states (all rows of a call)"] = rows * shape.seq * arch.hidden_size * p / split
    terms["reference reserve"] = RESERVE_GIB["forward"] * GIB
    return terms


def relay_buffers(ws: WeightSyncConfig, mcfg: MegatronConfig) -> tuple[float, float]:
    """Device bytes of the weight relay: (an exporting trainer rank's send buffer, the receiving buffers on a
    rollout device: one per exporting rank, TP x PP x EP of them). Zero unless the relay runs on the devices
    (``backend: nccl``) and may be chosen (``transport`` not ``shm``): gloo's buffers are in host memory."""
    from asyncflow.bridge.relay import MIN_CHUNK_MB

    if ws.backend != "nccl" or ws.transport == "shm":
        return 0.0, 0.0
    buffer = max(ws.bucket_mb, MIN_CHUNK_MB) * 2**20
    return buffer, buffer * mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.expert_parallel


def trainer_rank(arch: GPTArch, mcfg: MegatronEngineConfig, shape: TrainShape, *, device_bytes: float,
                 reference: str = "none", critic: CriticConfig | None = None, reserve: bool = True,
                 task: str = "trainer rank", head: str = "lm", relay_bytes: float = 0.0) -> Breakdown:
    """The heaviest pipeline stage of a trainer rank, with what shares its device.

    ``reference``: ``colocated`` adds the reference model's weights and forward pass (a second process on the
    device), ``offload`` its streamed layers and forward pass; ``critic``: a critic with the same parallel
    sizes is colocated too and adds its own rank; ``relay_bytes``: the weight relay's send buffer
    (``relay_buffers``).
    """
    best = None
    for stage in range(mcfg.pipeline_parallel):
        terms = trainer_terms(arch, mcfg, shape, stage, head)
        if relay_bytes:
            terms["weight relay buffer"] = relay_bytes
        if reference in ("colocated", "offload"):
            terms.update(reference_terms(arch, mcfg, shape, stage, reference))
        if critic is not None:
            terms["critic (colocated)"] = sum(trainer_terms(arch, critic, shape, stage, "value").values())
            terms["critic reserve"] = RESERVE_GIB["train"] * GIB if reserve else 0.0
        if reserve:
            terms["runtime reserve"] = RESERVE_GIB["train"] * GIB
        if best is None or sum(terms.values()) > sum(best[1].values()):
            best = (stage, terms)
    stage, terms = best
    cfg = mcfg
    layout = f"TP{cfg.tensor_parallel} PP{cfg.pipeline_parallel} DP{cfg.data_parallel}"
    layout += f" EP{cfg.expert_parallel}" if arch.is_moe else ""
    layout += f" CP{cfg.context_parallel}" if cfg.context_parallel > 1 else ""
    micro = in_flight(stage, cfg.pipeline_parallel, shape.num_microbatches)
    notes = [f"{task}: pipeline stage {stage} of {cfg.pipeline_parallel} (the heaviest), micro-batch "
             f"{cfg.micro_batch_size} x {shape.seq} tokens, {micro} in flight, recompute {cfg.recompute}"]
    return Breakdown(task, layout, terms, device_bytes, notes)


def reference_rank(arch: GPTArch, mcfg: MegatronConfig, shape: TrainShape, *, device_bytes: float) -> Breakdown:
    """A reference-model rank on devices of its own (``own`` placement)."""
    stages = [reference_terms(arch, mcfg, shape, stage, "own") for stage in range(mcfg.pipeline_parallel)]
    terms = max(stages, key=lambda t: sum(t.values()))
    layout = f"TP{mcfg.tensor_parallel} PP{mcfg.pipeline_parallel} DP{mcfg.data_parallel}"
    return Breakdown("reference rank", layout, terms, device_bytes)


def kv_bytes_per_token(arch: GPTArch, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one vLLM TP rank: layers x (K, V) x kv_heads/TP x head_dim x bytes (KV
    heads are replicated when there are fewer than TP ranks)."""
    return arch.num_layers * 2 * max(1, arch.num_query_groups // tp) * arch.head_dim * dtype_bytes


def vllm_dtype_bytes(arch: GPTArch, vcfg: VllmConfig) -> int:
    """Bytes per element of the rollout model (``auto``: the checkpoint's dtype)."""
    return DTYPE_BYTES.get(arch.torch_dtype if vcfg.dtype == "auto" else vcfg.dtype, 2)


def rollout_device(arch: GPTArch, vcfg: VllmConfig, *, device_bytes: float, reserve: bool = True,
                   relay_bytes: float = 0.0) -> Breakdown:
    """One device of a vLLM engine (TP ranks are alike): weights, profiling activations, reserve, KV cache,
    and ``relay_bytes`` of weight relay receiving buffers (``relay_buffers``; the heaviest device of a node)."""
    tp, p = vcfg.tensor_parallel, vllm_dtype_bytes(arch, vcfg)
    h = arch.hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, max(1, arch.num_query_groups // tp) * tp * arch.head_dim
    ffn = (arch.moe_router_topk * arch.moe_ffn_hidden_size + arch.shared_expert_ffn_hidden_size
           if arch.is_moe else arch.ffn_hidden_size)
    tokens = VLLM_MAX_NUM_BATCHED_TOKENS
    # One layer's live tensors during the profiling forward (residual, normed input, QKV, attention output,
    # gate/up and activation), plus fp32 logits, log-probs and probabilities of max_num_seqs sampled rows.
    activations = tokens * p * (3 * h + (2 * q + 2 * kv) // tp + 3 * ffn // tp)
    vocab = padded_vocab_size(arch.vocab_size, 64, tp) // tp
    activations += 3 * vcfg.max_num_seqs * vocab * tp * 4
    kv_token = kv_bytes_per_token(arch, tp, p)
    terms = {
        "weights": vllm_params(arch, tp) * p,
        "activations": activations,
        "runtime reserve": RESERVE_GIB["vllm"] * GIB if reserve else 0.0,
        **({"weight relay buffers": relay_bytes} if relay_bytes else {}),
        "KV cache": vcfg.max_num_seqs * vcfg.max_model_len * kv_token,
    }
    budget = vcfg.gpu_memory_utilization * device_bytes
    pool = budget - sum(v for k, v in terms.items() if k != "KV cache")
    per_seq = vcfg.max_model_len * kv_token
    fitting = max(0, int(pool // per_seq))
    notes = [f"rollout device: KV cache {kv_token / 2**10:.0f} KiB per token; "
             f"{vcfg.max_num_seqs} x {vcfg.max_model_len} tokens wanted, room for {fitting} sequences of "
             f"max_model_len within gpu_memory_utilization={vcfg.gpu_memory_utilization}"]
    return Breakdown("rollout device", f"TP{tp}", terms, budget, notes)
