"""What the simulator runs: the shape of one RL run, read from the same ``AsyncFlowConfig`` as ``asyncflow
train``, and the response lengths it draws.

Response lengths (``lengths``):

- ``constant:N``: every response has N tokens (closed-form checks);
- ``lognormal:MEDIAN:SIGMA``: the ``add1_longtail`` budgets (clipped to ``[4, max_new_tokens]``), what
  ``bench/e2e.py`` generates;
- ``replay:PATH``: the mean response length of each step of a run's ``metrics.jsonl`` (``rollout/tokens``
  over ``actor/rows``), drawn around that mean with the lognormal shape of ``replay_sigma``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Literal

import numpy as np

from asyncflow.config import AsyncFlowConfig


@dataclasses.dataclass
class Workload:
    """The simulated run (one typed config for the simulator; ``from_config`` fills it from a recipe)."""

    mode: Literal["async", "sync", "stream", "colocated"] = "async"
    """``async``: tasks on their own devices, overlapping; ``sync``: lock-step on shared devices; ``stream``: the
    sample stream (``simulator.stream``: rollout generates continuously, each trainer step takes the first complete
    groups within the staleness bound); ``colocated``: the colocated baseline (every device generates, switches,
    then trains)."""
    max_staleness: int = 1
    """k: rollout starts step s once weights of version s - k exist."""
    steps: int = 10
    """Simulated training steps."""
    prompts_per_step: int = 16
    """Prompts per global batch."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group)."""
    rollout_instances: int = 1
    """Rollout engines; each pulls ``rollout_chunk`` rows at a time."""
    rollout_chunk: int = 64
    """Rows a rollout instance takes per request (the chunked loop generates each chunk as one engine batch)."""
    max_num_seqs: int = 256
    """Sequences one engine runs at once; the rest of a chunk waits for a free slot."""
    score_chunk: int = 64
    """Rows the reward and reference tasks take per request."""
    micro_batch_size: int = 4
    """Trainer micro-batch (rows per data-parallel replica)."""
    data_parallel: int = 1
    """Trainer data-parallel replicas (they work in parallel on distinct rows)."""
    fixed_shape: bool = False
    """Pipeline parallelism pads every micro-batch to ``prompt_len + max_new_tokens``."""
    packing: bool = False
    """Sequence packing: a micro-batch (actor and reference) costs its rows' own tokens, each row attending only
    within itself, with no padding (``fixed_shape`` then does not apply)."""
    pipeline_parallel: int = 1
    """Trainer pipeline stages (the stream and colocated models charge the pipeline bubble)."""
    devices_per_replica: int = 1
    """Devices of one trainer data-parallel replica (TP x PP x CP): the colocated baseline's trainer state is
    sharded over ``data_parallel`` x this many devices."""
    mini_batches: int = 1
    """Optimizer steps per training step (``stream``, ``colocated``): the step's groups in that many mini-batches,
    each with its gradient all-reduce (verl's ``train_batch_size / ppo_mini_batch_size``)."""
    old_logprob: bool = False
    """``colocated``: a forward pass for the old policy's log-probs before training (verl's colocated trainer); the
    stream uses rollout's."""
    stream_ahead: float = 0.0
    """``stream``: groups admitted to rollout and not yet trained, in steps' worth (verl's ``1 +
    staleness_threshold``); 0: ``max_staleness + 1``."""
    row_order: str = "shortest"
    """Which ready rows the actor and the reference take (``MegatronConfig.row_order``): ``shortest`` or
    ``arrival`` (the partition's ready order)."""
    ppo_epochs: int = 2
    """Optimizer steps per batch; the first streams, the others re-read the cached micro-batches."""
    reference: bool = True
    """The reference log-prob task runs (``kl_coef > 0``)."""
    prompt_len: int = 6
    """Prompt tokens per row."""
    max_new_tokens: int = 4
    """Largest response."""
    lengths: str = "constant:4"
    """Response-length distribution (module docstring)."""
    replay_sigma: float = 1.0
    """Spread of the lengths drawn around each replayed step's mean."""
    seed: int = 0
    """Seed of the length draws."""
    regenerated: Literal["redraw", "keep"] = "redraw"
    """``stream``: the lengths of a group generated again after it fell out of the staleness bound. ``redraw``: new
    ones from ``lengths`` (a new sample of the policy, as an LLM's responses to the same prompt differ); ``keep``:
    the same (a task that fixes each response's length, as ``add1_longtail`` / ``add1_heavytail`` budgets do)."""
    rollout_model: str = "chunked"
    """How an engine turns prompts into responses over time (``rollout_models.ROLLOUT_MODELS``: ``chunked``,
    ``continuous``, ``partial``; ``from_config`` picks the recipe's ``rollout.continuous`` / ``rollout.partial``)."""
    partial_kv: Literal["recompute", "keep"] = "recompute"
    """Partial rollout's KV cache at a weight swap (``rollout.partial_kv``): ``recompute`` prefills every
    in-flight response again, ``keep`` does not."""
    placement: Literal["cpu", "devices"] = "cpu"
    """``cpu``: the tiny recipes' core layout (``workflow.placement``): async puts rollout and the reference on
    core 0 and the actor on the others, sync puts everything on all cores. ``devices``: each rollout engine
    on its own devices, the reference sharing the trainer's."""
    variant: str = "1"
    """Cost-file variant (CPU: threads per heavy worker; ``from_config`` picks the mode's)."""
    warmup_steps: int = 2
    """Steps left out of the throughput (the real runs' first steps include compilation and caches)."""

    @property
    def rows_per_step(self) -> int:
        """Rows trained per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def seq_cap(self) -> int:
        """The longest row."""
        return self.prompt_len + self.max_new_tokens


def default_lengths(cfg: AsyncFlowConfig) -> str:
    """The distribution ``asyncflow train`` would generate for this config's prompt source."""
    if cfg.workflow.task == "add1_longtail":
        return "lognormal:24:1"
    if cfg.workflow.task == "add1_heavytail":
        return "lognormal:8:1.5"
    return f"constant:{cfg.rollout.max_new_tokens}"


BUDGETED_TASKS = ("add1_longtail", "add1_heavytail")
"""Prompt sources that fix each response's length (``sample_budgets``), kept when a response is generated again."""


def from_config(cfg: AsyncFlowConfig, lengths: str | None = None, prompt_len: int | None = None) -> Workload:
    """The ``Workload`` of an ``AsyncFlowConfig`` (the recipe's own settings, overrides applied)."""
    wf, tr = cfg.workflow, cfg.trainer
    if prompt_len is None:
        prompt_len = cfg.data.max_prompt_len if wf.task in ("jsonl", "parquet") else 6
    sync = wf.mode == "sync"
    if cfg.agent.loop is not None:
        from asyncflow.config_loader import ConfigError

        raise ConfigError(f"agent.loop={cfg.agent.loop!r}: multi-turn rollouts are not simulated (tool calls and "
                         "observations have no cost model); simulate the single-turn recipe with "
                         "rollout.continuous=true instead")
    from asyncflow.config_rules import stream_unit

    packing = getattr(tr, "micro_batch_tokens", 0) > 0  # the trainer's sequence packing (a token budget)
    model = "partial" if cfg.rollout.partial else "continuous" if cfg.rollout.continuous else "chunked"
    # The sample stream under a per-sample estimator moves single responses: as many one-response groups.
    unit = stream_unit(cfg)
    return Workload(
        mode=wf.mode, max_staleness=0 if sync else wf.max_staleness, steps=wf.steps,
        prompts_per_step=wf.prompts_per_step * wf.samples_per_prompt // unit, samples_per_prompt=unit,
        rollout_instances=wf.rollout_instances, rollout_chunk=wf.rollout_chunk, max_num_seqs=cfg.rollout.max_num_seqs,
        score_chunk=wf.score_chunk, micro_batch_size=tr.micro_batch_size, data_parallel=tr.data_parallel,
        fixed_shape=tr.pipeline_parallel > 1 and not packing, packing=packing, pipeline_parallel=tr.pipeline_parallel,
        devices_per_replica=tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel,
        row_order="arrival" if tr.pipeline_parallel > 1 else tr.row_order, ppo_epochs=cfg.algorithm.ppo_epochs,
        reference=cfg.algorithm.kl_coef > 0,
        prompt_len=prompt_len, max_new_tokens=cfg.rollout.max_new_tokens,
        lengths=lengths or default_lengths(cfg), seed=wf.seed,
        regenerated="keep" if wf.task in BUDGETED_TASKS and lengths is None else "redraw",
        rollout_model=model, partial_kv=cfg.rollout.partial_kv,
        placement="cpu" if cfg.ray.accelerator is None else "devices",
        variant=str(wf.sync_worker_threads if sync else wf.worker_threads) if cfg.ray.accelerator is None else "device",
    )


def _replay_means(path: str) -> list[float]:
    means = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("rollout/tokens") and rec.get("actor/rows"):
                means.append(rec["rollout/tokens"] / rec["actor/rows"])
    if not means:
        raise ValueError(f"{path}: no step records rollout/tokens and actor/rows")
    return means


def draw_lengths(w: Workload) -> list[list[int]]:
    """Response lengths of every row of every step (``w.steps`` lists of ``w.rows_per_step``)."""
    rng = np.random.default_rng(w.seed)
    kind, _, args = w.lengths.partition(":")
    rows, cap = w.rows_per_step, w.max_new_tokens
    out = []
    for step in range(w.steps):
        if kind == "constant":
            lengths = np.full(rows, float(args or cap))
        elif kind == "lognormal":
            median, sigma = (float(x) for x in args.split(":"))
            lengths = np.exp(math.log(median) + sigma * rng.standard_normal(rows))
        elif kind == "replay":
            means = _replay_means(args)
            mean = means[step % len(means)]
            # A lognormal with this mean: median = mean / exp(sigma^2 / 2).
            lengths = mean * np.exp(w.replay_sigma * rng.standard_normal(rows) - w.replay_sigma**2 / 2)
        else:
            raise ValueError(f"lengths {w.lengths!r}: use constant:N, lognormal:MEDIAN:SIGMA or replay:PATH")
        low = 1 if kind == "constant" else min(4, cap)  # the long-tail budgets are clipped to [4, max_new_tokens]
        out.append(np.clip(np.round(lengths), low, cap).astype(int).tolist())
    return out
