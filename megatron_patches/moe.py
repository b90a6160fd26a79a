"""Patch: Megatron's MoE router without Transformer Engine.

Target: ``megatron.core.transformer.moe.moe_utils.te_general_gemm``.
Reason: megatron-core 0.16.1 references ``te_general_gemm`` in the MoE router even when Transformer
Engine is absent, which raises NameError on CPU. Defining it as ``None`` makes Megatron take its own
torch fallback. (The MoE token dispatcher must also be ``allgather`` on CPU: ``alltoall`` creates CUDA
streams; the model builder chooses it.)
Megatron versions checked: 0.16.1.
"""

from __future__ import annotations

TARGETS = ["megatron.core.transformer.moe.moe_utils"]


def apply() -> None:
    """Define the missing name when Transformer Engine is not installed (idempotent)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
