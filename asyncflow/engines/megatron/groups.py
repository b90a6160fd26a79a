"""The Megatron engine's place in its worker group, read from Megatron's parallel state (after ``init_megatron``)."""

from __future__ import annotations

import torch

from asyncflow.engines.base import Ranks


def ranks() -> Ranks:
    """This process's data-parallel and model-parallel position."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    return Ranks(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), tp_rank=tp,
                 pp_rank=pp, mp_rank=tp + tp_size * pp, mp_size=tp_size * ps.get_pipeline_model_parallel_world_size(),
                 writer=ps.is_pipeline_last_stage() and tp == 0)


def gather_data_parallel(items: list) -> list:
    """Every data-parallel replica's ``items`` in replica order (``items`` itself at one replica)."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size()
    if size == 1:
        return items
    gathered: list = [None] * size
    torch.distributed.all_gather_object(gathered, items, group=ps.get_data_parallel_group(with_context_parallel=False))
    return [x for part in gathered for x in part]


def check_same_rows(fingerprints: list[torch.Tensor], what: str) -> None:
    """``check_same_batches`` over this replica's model-parallel group."""
    from megatron.core import parallel_state as ps

    check_same_batches(fingerprints, ps.get_model_parallel_group(), what)


def check_same_batches(fingerprints: list[torch.Tensor], group, what: str) -> None:
    """Raise on every rank of ``group`` unless all of them hold the same fingerprint list.

    Model-parallel ranks that computed on different rows would not fail by themselves: they would silently
    combine the logits of different sequences (e.g. rows freed after the first rank's read, their storage reused
    by the next step's rows before the other ranks read them).
    """
    everyone: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, [f.tolist() for f in fingerprints], group=group)
    if any(other != everyone[0] for other in everyone):
        raise RuntimeError(f"{what}: the model-parallel ranks of one replica read different rows (batch "
                           f"fingerprints per rank: {everyone}); they must receive identical batches")


def group_timeout_s() -> float | None:
    """The timeout of the default process group (None where the backend does not say)."""
    try:
        backend = torch.distributed.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (RuntimeError, AttributeError):  # a CUDA-only (NCCL) default group has no CPU backend to ask
        return None
