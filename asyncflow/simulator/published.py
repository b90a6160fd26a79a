"""GPU cost inputs from published figures, for predictions on paper (nothing here was measured by us).

The simulator needs a ``CostModel`` per rollout TP; on a cluster ``asyncflow profile`` would measure it. Until
then ``gpu_costs`` builds one from a roofline, with one set of efficiencies for every GPU and every case, each
taken from a published measurement:

- H100 SXM5 80GB: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s (NVIDIA H100 Tensor Core GPU
  datasheet, https://www.nvidia.com/en-us/data-center/h100/).
- H20 96GB: 148 TFLOP/s dense BF16, 4.0 TB/s HBM3, NVLink 900 GB/s (NVIDIA publishes no datasheet; the figures
  as listed at https://willitrunai.com/es/gpus/h20-96gb). The GPU of verl's fully-async tables.
- Decode is memory-bound at small batch: vLLM reaches about 77% of the memory-bandwidth ceiling decoding
  Llama-3.1-8B at one request (``MEM_EFFICIENCY``; J. Musgrave, "vLLM throughput-latency sweep on NVIDIA
  A100", johnmusgrave.com, vLLM 0.23).
- Large-batch inference is compute-bound: Red Hat's MLPerf Inference v5.1 offline submission ran
  Llama-3.1-8B (FP8, vLLM 0.10.0) at 5,777 output tokens/s on one H100; with CNN-DailyMail's ~780 prompt
  and ~128 output tokens per sample that is about a third of FP8 peak (``INFER_COMPUTE_EFFICIENCY``).
- Training: Megatron-core reports up to 47% MFU on H100 (GPT-3 175B, 390 TFLOP/s per GPU; Megatron-LM
  README). ``TRAIN_MFU`` uses it; the reference / old-logprob forward runs at the same MFU.
- Weights and gradients cross nodes over 400 Gb/s InfiniBand per GPU (a DGX H100 has one ConnectX-7 per GPU)
  at an assumed 50% of line rate (``LINK_BYTES_S``).
- Colocated switching (``switch_costs``): vLLM sleep mode level 1 offloads the weights to host memory and drops
  the KV cache; waking takes 0.1-6 s by model size (vLLM blog "Zero-Reload Model Switching with vLLM Sleep
  Mode", https://blog.vllm.ai/2025/10/26/sleep-mode.html); the bytes move over PCIe 5.0 x16 (64 GB/s a
  direction, PCI-SIG) at an assumed half of it (``PCIE_BYTES_S``).

Each term of ``RolloutCosts`` and ``TrainCosts`` is the roofline's time: the dense weights read once per decode
step and the routed experts that step's tokens touch (``RolloutCosts.fixed_s``), KV cache read per attended
token, 2 x active parameters FLOPs per generated token; training 6 x active parameters per token plus causal
attention, ``6 L h d`` FLOPs per token and per token of its row forward and backward (``2 L h d`` forward only).
Adding the memory and compute terms (instead of taking the larger) is deliberately pessimistic at mid-size
batches.
"""

from __future__ import annotations

import dataclasses

from asyncflow.models.arch import GPTArch
from asyncflow.planner.memory import kv_bytes_per_token
from asyncflow.planner.params import vllm_params
from asyncflow.simulator.costs import (
    CostFile,
    CostModel,
    QueueCosts,
    RolloutCosts,
    SwitchCosts,
    TrainCosts,
    WeightSyncCosts,
)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU's published peak figures."""

    name: str
    bf16_flops: float
    """Dense BF16 FLOP/s."""
    hbm_bytes_s: float
    """HBM bandwidth, bytes/s."""
    nvlink_bytes_s: float
    """NVLink bandwidth within a node, bytes/s."""


H100 = Gpu("H100", 989e12, 3.35e12, 900e9)
H20 = Gpu("H20", 148e12, 4.0e12, 900e9)
H100_BF16_FLOPS, H100_HBM_BYTES_S = H100.bf16_flops, H100.hbm_bytes_s
MEM_EFFICIENCY = 0.77
INFER_COMPUTE_EFFICIENCY = 0.33
TRAIN_MFU = 0.47
LINK_BYTES_S = 0.5 * 400e9 / 8
WEIGHT_LINK_BYTES_S = LINK_BYTES_S
PCIE_BYTES_S = 0.5 * 64e9
STEP_OVERHEAD_S = 0.002
"""Scheduler and sampling per engine step (assumed; CUDA graphs keep launch overhead small)."""
WAKE_S = 1.0
"""vLLM sleep-mode wake-up beyond moving the weights (allocator, KV cache re-allocation): within the 0.1-6 s the
vLLM blog reports for level 1 (module docstring)."""
TP_COMM_EFFICIENCY = {1: 1.0, 2: 0.9, 4: 0.8, 8: 0.7}
"""Fraction of ideal TP speed-up left after the all-reduces (assumed, NVLink within a node)."""
GRAD_BYTES = 2
"""Bytes per gradient element a trainer reduces (bf16). A run whose trainer reduces in another dtype says so
(``gpu_costs``' ``grad_bytes``: verl's FSDP workers reduce in fp32 unless configured otherwise)."""
TRAINER_STATE_BYTES = 16
"""Bytes per parameter a colocated trainer offloads and reloads each step: bf16 weights and gradients, fp32
master weights and two Adam moments (2 + 2 + 4 + 4 + 4), sharded over the trainer's devices."""


def active_params(arch: GPTArch) -> float:
    """Parameters one token passes through (MoE: the router's top-k experts and the shared expert only)."""
    return float(vllm_params(arch, 1)) - _expert_params(arch) * (1 - _topk_share(arch))


def _expert_params(arch: GPTArch) -> float:
    """Parameters of every routed expert (0 for a dense model)."""
    if not arch.is_moe:
        return 0.0
    return float(arch.num_layers * arch.num_experts * 3 * arch.hidden_size * arch.moe_ffn_hidden_size)


def _topk_share(arch: GPTArch) -> float:
    return arch.moe_router_topk / arch.num_experts if arch.is_moe else 1.0


def switch_costs(arch: GPTArch, rollout_tp: int, gpu: Gpu = H100, state_shards: int = 0) -> SwitchCosts:
    """A colocated step's switches on ``gpu``: the trainer's state offloaded and reloaded over PCIe (sharded over
    ``state_shards`` devices, or all the trainer's: ``SwitchCosts.step_s``), vLLM put to sleep and woken (its TP
    shard of the weights over PCIe, both ways, plus ``WAKE_S``), and the new weights resharded from the trainer
    into vLLM over NVLink."""
    n_total = float(vllm_params(arch, 1))
    shard = 2 * n_total / rollout_tp
    return SwitchCosts(offload_s=2 * TRAINER_STATE_BYTES * n_total / PCIE_BYTES_S, state_shards=state_shards,
                       sleep_wake_s=WAKE_S + 2 * shard / PCIE_BYTES_S, reload_s=shard / gpu.nvlink_bytes_s)


def fsdp_bytes(n_total: float, grad_bytes: int = GRAD_BYTES) -> float:
    """Bytes a sharded (FSDP / ZeRO-3) trainer moves per GPU and optimizer step over a shard group of ``s``, before
    the ``(s - 1) / s`` of each collective: two all-gathers of the bf16 weights (forward and backward) and one
    reduce-scatter of the gradients, ``grad_bytes`` an element."""
    return (2 * 2 + grad_bytes) * n_total


def _hsdp_s(n_total: float, shard_devices: int, gpu: Gpu, grad_bytes: int = GRAD_BYTES) -> float:
    """``TrainCosts.grad_allreduce_s`` of a hybrid-sharded trainer: ``fsdp_bytes`` within a node over NVLink, plus
    a ring all-reduce of each GPU's ``1 / shard_devices`` of the gradients over its link. ``allreduce_s`` scales
    the field by the ring's ``2 (DP - 1) / DP`` (about 2 at the DP sizes of a cluster), so it holds half of the
    per-step seconds."""
    within = fsdp_bytes(n_total, grad_bytes) * (shard_devices - 1) / shard_devices / gpu.nvlink_bytes_s
    across = 2 * (grad_bytes * n_total / shard_devices) / LINK_BYTES_S
    return (within + across) / 2


def gpu_costs(arch: GPTArch, trainer_devices_per_replica: int, gpu: Gpu = H100, train_mfu: float = TRAIN_MFU,
              rollout_tps=(1, 2, 4, 8), sharded: bool = False, shard_devices: int = 0,
              grad_bytes: int = GRAD_BYTES) -> CostFile:
    """A cost file for ``arch`` in bf16 on ``gpu``: variant ``device-tp{N}`` per rollout TP (the trainer terms
    are per data-parallel replica of ``trainer_devices_per_replica`` GPUs). ``sharded``: the trainer shards every
    parameter over all its GPUs (FSDP / ZeRO-3, verl's FSDP2 trainer): each optimizer step gathers the bf16
    weights for the forward and again for the backward and reduce-scatters the gradients (``fsdp_bytes``), against
    Megatron's all-reduce of one replica rank's gradient shard.
    ``shard_devices`` (hybrid sharding, FSDP's ``fsdp_size``): the parameters are sharded over groups of that many
    GPUs within a node and replicated across groups, so the gathers and the reduce-scatter cross NVLink and only
    each GPU's ``1 / shard_devices`` of the gradients is all-reduced over the inter-node link (``_hsdp_s``); a
    colocated step then offloads and reloads only that group's ``1 / shard_devices`` of the trainer's state per
    GPU (``SwitchCosts.state_shards``). ``grad_bytes``: bytes per gradient element reduced (``GRAD_BYTES``)."""
    n_total, n_active = float(vllm_params(arch, 1)), active_params(arch)
    n_dense = n_total - _expert_params(arch)
    attn = arch.num_layers * arch.num_attention_heads * arch.head_dim  # x 2 FLOPs per token per row token, causal
    replica = trainer_devices_per_replica * gpu.bf16_flops * train_mfu
    train = TrainCosts(per_micro_s=0.005, per_token_s=6 * n_active / replica, per_token_seq_s=6 * attn / replica,
                       optimizer_s=0.5, ref_per_call_s=0.005, ref_per_token_s=2 * n_active / replica,
                       ref_per_token_seq_s=2 * attn / replica,
                       grad_allreduce_s=(_hsdp_s(n_total, shard_devices, gpu, grad_bytes) if sharded and shard_devices
                                         else (fsdp_bytes(n_total, grad_bytes) / 2 if sharded
                                               else grad_bytes * n_total / trainer_devices_per_replica)
                                         / LINK_BYTES_S))
    weight_bytes = 2 * n_total / trainer_devices_per_replica  # one exporting rank's bf16 shards
    variants = {}
    for tp in rollout_tps:
        eff = TP_COMM_EFFICIENCY[tp]
        bw = tp * gpu.hbm_bytes_s * MEM_EFFICIENCY * eff
        flops = tp * gpu.bf16_flops * INFER_COMPUTE_EFFICIENCY * eff
        rollout = RolloutCosts(step_s=STEP_OVERHEAD_S + 2 * n_dense / bw, per_seq_s=2 * n_active / flops,
                               per_ctx_token_s=kv_bytes_per_token(arch, 1, 2) / bw,
                               prefill_per_token_s=2 * n_active / flops, per_request_s=0.0,
                               expert_read_s=2 * _expert_params(arch) / bw, experts=arch.num_experts,
                               experts_topk=arch.moe_router_topk if arch.is_moe else 0)
        variants[f"device-tp{tp}"] = CostModel(
            rollout=rollout, train=train,
            weight_sync=WeightSyncCosts(stage_per_byte_s=1 / (gpu.hbm_bytes_s * 0.5),
                                        apply_fixed_s=0.05, apply_per_byte_s=1 / LINK_BYTES_S),
            queue=QueueCosts(per_request_s=1e-3, per_byte_s=1 / 5e9), weight_bytes=weight_bytes,
            rollout_weight_bytes=2 * n_total / tp,
            switch=switch_costs(arch, tp, gpu, shard_devices if sharded else 0))
    variants["device"] = variants[f"device-tp{rollout_tps[0]}"]
    return CostFile(variants, {"kind": f"published {gpu.name} figures (prediction, not a measurement)",
                               "train_mfu": train_mfu})


def h100_costs(arch: GPTArch, trainer_devices_per_replica: int, train_mfu: float = TRAIN_MFU,
               rollout_tps=(1, 2, 4, 8)) -> CostFile:
    """``gpu_costs`` on H100s."""
    return gpu_costs(arch, trainer_devices_per_replica, H100, train_mfu, rollout_tps)
