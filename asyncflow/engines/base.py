"""Service interfaces of the engines: exactly what the workflow calls, one small abstract class each.

The workflow talks only to these classes, never to Megatron or vLLM directly: an engine joins its own
process groups, knows its ranks, gathers over its data-parallel replicas and sets up its own process
environment. A custom engine plugs in by name or by dotted path to a subclass. The built-ins are named
here by dotted path (``Registry`` imports one when it is first asked for), so this module imports none.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from asyncflow.registry import Registry

TRAIN_ENGINES = Registry("train engine", builtins={
    "megatron": "asyncflow.engines.megatron.actor:MegatronActor",
    "fake": "asyncflow.engines.fake:FakeTrainEngine",
})
CRITIC_ENGINES = Registry("critic engine", builtins={
    "megatron": "asyncflow.engines.megatron.critic:MegatronCritic",
    "fake": "asyncflow.engines.fake:FakeCriticEngine",
})
ROLLOUT_ENGINES = Registry("rollout engine", builtins={
    "vllm": "asyncflow.engines.vllm.rollout:VllmRollout",
    "fake": "asyncflow.engines.fake:FakeRolloutEngine",
})


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where a trainable engine's rank sits in its worker group (``TP x PP x DP`` ranks)."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    mp_rank: int = 0
    """Rank within the replica's model-parallel group (``tp_rank + tp_size x pp_rank``)."""
    mp_size: int = 1
    """Model-parallel ranks of one replica (TP x PP)."""
    writer: bool = True
    """The last pipeline stage's first tensor-parallel rank: it holds its replica's outputs."""


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


@dataclasses.dataclass
class StreamRequest:
    """One response under construction in a ``RolloutStream`` (it may span several engine requests across weight
    swaps, and several turns)."""

    key: Hashable
    prompt: list[int]
    budget: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)  # 1: the model's token, 0: an observation's
    stop: tuple[int, ...] = ()  # token ids that end a turn (a tool call), besides end-of-sequence
    turns: int = 0

    def to_sample(self, finish_reason: str | None, request_id: str, version: int) -> Sample:
        """The response so far; ``version`` (the engine's) where it has no token yet. Copies: a multi-turn request
        goes on growing after this turn's sample was handed out. The row's version is its oldest token's, so the
        staleness bound holds for every token."""
        return Sample(prompt_ids=list(self.prompt), response_ids=list(self.tokens),
                      response_logprobs=list(self.logprobs), weight_version=min(self.versions, default=version),
                      finish_reason=finish_reason, request_id=request_id, token_versions=list(self.versions),
                      loss_mask=list(self.mask), turns=self.turns)


class TrainableEngine(abc.ABC):
    """What every trained model offers: its place in the worker group, a streaming optimizer step, model +
    optimizer checkpoints.

    Built as ``cls(cfg, model_dir, *, trainable=True, group_timeout_s=None)`` on every rank of a worker group
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment): the engine joins the
    group's process groups itself, every collective bounded by ``group_timeout_s`` (None: the backend's
    default), since one step may keep a rank away from its group's next collective for a long time.
    """

    version: int
    """Weight version: 0 as loaded, +1 per optimizer step (the service counts it and restores it on resume)."""

    @property
    @abc.abstractmethod
    def ranks(self) -> Ranks:
        """This rank's place in the worker group."""

    @property
    @abc.abstractmethod
    def micro_batch_size(self) -> int:
        """Rows per micro-batch of ``train_step``."""

    @property
    @abc.abstractmethod
    def fixed_seq_len(self) -> bool:
        """True when every micro-batch must have the run's full sequence length (pipeline stages exchange
        fixed shapes); otherwise a micro-batch is as wide as its longest row."""

    @property
    @abc.abstractmethod
    def seq_multiple(self) -> int:
        """A micro-batch that is not of fixed width is as wide as its longest row rounded up to this: what the
        engine's kernels need (sequence parallelism splits the width over tensor-parallel ranks) or run fastest
        at (tensor cores)."""

    @abc.abstractmethod
    def gather_data_parallel(self, items: list) -> list:
        """Every data-parallel replica's ``items``, concatenated in replica order (collective over the
        replicas; ``items`` itself at one replica)."""

    @abc.abstractmethod
    def check_same_rows(self, fingerprints: list[torch.Tensor], what: str) -> None:
        """Raise on every rank of the replica unless all its model-parallel ranks hold the same ``fingerprints``
        (one per batch read; collective over the model-parallel group). Ranks that computed on different
        rows would not fail by themselves: they would silently combine the logits of different sequences."""

    @abc.abstractmethod
    def group_timeout_s(self) -> float | None:
        """The timeout this rank's process group was created with (None where the backend does not say)."""

    @abc.abstractmethod
    def train_step(self, micro_batches: Iterable[dict[str, torch.Tensor]], num_microbatches: int,
                   loss_fn: Callable) -> dict:
        """Accumulate gradients over a (possibly streaming) micro-batch iterator, then one optimizer step.

        ``loss_fn(logprobs, micro_batch) -> (loss, metrics)`` returns numerators plus a ``normalizer`` metric;
        gradients are divided by the normalizer summed over every micro-batch and replica. Returns
        ``grad_norm`` and ``micro``: each micro-batch's metrics (on the ranks that hold outputs)."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Write a checkpoint of the model (and optimizer) to ``path`` (collective on every rank)."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore a checkpoint written by ``save`` (the caller restores ``version``)."""

    def offload(self) -> int:
        """Colocated ``sync`` on devices: move parameters and optimizer state to host memory and free the
        gradient buffers while another engine uses the device; returns the device bytes freed. Engines that
        cannot keep their memory (0) and the colocation then needs room for both."""
        return 0

    def onload(self) -> None:  # noqa: B027 - optional hook
        """Undo ``offload`` before the engine's next phase."""


class TrainEngine(TrainableEngine):
    """A policy (or reference) model that computes logprobs, trains, and stages its weights for rollout.

    Built with ``trainable=False`` for the frozen reference, which only computes logprobs (and may skip
    gradients and optimizer state)."""

    @abc.abstractmethod
    def compute_logprobs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """log p(tokens[:, 1:]) as [b, s-1] on the writer rank, None elsewhere (collective over the replica)."""

    @abc.abstractmethod
    def weight_stager(self, bucket_mb: float, session: str) -> tuple[object | None, dict]:
        """The loop's weight path: this rank's ``asyncflow.bridge.staging.StagingWriter`` (None on ranks that
        send nothing) and the ``SyncPlan`` as plain data for the rollout side. ``session`` names the run's
        staging segments. The writer's ``stage(version)`` is called after every optimizer step."""

    def stream_weights_from_host(self) -> None:
        """Reference placement ``offload``: keep the (frozen) weights in host memory and bring each layer to
        the device only while it runs. Engines built with ``trainable=False`` are asked for it."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream its weights from host memory; "
                                  "set trainer.reference_placement to colocated or own")


class CriticEngine(TrainableEngine):
    """A value model (PPO's critic): per-token values and its own training."""

    @abc.abstractmethod
    def compute_values(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """V at every position as [b, s-1] on the writer rank (None elsewhere), aligned like
        ``compute_logprobs`` (position t: before token t+1)."""


class RolloutStream(abc.ABC):
    """Continuous batching on one rollout engine (``RolloutEngine.stream``): responses are admitted whenever a
    slot is free and come back the moment they finish, with no batch barrier; one caller thread."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Responses in flight (admitted, not finished)."""

    @property
    @abc.abstractmethod
    def free(self) -> int:
        """Slots the caller may still fill."""

    @abc.abstractmethod
    def running(self) -> int:
        """Sequences the engine is decoding right now."""

    @abc.abstractmethod
    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> None:
        """Admit one response of ``prompt`` (``key`` comes back with it) at the engine's current version;
        ``max_new_tokens`` budgets the whole response, every turn included (None: the engine's own)."""

    @abc.abstractmethod
    def step(self) -> list[tuple[Hashable, Sample]]:
        """One decoding step of every running response; the ``(key, sample)`` pairs that finished in it. With
        ``turns``, a turn ends at a stop token too, and the response waits for ``continue_turn``/``release``."""

    @abc.abstractmethod
    def continue_turn(self, key: Hashable, observation: list[int]) -> bool:
        """Append ``observation`` (loss mask 0) to the finished turn of ``key`` and generate the next turn;
        False (nothing admitted) when the budget leaves no token for the model."""

    @abc.abstractmethod
    def release(self, key: Hashable) -> None:
        """Forget the finished turn of ``key`` (its trajectory is done)."""

    @abc.abstractmethod
    def swap_weights(self, apply: Callable[[], object], keep_kv: bool = False
                     ) -> tuple[object, list[tuple[Hashable, Sample]]]:
        """Partial rollout: at this token boundary run ``apply()`` (it changes the engine's weights) and carry
        every in-flight response on under the new weights (its prefix recomputed, or with ``keep_kv`` its KV
        cache kept). Returns ``apply``'s result and the responses that finished meanwhile."""

    @abc.abstractmethod
    def abort(self) -> int:
        """Drop every in-flight response (the sample stream gives their prompts back when no step can train them
        any more); returns how many."""


class RolloutEngine(abc.ABC):
    """An inference engine that generates with per-token logprobs and applies versions staged by the trainer.

    Built as ``cls(cfg, model_dir, *, share_device=False, cpus=None, visible_devices=None)``, before anything
    else in its process touches a device: the engine sets up its own process environment. ``share_device``:
    the trainer uses the same devices in turns (colocated ``sync``; see ``sleep``); ``cpus``: the cores this
    worker may use; ``visible_devices``: the device ids its engine runs on (None: what Ray assigned).
    """

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 on_sample: Callable[[int, Sample], None] | None = None,
                 max_new_tokens: int | Sequence[int | None] | None = None, ignore_eos: bool = False,
                 temperature: float | None = None) -> list[Sample]:
        """``n`` responses per prompt, in prompt order. ``on_sample(prompt_index, sample)`` fires as each one
        finishes. ``max_new_tokens``: one budget, or one per prompt (None: the engine's configured one);
        ``ignore_eos``: every response uses its whole budget; ``temperature``: None samples at the configured one,
        0 is greedy (evaluation, ``asyncflow.workflow.evaluation``). Weights never change during a call."""

    @abc.abstractmethod
    def apply_staged(self, staging: dict, version: int) -> dict:
        """Serve ``version`` from now on, read from the segments staged by the trainer's ``weight_stager``
        writers (called between generations, or by a stream's ``swap_weights``).

        ``staging`` holds the plan (plain data) and the staging segments; raises
        ``asyncflow.bridge.staging.StaleStagingError`` when the trainer overwrote the version meanwhile (the
        caller applies the newest one instead). Returns ``buckets``, ``bytes_per_rank`` and ``ranks`` (per
        engine rank: ``bytes_by_source``).
        """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version the engine serves (-1 while none is complete)."""

    def relay_plan(self, plan: dict, model_dir: str):
        """The byte layout of the staging segments that ``plan`` (plain data from the trainer's ``weight_stager``)
        describes: what a relay receiver mirrors from another host (``asyncflow.bridge.relay.RelayReceiver``)."""
        from asyncflow.bridge.sync import plan_from_dict
        from asyncflow.models.arch import GPTArch

        return plan_from_dict(GPTArch.from_pretrained(model_dir), plan)

    def stream(self, ignore_eos: bool = False, turns: bool = False) -> RolloutStream:
        """A continuous-batching handle (``ignore_eos``: responses use their whole budget; ``turns``: multi-turn
        agent loops). Engines without one support the chunked rollout only."""
        raise NotImplementedError(f"{type(self).__name__} has no continuous-batching stream")

    def sleep(self) -> int:
        """Colocated ``sync`` on devices: release the device memory of weights and KV cache while the trainer
        uses the device (the next ``apply_staged`` refills the weights); returns the bytes released, 0 for
        engines that cannot (the colocation then needs room for both)."""
        return 0

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Take the device memory back after ``sleep``, before the next weight apply and generation."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's processes and memory (engines without any may ignore it)."""


def make_train_engine(spec: str, *args, **kwargs) -> TrainEngine:
    """Instantiate a train engine by registered name or dotted path."""
    return TRAIN_ENGINES.resolve(spec)(*args, **kwargs)


def make_critic_engine(spec: str, *args, **kwargs) -> CriticEngine:
    """Instantiate a critic engine by registered name or dotted path."""
    return CRITIC_ENGINES.resolve(spec)(*args, **kwargs)


def make_rollout_engine(spec: str, *args, **kwargs) -> RolloutEngine:
    """Instantiate a rollout engine by registered name or dotted path."""
    return ROLLOUT_ENGINES.resolve(spec)(*args, **kwargs)
