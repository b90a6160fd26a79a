"""``asyncflow profile [CONFIG] [section.key=value ...] --out FILE``: measure this machine's cost model.

Every number comes from the code the loop runs, in Ray actors placed like the loop's workers:

- rollout: ``VllmRollout.generate`` (the real vLLM engine, driven step by step as ``RolloutService`` does)
  over a grid of batch sizes, response lengths and prompt lengths, fitted to ``RolloutCosts``;
- trainer: ``MegatronActor.train_step`` with the loop's objective (``make_objective``) over micro-batch
  counts and sequence lengths, and ``compute_logprobs`` (the reference task's call), fitted to ``TrainCosts``;
- weights: the actor's ``weight_stager`` (``bridge.staging``) staging a version, and the rollout engine's
  ``apply_staged`` reading it from the trainer's shared-memory segment (another process, as in the loop);
- TransferQueue: the real client against a started TransferQueue, puts and gets of small and large rows;
- reward and advantage functions per row.

The result is the engine-only model: ``ServiceCosts`` (the services' overhead beyond their engine calls) stay at
their defaults. ``bench/calibrate.py`` fits them on the CPU machine from real runs of the loop.

Variants (``CostFile.variants``): on CPU, ``1`` (each worker pinned to its own core, as ``async`` places
them) and ``2`` (each worker on both cores, as ``sync``); on a GPU node, ``device`` (one GPU each, TP 1).
The variants' probes run at once and take turns, grid point by grid point (``_variants``). The tiny CPU model
takes a few minutes; a progress bar shows each measurement.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from asyncflow.config import AsyncFlowConfig, replace
from asyncflow.simulator.costs import (
    CostFile,
    CostModel,
    LightCosts,
    QueueCosts,
    RolloutCosts,
    TrainCosts,
    WeightSyncCosts,
    fit,
)

ROLLOUT_GRID = [(b, length, p) for b in (1, 8, 32, 128) for length in (4, 16, 64) for p in (6, 30)]
"""(batch, response tokens, prompt tokens) of each timed ``generate`` call: from a short answer's 4 tokens, where
the cost per request outweighs the decode steps, to a long one's 64. Without the short calls the fit's split
between per-request, prefill and per-step costs is free to land anywhere that matches the longer calls."""
TRAIN_GRID = [(n, s) for n in (1, 4) for s in (8, 16, 32, 64, 136)]
"""(micro-batches, sequence length) of each timed ``train_step``: from a short answer's 8-16 tokens to a long
one's 136, so no workload's micro-batches fall outside the fitted range."""
REF_GRID = [(rows, s) for rows in (8, 32) for s in (8, 16, 64, 136)]
"""(rows, sequence length) of each timed ``compute_logprobs``."""
QUICK_GRIDS = ([(b, length, p) for b in (1, 32) for length in (8, 32) for p in (6, 30)],
               [(n, s) for n in (1, 2) for s in (16, 64, 136)], [(rows, s) for rows in (8, 32) for s in (16, 64, 136)])
"""A smaller grid (tests, a first look): fewer points, the same fits."""



def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class RolloutProbe:
    """A Ray actor around the real vLLM rollout engine."""

    def __init__(self, vllm_cfg, model_dir: str, threads: int, cpus: list[int] | None):
        if cpus:  # as RolloutService: pin, and bind vLLM's OpenMP threads to these cores
            os.sched_setaffinity(0, cpus)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
        torch.set_num_threads(threads)
        from asyncflow.engines.vllm.rollout import VllmRollout

        self.engine = VllmRollout(vllm_cfg, model_dir)

    def generate(self, batch: int, length: int, prompt: int, reps: int) -> float:
        """Median seconds of ``generate`` for ``batch`` prompts of ``prompt`` tokens, ``length`` tokens each."""
        gen = torch.Generator().manual_seed(batch * 1000 + length + prompt)
        prompts = [torch.randint(4, 14, (prompt,), generator=gen).tolist() for _ in range(batch)]
        # Distinct prompts and a reset prefix cache: GRPO groups share prefixes, but prefill is what is timed.
        return _median_time(lambda: (self.engine.llm.reset_prefix_cache(),
                                     self.engine.generate(prompts, max_new_tokens=[length] * batch, ignore_eos=True)),
                            reps)

    def apply(self, staging: dict, version: int) -> tuple[float, float]:
        """Seconds and bytes per rank of ``apply_staged`` (the loop's path)."""
        t0 = time.perf_counter()
        stats = self.engine.apply_staged(staging, version)
        return time.perf_counter() - t0, float(max(stats["bytes_per_rank"]))

    def close(self) -> None:
        """Stop the engine."""
        self.engine.close()


class TrainerProbe:
    """A Ray actor around the real Megatron actor engine (a world of one rank)."""

    def __init__(self, megatron_cfg, algo, model_dir: str, max_new_tokens: int, threads: int, cpus: list[int] | None):
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        from asyncflow.algorithms.objective import make_objective
        from asyncflow.engines.base import make_train_engine

        self.engine = make_train_engine(megatron_cfg.engine, megatron_cfg, model_dir)
        self.loss_fn = make_objective(algo, max_new_tokens)
        self.mbs = megatron_cfg.micro_batch_size
        self.vocab = self.engine.arch.vocab_size
        self.stager, self.plan = self.engine.weight_stager(512.0, f"prof{os.getpid()}")
        self.version = 0

    def _micro_batch(self, seq: int, prompt: int = 6) -> dict:
        """What ``batching.to_micro_batch`` makes of ``mbs`` rows of ``seq`` tokens (random ids)."""
        tokens = torch.randint(4, self.vocab, (self.mbs, seq))
        mask = torch.zeros(self.mbs, seq - 1)
        mask[:, prompt - 1:] = 1.0
        return {"tokens": tokens, "mask": mask, "advantages": torch.randn(self.mbs, 1) * mask,
                "behaviour_logprobs": -torch.rand(self.mbs, seq - 1) * mask, "ref_logprobs": -torch.rand(
                    self.mbs, seq - 1) * mask, "lag": torch.zeros(self.mbs, dtype=torch.long)}

    def train(self, micro: int, seq: int, reps: int) -> float:
        """Median seconds of one ``train_step`` over ``micro`` micro-batches of ``seq`` tokens."""
        batches = [self._micro_batch(seq) for _ in range(micro)]
        return _median_time(lambda: self.engine.train_step(iter(batches), micro, self.loss_fn), reps)

    def reference(self, rows: int, seq: int, reps: int) -> float:
        """Median seconds of ``compute_logprobs`` over ``rows`` rows of ``seq`` tokens."""
        tokens = torch.randint(4, self.vocab, (rows, seq))
        return _median_time(lambda: self.engine.compute_logprobs(tokens), reps)

    def stage(self) -> tuple[float, float, dict, int]:
        """Seconds and bytes of staging the next version, the staging description for a reader, the version."""
        from asyncflow.bridge.staging import source_key

        self.version += 1
        stats = self.stager.stage(self.version)
        staging = {"plan": self.plan, "segments": {source_key(self.stager.rank): self.stager.segment}}
        return stats.seconds, float(stats.bytes), staging, self.version

    def close(self) -> None:
        """Remove the staging segment."""
        self.stager.close()


def _queue_costs(cfg: AsyncFlowConfig, reps: int) -> tuple[QueueCosts, list]:
    """Put + get round trips of the real client, small and large rows, fitted per request and per byte."""
    from asyncflow import transfer_queue

    samples = []
    with transfer_queue.start(cfg.transfer_queue) as tq:
        client = tq.client()
        try:
            for i, (rows, width) in enumerate([(1, 8), (16, 8), (16, 4096), (64, 16384)]):
                part = f"profile-{i}"
                client.create_partition(part, consumers=["probe"], expected_rows=rows * reps, auto_clear=True)
                payload = [torch.randn(width) for _ in range(rows)]
                nbytes = rows * width * 4
                t0 = time.perf_counter()
                for _ in range(reps):
                    client.put(part, {"x": payload})
                    client.get(part, "probe", ["x"], rows, timeout=30)
                seconds = (time.perf_counter() - t0) / reps / 2  # one put and one get
                samples.append({"rows": rows, "bytes": nbytes, "seconds": seconds})
        finally:
            client.close()
    per_request, per_byte = fit([[1.0, s["bytes"]] for s in samples], [s["seconds"] for s in samples])
    return QueueCosts(per_request_s=per_request, per_byte_s=per_byte), samples


def _light_costs(cfg: AsyncFlowConfig, model_dir: str) -> LightCosts:
    """The reward function and the advantage estimator per row, in this process."""
    from transformers import AutoTokenizer

    from asyncflow.algorithms import compute_advantages
    from asyncflow.rewards import RewardRow, RewardScorer, make_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scorer = RewardScorer(make_reward_fn(cfg.algorithm.reward, tokenizer, cfg.reward), tokenizer, cfg.reward)
    prompt, response = [2, 7, 8, 9, 10, 18], [8, 9, 10, 11]
    rows = 256
    per_reward = _median_time(lambda: scorer.score([RewardRow(prompt, response)] * rows), 3) / rows
    rewards, groups = torch.rand(rows), torch.arange(rows) // cfg.workflow.samples_per_prompt
    per_adv = _median_time(lambda: compute_advantages(cfg.algorithm.advantage, rewards, groups), 3) / rows
    return LightCosts(reward_per_row_s=per_reward, advantage_per_row_s=per_adv)


class _Probes:
    """One variant's rollout probe and trainer probe (Ray actors), placed as the mode places the loop's workers."""

    def __init__(self, cfg: AsyncFlowConfig, model_dir: str, name: str, grids):
        import ray

        device = name == "device"
        threads = 1 if device else int(name)
        cores = os.cpu_count() or 2
        # async (1 thread): rollout on core 0, the trainer on core 1; sync (2 threads): both on every core.
        rollout_cpus, trainer_cpus = (None, None) if device else (
            ([0], [1 % cores]) if threads == 1 else (list(range(threads)), list(range(threads))))
        max_len = max(p + length for _, length, p in grids[0]) + 8
        vllm_cfg = replace(cfg.rollout, max_model_len=max(cfg.rollout.max_model_len, max_len),
                           max_num_seqs=max(cfg.rollout.max_num_seqs, 128), in_process=True, tensor_parallel=1)
        gpu = {"num_gpus": 1} if device else {}
        self.rollout = ray.remote(RolloutProbe).options(num_cpus=0, **gpu).remote(vllm_cfg, model_dir, threads,
                                                                                  rollout_cpus)
        self.trainer = ray.remote(TrainerProbe).options(num_cpus=0, **gpu).remote(
            replace(cfg.trainer, tensor_parallel=1, pipeline_parallel=1, data_parallel=1), cfg.algorithm, model_dir,
            cfg.rollout.max_new_tokens, threads, trainer_cpus)
        self.samples: dict[str, list] = {"rollout": [], "train": [], "reference": [], "stage": [], "apply": []}
        self.closed = False

    def warm_up(self) -> list:
        """Refs of a first call of each engine (first calls compile)."""
        return [self.rollout.generate.remote(8, 8, 6, 1), self.trainer.train.remote(1, 16, 1)]

    def measure(self, kind: str, point: tuple, reps: int) -> None:
        """Time one grid point of ``kind`` (``rollout``, ``train``, ``reference``) and keep the sample."""
        import ray

        if kind == "rollout":
            b, length, p = point
            sample = {"batch": b, "length": length, "prompt": p,
                      "seconds": ray.get(self.rollout.generate.remote(b, length, p, reps))}
        elif kind == "train":
            n, seq = point
            sample = {"micro": n, "seq": seq, "seconds": ray.get(self.trainer.train.remote(n, seq, reps))}
        else:
            rows, seq = point
            sample = {"rows": rows, "seq": seq, "seconds": ray.get(self.trainer.reference.remote(rows, seq, reps))}
        self.samples[kind].append(sample)

    def weights(self, reps: int) -> None:
        """Stage versions on the trainer and apply each on the rollout engine (the loop's path), timed; the first
        version is not kept: a fresh engine's first apply takes a few times the others, and in the loop it falls
        in the warm-up steps the cost model leaves out."""
        import ray

        for i in range(max(reps, 3) + 1):
            seconds, nbytes, staging, version = ray.get(self.trainer.stage.remote())
            applied, read = ray.get(self.rollout.apply.remote(staging, version))
            if i == 0:
                continue
            self.samples["stage"].append({"bytes": nbytes, "seconds": seconds})
            self.samples["apply"].append({"bytes": read, "seconds": applied})

    def close(self) -> None:
        """Stop both engines and their actors (once)."""
        import ray

        if self.closed:
            return
        self.closed = True
        for probe in (self.trainer, self.rollout):
            try:
                ray.get(probe.close.remote(), timeout=60)
            except Exception:  # a probe that died: killing it is all that is left
                pass
            ray.kill(probe)


POINT_LABELS = {"rollout": "vLLM generate {0} x {1} tokens", "train": "Megatron train_step {0} x {1}",
                "reference": "reference logprobs {0} x {1}"}


def _variants(cfg: AsyncFlowConfig, model_dir: str, names: list[str], reps: int, bar, grids) -> dict[str, _Probes]:
    """Measure every variant, interleaved: each grid point is timed on every variant before the next point.

    The variants' probes are all started at once and take turns, so a spell of other load on a shared machine
    slows every variant alike (measured one after the other, such a spell lands in one variant only, and in the
    ratios between modes predicted from different variants). An idle probe blocks in Ray, not in a spin."""
    import ray

    probes = {}
    try:
        for name in names:
            probes[name] = _Probes(cfg, model_dir, name, grids)
        ray.get([ref for p in probes.values() for ref in p.warm_up()])
        for kind, grid in zip(("rollout", "train", "reference"), grids):
            for point in grid:
                for name, p in probes.items():
                    bar.set_postfix_str(f"{name}: " + POINT_LABELS[kind].format(*point))
                    p.measure(kind, point, reps)
                    bar.update()
        # Each variant's weights with the variants before it stopped: idle probes of other variants slow an apply.
        for name, p in probes.items():
            bar.set_postfix_str(f"{name}: stage + apply weights")
            p.weights(reps)
            p.close()
            bar.update()
    finally:
        for p in probes.values():
            p.close()
    return probes


FIT_MISS_WARNING = 0.5
"""A fitted cost that misses one of its own profiled calls by more than this (relative) is reported: another job
that slows some of the calls makes the fit collapse (e.g. to a constant per step) and mispredict every run."""


def _fit_group(features: list[list[float]], seconds: list[float]) -> tuple[list[float], float]:
    """``fit`` plus the largest relative miss of the fitted costs on the samples they were fitted to."""
    coef = fit(features, seconds)
    predicted = np.asarray(features, dtype=float) @ np.asarray(coef)
    y = np.asarray(seconds, dtype=float)
    return coef, float(np.max(np.abs(predicted - y) / np.maximum(y, 1e-12)))


def _fit_variant(samples: dict, mbs: int) -> tuple[CostModel, dict[str, float]]:
    """Least-squares costs of one variant's samples (features as ``rollout_models.Engine`` sums them), and the
    largest relative miss of each fit on its own samples (``FIT_MISS_WARNING``)."""
    feats = [[s["length"], s["batch"] * s["length"],
              s["batch"] * (s["length"] * s["prompt"] + s["length"] * (s["length"] - 1) / 2),
              s["batch"] * s["prompt"], s["batch"]] for s in samples["rollout"]]
    (step, per_seq, per_ctx, prefill, per_req), rollout_miss = _fit_group(
        feats, [s["seconds"] for s in samples["rollout"]])
    # The engine charges per_seq on the prefill step as well: B x L sequence-steps in all, as fitted.
    (per_micro, per_token, per_token_seq, opt), train_miss = _fit_group(
        [[s["micro"], s["micro"] * mbs * s["seq"], s["micro"] * mbs * s["seq"] ** 2, 1.0] for s in samples["train"]],
        [s["seconds"] for s in samples["train"]])
    (ref_call, ref_token, ref_token_seq), ref_miss = _fit_group(
        [[1.0, s["rows"] * s["seq"], s["rows"] * s["seq"] ** 2] for s in samples["reference"]],
        [s["seconds"] for s in samples["reference"]])
    misses = {"rollout": rollout_miss, "train": train_miss, "reference": ref_miss}
    stage = statistics.median(s["seconds"] for s in samples["stage"])
    apply = statistics.median(s["seconds"] for s in samples["apply"])
    nbytes = samples["stage"][0]["bytes"]
    return CostModel(
        rollout=RolloutCosts(step_s=step, per_seq_s=per_seq, per_ctx_token_s=per_ctx, prefill_per_token_s=prefill,
                             per_request_s=per_req),
        # One sample size only: the whole measured time is charged per byte (no fixed term is separable).
        train=TrainCosts(per_micro_s=per_micro, per_token_s=per_token, per_token_seq_s=per_token_seq, optimizer_s=opt,
                         ref_per_call_s=ref_call, ref_per_token_s=ref_token, ref_per_token_seq_s=ref_token_seq),
        weight_sync=WeightSyncCosts(stage_per_byte_s=stage / nbytes, apply_per_byte_s=apply / nbytes),
        weight_bytes=nbytes,
    ), misses


def profile(cfg: AsyncFlowConfig, out: str | Path, variants: list[str] | None = None, reps: int = 5,
            quick: bool = False) -> CostFile:
    """Measure every variant (default ``device`` on a GPU node, else ``1`` and ``2``), interleaved grid point by
    grid point (``_variants``), and write the cost file to ``out``; returns it (``quick``: ``QUICK_GRIDS``)."""
    import ray
    from tqdm import tqdm

    from asyncflow.tiny_model import ensure_model
    from asyncflow.workflow.pipeline import connect_ray

    model_dir = str(ensure_model(cfg.model))
    if variants is None:
        variants = ["device"] if torch.cuda.is_available() else ["1", "2"]
    load_before = os.getloadavg()
    t0 = time.time()
    connect_ray(cfg)
    models, samples, fit_misses = {}, {}, {}
    grids = QUICK_GRIDS if quick else (ROLLOUT_GRID, TRAIN_GRID, REF_GRID)
    total = len(variants) * (sum(len(g) for g in grids) + 1) + 1
    try:
        with tqdm(total=total, desc="asyncflow profile", unit="probe") as bar:
            queue, queue_samples = _queue_costs(cfg, reps=20)
            light = _light_costs(cfg, model_dir)
            bar.update()
            probes = _variants(cfg, model_dir, variants, reps, bar, grids)
            for name in variants:
                samples[name] = probes[name].samples
                models[name], fit_misses[name] = _fit_variant(samples[name], cfg.trainer.micro_batch_size)
                for group, miss in fit_misses[name].items():
                    if miss > FIT_MISS_WARNING:
                        bar.write(f"asyncflow profile: WARNING variant {name}: the fitted {group} costs miss one of "
                                  f"its profiled calls by {miss:.0%}; another job on this machine may have slowed "
                                  "some calls (see samples in the cost file): profile again on a quiet machine")
                models[name].queue, models[name].light = queue, light
            samples["queue"] = queue_samples
    finally:
        ray.shutdown()
    from asyncflow.models.arch import GPTArch

    arch = GPTArch.from_pretrained(model_dir)
    hardware = {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "torch": torch.__version__, "model": model_dir, "hidden": arch.hidden_size, "layers": arch.num_layers,
                "vocab": arch.vocab_size, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": time.time() - t0, "grid": "quick" if quick else "full",
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "worst_fit_miss": fit_misses}
    costs = CostFile(models, hardware, samples)
    costs.save(out)
    return costs
