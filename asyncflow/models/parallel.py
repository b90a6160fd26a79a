"""Process-group and model-parallel set-up for the Megatron engine (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import os

import torch

from asyncflow.ports import _loopback, free_port, interface_towards


def init_megatron(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 1234,
    *,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> None:
    """Initialize torch.distributed, Megatron's parallel state and its RNG streams.

    Rank and world size default to the ``RANK``/``WORLD_SIZE`` environment (torchrun, Ray workers);
    a single process with neither gets a world of one on a free local port. On CPU the Megatron
    patches are applied first and the backend is gloo; on CUDA, ``LOCAL_RANK`` (when set) picks the device.
    ``timeout_s`` bounds every collective of the default group and of every group Megatron creates: a run
    passes ``workflow.step_timeout_s``, since one step (a long generation, a pipeline flush) may keep a rank
    away from its group's next collective longer than torch's default of 10 minutes. None (tests, tools)
    keeps torch's and Megatron's defaults (10 and 30 minutes).
    """
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp

    import megatron_patches

    megatron_patches.apply()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        # torchrun shows every local device to every process (Ray shows each worker one): pick ours before
        # NCCL binds to the current device. ``asyncflow.models.device.engine_device`` reads it back.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not torch.distributed.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        own_port = init_method is None and "MASTER_ADDR" not in os.environ and world_size == 1
        if init_method is None:
            init_method = "env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{free_port()}"
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and not _loopback(master):
            # gloo advertises what the hostname resolves to, often 127.0.0.1 (cloud images, containers): peers on
            # other nodes could not connect. Use the interface that reaches the rendezvous node instead.
            interface = interface_towards(master)
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        timeout = datetime.timedelta(minutes=10) if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        for attempt in range(5):
            try:
                torch.distributed.init_process_group(backend, init_method=init_method, rank=rank,
                                                     world_size=world_size, timeout=timeout)
                break
            except torch.distributed.DistNetworkError:
                # A world of one on a port picked here: another process may take the port between the pick and
                # the store's listen (seen with two runs starting at once); pick another.
                if not own_port or attempt == 4:
                    raise
                init_method = f"tcp://127.0.0.1:{free_port()}"
    if not parallel_state.model_parallel_is_initialized():
        minutes = {} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}  # fractions work
        parallel_state.initialize_model_parallel(
            tensor_parallel, pipeline_parallel, expert_model_parallel_size=expert_parallel,
            context_parallel_size=context_parallel, **minutes,
        )
    mtp.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down Megatron's parallel state and the default process group (tests, re-initialization)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
