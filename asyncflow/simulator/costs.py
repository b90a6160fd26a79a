"""The cost model of one kind of hardware: what each RL task costs, as a few linear terms.

``asyncflow profile`` measures the engines' terms on the machine it runs on and writes them as JSON; the
simulator reads it. Every term is a least-squares fit of real timings (``fit``), and the file keeps the raw samples so
that a fit can be checked. One file holds a ``CostModel`` per *variant*: on CPU a variant is a number of
threads per heavy worker (async runs pin workers to one core each, sync runs give each worker every core
in turn); on a GPU node it is one device per rank.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from asyncflow import config_loader


@dataclasses.dataclass
class RolloutCosts:
    """One rollout engine instance. A decode step over ``B`` running sequences that attend to ``C`` KV tokens
    in total costs ``step_s + per_seq_s * B + per_ctx_token_s * C``; prefill costs ``prefill_per_token_s``
    per prompt token; each request costs ``per_request_s`` (tokenising, scheduling, output processing)."""

    step_s: float = 0.0
    """Fixed cost of one engine step (scheduler, sampler launch, Python)."""
    per_seq_s: float = 0.0
    """Cost per running sequence per decode step (the weight-streaming GEMVs amortise over these)."""
    per_ctx_token_s: float = 0.0
    """Cost per attended KV-cache token per decode step (attention)."""
    prefill_per_token_s: float = 0.0
    """Cost per prompt token of prefill."""
    per_request_s: float = 0.0
    """Fixed cost per request (added and finished)."""
    expert_read_s: float = 0.0
    """MoE: seconds to read every routed expert's weights once (0 for a dense model). A step reads only the experts
    its tokens route to (``fixed_s``), not all of them: at batch 1 that is top-k of E."""
    experts: int = 0
    """MoE: routed experts per layer."""
    experts_topk: int = 0
    """MoE: experts each token routes to."""

    def fixed_s(self, tokens: int) -> float:
        """Seconds of one engine step beyond the per-sequence and attention terms, for ``tokens`` tokens in the
        step: ``step_s`` plus the routed experts those tokens touch, ``1 - (1 - k/E)^tokens`` of them in
        expectation under uniform routing."""
        if not self.experts:
            return self.step_s
        touched = 1.0 - (1.0 - self.experts_topk / self.experts) ** max(tokens, 1)
        return self.step_s + self.expert_read_s * touched

    def decode_step(self, batch: int, ctx_tokens: float) -> float:
        """Seconds of one decode step over ``batch`` sequences attending to ``ctx_tokens`` tokens in total."""
        return self.fixed_s(batch) + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens


@dataclasses.dataclass
class TrainCosts:
    """One Megatron data-parallel replica at the recipe's TP x PP layout (its ranks work together)."""

    per_micro_s: float = 0.0
    """Fixed cost of one micro-batch forward + backward (schedule, launch, loss)."""
    per_token_s: float = 0.0
    """Forward + backward per (padded) token of a micro-batch."""
    per_token_seq_s: float = 0.0
    """Forward + backward per (padded) token and per token of its padded row: attention, whose work grows with
    the square of the row length. Without it, a line through the profile's calls misses its shortest and longest
    micro-batches in opposite directions."""
    optimizer_s: float = 0.0
    """Gradient finalisation and one optimizer step."""
    ref_per_call_s: float = 0.0
    """Fixed cost of one reference (forward-only) log-prob call."""
    ref_per_token_s: float = 0.0
    """Reference forward per (padded) token."""
    ref_per_token_seq_s: float = 0.0
    """Reference forward per (padded) token and per token of its padded row (attention)."""
    grad_allreduce_s: float = 0.0
    """One replica's gradients (in the dtype the trainer reduces them in) over its data-parallel link, in seconds
    (bytes / link bandwidth); a ring all-reduce over DP replicas costs ``2 (DP - 1) / DP`` of it per optimizer
    step (``allreduce_s``)."""

    def allreduce_s(self, data_parallel: int) -> float:
        """The gradient all-reduce of one optimizer step over ``data_parallel`` replicas (ring)."""
        return self.grad_allreduce_s * 2 * (data_parallel - 1) / data_parallel

    def micro_s(self, tokens: int, seq: float) -> float:
        """Forward + backward of one micro-batch of ``tokens`` padded tokens in rows of ``seq``."""
        return self.per_micro_s + self.per_token_s * tokens + self.per_token_seq_s * tokens * seq

    def reference_s(self, tokens: int, seq: float) -> float:
        """One reference log-prob call over ``tokens`` padded tokens in rows of ``seq``."""
        return self.ref_per_call_s + self.ref_per_token_s * tokens + self.ref_per_token_seq_s * tokens * seq


@dataclasses.dataclass
class WeightSyncCosts:
    """The loop's weight path (``asyncflow.bridge.staging``): stage on the trainer, apply on rollout."""

    stage_fixed_s: float = 0.0
    """Fixed cost of staging one version (per exporting rank, ranks in parallel)."""
    stage_per_byte_s: float = 0.0
    """Staging cost per byte of one exporting rank's shards."""
    apply_fixed_s: float = 0.0
    """Fixed cost of applying one version in a rollout engine (reload, prefix-cache reset)."""
    apply_per_byte_s: float = 0.0
    """Apply cost per byte a rollout rank reads."""


@dataclasses.dataclass
class QueueCosts:
    """The TransferQueue client: per request and per byte (put and get alike)."""

    per_request_s: float = 0.0
    """Round trip of one put or get (controller and storage-unit messages)."""
    per_byte_s: float = 0.0
    """Per payload byte."""

    def request(self, nbytes: float) -> float:
        """Seconds of one request moving ``nbytes``."""
        return self.per_request_s + self.per_byte_s * nbytes


@dataclasses.dataclass
class LightCosts:
    """The light CPU tasks (reward function, advantage estimator), per row."""

    reward_per_row_s: float = 0.0
    """Reward function per response."""
    advantage_per_row_s: float = 0.0
    """Advantage estimator per row."""


@dataclasses.dataclass
class ServiceCosts:
    """What the loop's services cost beyond their engine calls (TransferQueue hand-offs, packing, per-row
    Python, Ray calls between sync phases). The defaults are the engine-only model that ``asyncflow profile``
    writes; ``bench/calibrate.py`` fits them from real runs of the loop on the CPU machine.

    Per call, row or token, not per unit of engine time: a task's span beyond its engine time stays about the same
    whether a step's answers are short or long, so a ratio fitted on one workload mispredicts the other. The
    per-call part is latency that does not occupy the device."""

    generate_token_s: float = 0.0
    """Seconds per generated token beyond the engine's time (reading each token's logprob out of vLLM's output,
    packing and putting the response)."""
    reference_call_s: float = 0.0
    """Seconds per reference call (one ``score_chunk``) beyond its forward."""
    reference_token_s: float = 0.0
    """Seconds per token of a reference call's rows (unpadded) beyond its forward (moving and packing per-token
    fields)."""
    train_micro_s: float = 0.0
    """Seconds per micro-batch of the actor's streamed first pass beyond its forward and backward."""
    train_token_s: float = 0.0
    """Seconds per token of a first-pass micro-batch's rows (unpadded: the padding is the engine's, priced by the
    profile) beyond its forward and backward."""
    sync_handoff_s: float = 0.0
    """Seconds per sync step between phases (the driver's Ray calls), beyond the tasks' spans."""
    async_floating_row_s: float = 0.0
    """Async CPU placement: CPU seconds per trained row of the processes that float over every core (the
    TransferQueue's controller and storage units, the version board, the driver, the reward and advantage
    services, Ray's daemons). Added as each field of a row is put to the pinned cores' floating pool
    (``events.Pool``): an idle pinned core runs it at full speed, and only when both are busy does it take a fair
    share of each."""
    async_floating: float = 0.0
    """Async CPU placement: what else async adds beyond ``async_floating_row_s`` (the pinned workers contending
    for memory and caches, the rollout worker's polling), as CPU seconds per second of work on a pinned core,
    added to the same floating pool."""
    rollout_engine_scale: float = 1.0
    """The rollout engine's speed inside the loop against the profile (its time in real generate calls over the
    profile's prediction of the same calls). The simulator multiplies ``RolloutCosts`` by it
    (``CostModel.in_loop``): on a shared machine a profile's minutes and a run's can differ in speed, and a
    difference of spans alone cannot tell a slow profile from a dear service."""
    reference_engine_scale: float = 1.0
    """The reference forward's speed inside the loop against the profile; multiplies the ``TrainCosts.ref_*``
    terms."""
    train_engine_scale: float = 1.0
    """The actor's ``train_step`` speed inside the loop against the profile (forward, backward and optimizer,
    without the stream's reads); multiplies the actor's ``TrainCosts`` terms."""


@dataclasses.dataclass
class SwitchCosts:
    """What a colocated step pays to switch its devices between generating and training, per step (nothing on
    split devices): the trainer's state offloaded to host memory and back, the rollout engine put to sleep and
    woken (its weights off and on the device, its KV cache dropped and re-allocated), and the new weights
    resharded into the engine."""

    offload_s: float = 0.0
    """The trainer's whole state (weights, gradients, optimizer) to host memory and back over one device's link;
    a step pays it divided by the devices the state is sharded over (``step_s``)."""
    state_shards: int = 0
    """Devices the trainer's state is sharded over (hybrid sharding: FSDP's ``fsdp_size``, each device holding
    ``1 / state_shards`` of it); 0: every trainer device."""
    sleep_wake_s: float = 0.0
    """The rollout engine's sleep and wake-up (weights off and on the device, KV cache re-allocated)."""
    reload_s: float = 0.0
    """The trained weights resharded into the rollout engine."""

    def offload_step_s(self, trainer_devices: int = 1) -> float:
        """Seconds per colocated step of the trainer's state to host memory and back, sharded over
        ``state_shards`` devices or, when 0, over all ``trainer_devices``."""
        return self.offload_s / (self.state_shards or trainer_devices)

    def step_s(self, trainer_devices: int = 1) -> float:
        """Seconds of switching per colocated step: ``offload_step_s``, the engine's sleep and wake, the reload."""
        return self.offload_step_s(trainer_devices) + self.sleep_wake_s + self.reload_s


@dataclasses.dataclass
class CostModel:
    """Every cost of one variant of one machine (one ``asyncflow profile`` measurement)."""

    rollout: RolloutCosts = dataclasses.field(default_factory=RolloutCosts)
    """The rollout engine."""
    train: TrainCosts = dataclasses.field(default_factory=TrainCosts)
    """The trainer and the reference forward."""
    weight_sync: WeightSyncCosts = dataclasses.field(default_factory=WeightSyncCosts)
    """The weight path."""
    queue: QueueCosts = dataclasses.field(default_factory=QueueCosts)
    """The TransferQueue."""
    light: LightCosts = dataclasses.field(default_factory=LightCosts)
    """Reward and advantage."""
    service: ServiceCosts = dataclasses.field(default_factory=ServiceCosts)
    """The services' overhead beyond the engine calls (none by default)."""
    switch: SwitchCosts = dataclasses.field(default_factory=SwitchCosts)
    """A colocated step's switching between generating and training (none by default)."""
    weight_bytes: float = 0.0
    """Bytes of one exporting rank's weights as staged (the profiled model; ``Workload`` may override)."""
    rollout_weight_bytes: float = 0.0
    """Bytes one rollout rank reads to apply a version: its TP shard of the whole model, not a trainer rank's
    shard (0: ``weight_bytes``, a profile where both are the same single-device model)."""

    @property
    def apply_bytes(self) -> float:
        """Bytes one rollout rank reads to apply a version."""
        return self.rollout_weight_bytes or self.weight_bytes

    def scaled(self, factor: float) -> CostModel:
        """Every time term multiplied by ``factor`` (the machine is ``factor`` times slower than when profiled)."""
        service = _scale(self.service, factor, {f.name for f in dataclasses.fields(ServiceCosts)} - RATIOS)
        return dataclasses.replace(self, rollout=_scale(self.rollout, factor), train=_scale(self.train, factor),
                                   weight_sync=_scale(self.weight_sync, factor), queue=_scale(self.queue, factor),
                                   light=_scale(self.light, factor), service=service,
                                   switch=_scale(self.switch, factor))

    def in_loop(self) -> CostModel:
        """The engines' costs at their speed inside the loop: ``RolloutCosts`` times
        ``service.rollout_engine_scale``, the reference's and the actor's ``TrainCosts`` terms times theirs (the
        scales then 1, so applying it twice changes nothing). ``simulate`` runs on this."""
        sv = self.service
        if (sv.rollout_engine_scale, sv.reference_engine_scale, sv.train_engine_scale) == (1.0, 1.0, 1.0):
            return self
        train = _scale(self.train, sv.train_engine_scale, ACTOR_TERMS)
        train = _scale(train, sv.reference_engine_scale, REFERENCE_TERMS)
        return dataclasses.replace(self, rollout=_scale(self.rollout, sv.rollout_engine_scale), train=train,
                                   service=dataclasses.replace(sv, rollout_engine_scale=1.0,
                                                               reference_engine_scale=1.0, train_engine_scale=1.0))

    def tilted(self, rollout: float = 1.0, train: float = 1.0) -> CostModel:
        """Rollout's costs (the engine and its service overhead) times ``rollout``, the trainer's (actor and
        reference: engine and service overhead) times ``train``; the rest as fitted (``simulator.sensitivity``)."""
        service = _scale(self.service, rollout, {"generate_token_s"})
        service = _scale(service, train, {"reference_call_s", "reference_token_s", "train_micro_s", "train_token_s"})
        return dataclasses.replace(self, rollout=_scale(self.rollout, rollout), train=_scale(self.train, train),
                                   service=service)


RATIOS = {"async_floating", "rollout_engine_scale", "reference_engine_scale", "train_engine_scale"}
"""The ``ServiceCosts`` fields that are ratios, not times: ``CostModel.scaled`` leaves them as they are."""
ACTOR_TERMS = {"per_micro_s", "per_token_s", "per_token_seq_s", "optimizer_s", "grad_allreduce_s"}
"""The actor's ``TrainCosts`` terms (the others are the reference forward's)."""
REFERENCE_TERMS = {f.name for f in dataclasses.fields(TrainCosts)} - ACTOR_TERMS
"""The reference forward's ``TrainCosts`` terms."""


def _scale(section, factor: float, names: set[str] | None = None):
    """``section`` (a costs dataclass) with its fields (or only ``names``) multiplied by ``factor``."""
    scaled = [f.name for f in dataclasses.fields(section) if (names is None or f.name in names) and f.type != "int"]
    return dataclasses.replace(section, **{name: getattr(section, name) * factor for name in scaled})


@dataclasses.dataclass
class CostFile:
    """A cost file: ``CostModel`` per variant, where it was measured, and the raw samples of each fit."""

    variants: dict[str, CostModel]
    """Variant name (CPU: threads per heavy worker, ``"1"``, ``"2"``; devices: ``"device"``) -> costs."""
    hardware: dict = dataclasses.field(default_factory=dict)
    """What was measured on (host, CPU, devices, model) and when."""
    samples: dict = dataclasses.field(default_factory=dict)
    """Raw measurements behind each fit, per variant (for checking, never read by the simulator)."""

    def variant(self, name: str | int) -> CostModel:
        """The costs of variant ``name``; an unknown name is an error listing the valid ones."""
        key = str(name)
        if key not in self.variants:
            raise KeyError(f"cost file has no variant {key!r}; it has {sorted(self.variants)}")
        return self.variants[key]

    def save(self, path: str | Path) -> Path:
        """Write the file as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        return path


def load_costs(path: str | Path) -> CostFile:
    """Read a cost file written by ``CostFile.save`` (types checked, unknown keys rejected)."""
    data = json.loads(Path(path).read_text())
    variants = {k: config_loader.build(CostModel, v) for k, v in data.get("variants", {}).items()}
    if not variants:
        raise ValueError(f"{path}: no cost variants")
    return CostFile(variants, data.get("hardware", {}), data.get("samples", {}))


def fit(features: list[list[float]], seconds: list[float], relative: bool = True) -> list[float]:
    """Non-negative least squares of ``seconds ~ features @ coef`` (a cost is never negative), in relative
    error (``relative``): each sample's residual is divided by its time.

    Relative, because a profile's calls span 30x in time and the predictions are judged in relative terms:
    plain least squares fits the largest calls and leaves the smallest far off, which a workload of short
    answers is made of.
    Plain least squares can give a negative term when two features are nearly collinear on a small grid;
    the active-set loop drops such terms and refits (Lawson-Hanson in its simplest form, enough for 2-5 terms;
    written here because scipy is not otherwise a dependency).
    """
    y = np.asarray(seconds, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-12) if relative else np.ones_like(y)
    x, y = np.asarray(features, dtype=float) * weight[:, None], y * weight
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef.tolist()
