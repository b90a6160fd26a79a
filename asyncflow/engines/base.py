"""Service interfaces of the engines: one small abstract class for training, one for rollout.

Algorithms and the workflow talk only to these classes, never to Megatron or vLLM directly, so a
custom engine plugs in by name (``TRAIN_ENGINES`` / ``ROLLOUT_ENGINES``) or by dotted path to a
subclass. The Megatron and vLLM implementations register themselves as ``megatron`` and ``vllm``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from asyncflow.registry import Registry

TRAIN_ENGINES = Registry("train engine")
ROLLOUT_ENGINES = Registry("rollout engine")
CRITIC_ENGINES = Registry("critic engine")

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclasses.dataclass
class Sample:
    """One generated response with the facts the workflow needs about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    weight_version: int
    finish_reason: str | None = None
    request_id: str = ""
    token_versions: list[int] | None = None
    """The weight version that produced each response token (None: all ``weight_version``). With partial
    rollout a response spans versions and ``weight_version`` is the oldest of them."""
    loss_mask: list[int] | None = None
    """Per response token: 1 if the model generated it, 0 for an agent loop's observation (None: all 1)."""
    turns: int = 1
    """Model turns in the response (multi-turn agent loops)."""


class TrainableEngine(abc.ABC):
    """What every trained model offers: a streaming optimizer step and model + optimizer checkpoints."""

    version: int
    """Weight version: 0 as loaded, +1 per optimizer step."""

    @abc.abstractmethod
    def train_step(self, micro_batches: Iterable[dict[str, torch.Tensor]], num_microbatches: int,
                   loss_fn: Callable) -> dict[str, float]:
        """Accumulate gradients over a (possibly streaming) micro-batch iterator, then one optimizer step."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Write a checkpoint of the model (and optimizer) to ``path``."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore a checkpoint written by ``save``."""

    def offload(self) -> int:
        """Colocated ``sync`` on devices: move parameters and optimizer state to host memory and free the
        gradient buffers while another engine uses the device; returns the device bytes freed. Engines that
        cannot keep their memory (0) and the colocation then needs room for both."""
        return 0

    def onload(self) -> None:  # noqa: B027 - optional hook
        """Undo ``offload`` before the engine's next phase."""


class TrainEngine(TrainableEngine):
    """A policy (or reference) model that computes logprobs, trains, and exports its weights.

    Built as ``cls(cfg, model_dir)`` for the actor and ``cls(cfg, model_dir, trainable=False)`` for the
    frozen reference, which only computes logprobs (and may skip gradients and optimizer state)."""

    @abc.abstractmethod
    def compute_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, 1:]) as [b, s-1] (collective over the engine's ranks)."""

    @abc.abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named full tensors of this rank's part of the current weights (tools, tests)."""

    def stream_weights_from_host(self) -> None:
        """Reference placement ``offload``: keep the (frozen) weights in host memory and bring each layer to
        the device only while it runs. Engines built with ``trainable=False`` are asked for it."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream its weights from host memory; "
                                  "set trainer.reference_placement to colocated or own")

    @abc.abstractmethod
    def weight_stager(self, bucket_mb: float, session: str) -> tuple[object | None, dict]:
        """The loop's weight path: this rank's ``asyncflow.bridge.staging.StagingWriter`` (None on ranks that
        send nothing) and the ``SyncPlan`` as plain data for the rollout side. ``session`` names the run's
        staging segments. The writer's ``stage(version)`` is called after every optimizer step."""


class CriticEngine(TrainableEngine):
    """A value model (PPO's critic): per-token values and its own training."""

    @abc.abstractmethod
    def compute_values(self, tokens: torch.Tensor) -> torch.Tensor:
        """V at every position as [b, s-1], aligned like ``compute_logprobs`` (position t: before token t+1)."""


class RolloutEngine(abc.ABC):
    """An inference engine that generates with per-token logprobs and takes versioned weight updates."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 on_sample: Callable[[int, Sample], None] | None = None) -> list[Sample]:
        """``n`` responses per prompt. ``on_sample(prompt_index, sample)`` fires as each one finishes."""

    @abc.abstractmethod
    def apply_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Serve weights ``version`` from now on (called between generations: never mixes versions)."""

    def apply_staged(self, staging: dict, version: int) -> dict:
        """Apply a version staged by the trainer's ``weight_stager`` writers (the loop's weight path).

        ``staging`` holds the plan (plain data) and the staging segments; raises
        ``asyncflow.bridge.staging.StaleStagingError`` when the trainer overwrote the version meanwhile (the
        caller applies the newest one instead). Engines that only take full tensors leave this out.
        """
        raise NotImplementedError(f"{type(self).__name__} takes weights through apply_weights only")

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version the engine serves."""

    def sleep(self) -> int:
        """Colocated ``sync`` on devices: release the device memory of weights and KV cache while the trainer
        uses the device (the next ``apply_staged`` refills the weights); returns the bytes released, 0 for
        engines that cannot (the colocation then needs room for both)."""
        return 0

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Take the device memory back after ``sleep``, before the next weight apply and generation."""

    def stream(self, ignore_eos: bool = False, turns: bool = False):
        """A continuous-batching handle (``asyncflow.engines.vllm.stream.VllmStream``'s interface: ``add``,
        ``step``, ``swap_weights``, ``running``). Engines without one support the chunked rollout only."""
        raise NotImplementedError(f"{type(self).__name__} has no continuous-batching stream")

    def pause(self) -> None:  # noqa: B027 - optional hook
        """Stop scheduling new work (engines without the notion may ignore it)."""

    def resume(self) -> None:  # noqa: B027 - optional hook
        """Undo ``pause``."""

    def abort(self) -> int:
        """Abort in-flight requests; returns how many were aborted."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's processes and memory (engines without any may ignore it)."""


def make_train_engine(spec: str, *args, **kwargs) -> TrainEngine:
    """Instantiate a train engine by registered name or dotted path."""
    import asyncflow.engines.megatron.actor  # noqa: F401 - registers "megatron"

    return TRAIN_ENGINES.resolve(spec)(*args, **kwargs)


def make_critic_engine(spec: str, *args, **kwargs) -> CriticEngine:
    """Instantiate a critic engine by registered name or dotted path."""
    import asyncflow.engines.megatron.critic  # noqa: F401 - registers "megatron"

    return CRITIC_ENGINES.resolve(spec)(*args, **kwargs)


def make_rollout_engine(spec: str, *args, **kwargs) -> RolloutEngine:
    """Instantiate a rollout engine by registered name or dotted path."""
    import asyncflow.engines.vllm.rollout  # noqa: F401 - registers "vllm"

    return ROLLOUT_ENGINES.resolve(spec)(*args, **kwargs)
