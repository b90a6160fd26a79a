"""Patch: pipeline-parallel schedules on CPU.

Target: ``megatron.core.pipeline_parallel.p2p_communication`` and ``schedules``.
Reason: p2p calls ``torch.cuda.synchronize()`` after every exchange and the schedules build
``torch.zeros([], device="cuda")`` token counters; both are covered by ``megatron_patches.device``.
This file only records the targets so that ``missing_targets()`` notices when Megatron moves them.
Megatron versions checked: 0.16.1.
"""

TARGETS = [
    "megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
    "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
    "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator",
]


def apply() -> None:
    """Nothing beyond ``device.apply()`` is needed on 0.16.x (kept as the place for future fixes)."""
