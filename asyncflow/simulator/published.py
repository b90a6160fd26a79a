"""H100 cost inputs from published figures, for predictions on paper (nothing here was measured by us).

The simulator needs a ``CostModel`` per rollout TP; on a cluster ``asyncflow profile`` would measure it. Until
then this builds one from a roofline with efficiencies taken from published measurements:

- H100 SXM5 80GB: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3 (NVIDIA H100 Tensor Core GPU datasheet).
- Decode is memory-bound at small batch: vLLM reaches about 77% of the memory-bandwidth ceiling decoding
  Llama-3.1-8B at one request (``MEM_EFFICIENCY``; J. Musgrave, "vLLM throughput-latency sweep on NVIDIA
  A100", johnmusgrave.com, vLLM 0.23).
- Large-batch inference is compute-bound: Red Hat's MLPerf Inference v5.1 offline submission ran
  Llama-3.1-8B (FP8, vLLM 0.10.0) at 5,777 output tokens/s on one H100; with CNN-DailyMail's ~780 prompt
  and ~128 output tokens per sample that is about a third of FP8 peak (``INFER_COMPUTE_EFFICIENCY``).
- Training: Megatron-core reports up to 47% MFU on H100 (GPT-3 175B, 390 TFLOP/s per GPU; Megatron-LM
  README / NVIDIA Megatron-core performance notes). ``TRAIN_MFU`` uses it as the ceiling; RL micro-batches
  of one sequence run below it, so docs/simulator.md also shows 30%.
- Weights cross nodes over 400 Gb/s InfiniBand per GPU (a DGX H100 has one ConnectX-7 per GPU) at an assumed
  50% of line rate (``WEIGHT_LINK_BYTES_S``).

Each term of ``RolloutCosts`` and ``TrainCosts`` is the roofline's time: weights read once per decode
step, KV cache read per attended token, 2 x active parameters FLOPs per generated token, 6 x per trained
token (plus attention). Adding the memory and compute terms (instead of taking the larger) is deliberately
pessimistic at mid-size batches.
"""

from __future__ import annotations

from asyncflow.models.arch import GPTArch
from asyncflow.planner.memory import kv_bytes_per_token
from asyncflow.planner.params import vllm_params
from asyncflow.simulator.costs import CostFile, CostModel, QueueCosts, RolloutCosts, TrainCosts, WeightSyncCosts

H100_BF16_FLOPS = 989e12
H100_HBM_BYTES_S = 3.35e12
MEM_EFFICIENCY = 0.77
INFER_COMPUTE_EFFICIENCY = 0.33
TRAIN_MFU = 0.47
WEIGHT_LINK_BYTES_S = 0.5 * 400e9 / 8
STEP_OVERHEAD_S = 0.002
"""Scheduler and sampling per engine step (assumed; CUDA graphs keep launch overhead small)."""
TP_COMM_EFFICIENCY = {1: 1.0, 2: 0.9, 4: 0.8, 8: 0.7}
"""Fraction of ideal TP speed-up left after the all-reduces (assumed, NVLink within a node)."""


def active_params(arch: GPTArch) -> float:
    """Parameters one token passes through (MoE: the router's top-k experts and the shared expert only)."""
    total = float(vllm_params(arch, 1))
    if not arch.is_moe:
        return total
    experts = arch.num_layers * arch.num_experts * 3 * arch.hidden_size * arch.moe_ffn_hidden_size
    return total - experts * (1 - arch.moe_router_topk / arch.num_experts)


def h100_costs(arch: GPTArch, trainer_devices_per_replica: int, seq: int, train_mfu: float = TRAIN_MFU,
               rollout_tps=(1, 2, 4, 8)) -> CostFile:
    """A cost file for ``arch`` in bf16 on H100s: variant ``device-tp{N}`` per rollout TP (the trainer terms
    are per data-parallel replica of ``trainer_devices_per_replica`` GPUs; ``seq`` sets the attention FLOPs)."""
    n_total, n_active = float(vllm_params(arch, 1)), active_params(arch)
    attn_flops = 12 * arch.num_layers * arch.num_attention_heads * arch.head_dim * seq / 2  # causal, per token
    replica = trainer_devices_per_replica * H100_BF16_FLOPS * train_mfu
    train = TrainCosts(per_micro_s=0.005, per_token_s=(6 * n_active + 3 * attn_flops) / replica, optimizer_s=0.5,
                       ref_per_call_s=0.005, ref_per_token_s=(2 * n_active + attn_flops) / replica)
    weight_bytes = 2 * n_total / trainer_devices_per_replica  # one exporting rank's bf16 shards
    variants = {}
    for tp in rollout_tps:
        eff = TP_COMM_EFFICIENCY[tp]
        bw, flops = tp * H100_HBM_BYTES_S * MEM_EFFICIENCY * eff, tp * H100_BF16_FLOPS * INFER_COMPUTE_EFFICIENCY * eff
        rollout = RolloutCosts(step_s=STEP_OVERHEAD_S + 2 * n_total / bw, per_seq_s=2 * n_active / flops,
                               per_ctx_token_s=kv_bytes_per_token(arch, 1, 2) / bw,
                               prefill_per_token_s=2 * n_active / flops, per_request_s=0.0)
        variants[f"device-tp{tp}"] = CostModel(
            rollout=rollout, train=train,
            weight_sync=WeightSyncCosts(stage_per_byte_s=1 / (H100_HBM_BYTES_S * 0.5),
                                        apply_fixed_s=0.05, apply_per_byte_s=1 / WEIGHT_LINK_BYTES_S),
            queue=QueueCosts(per_request_s=1e-3, per_byte_s=1 / 5e9), weight_bytes=weight_bytes)
    variants["device"] = variants["device-tp1"]
    return CostFile(variants, {"kind": "published H100 figures (prediction, not a measurement)",
                               "train_mfu": train_mfu})
