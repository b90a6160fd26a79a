"""The trained-model services: reference logprobs, the actor update and the critic, one Ray actor per rank.

A worker group of ``TP x PP x DP`` ranks forms one process group, which the engine joins
(``asyncflow.engines.base.TrainableEngine``). Every rank streams from the TransferQueue with its
data-parallel rank and its model-parallel rank (``engine.ranks``), so all TP/PP ranks of one data-parallel
replica receive the same rows and different replicas receive different rows. Only each replica's writer
rank (last pipeline stage, first tensor-parallel rank) writes results back; only replica 0's reports metrics.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from asyncflow.config import AlgorithmConfig, CriticConfig, MegatronConfig, MegatronEngineConfig
from asyncflow.observability.logprob_gap import gap_stats
from asyncflow.workflow.batching import (
    ACTOR_FIELDS,
    fit_seq_len,
    merge_batches,
    pack_tokens,
    plan_micro_batches,
    response_slices,
    row_tokens,
    split_to_count,
    to_critic_micro_batch,
    to_micro_batch,
)
from asyncflow.workflow.partitions import partition_name
from asyncflow.workflow.services import TaskService


class TrainerService(TaskService):
    """A rank of a trained model's worker group; its engine joins the group and knows its DP/MP position."""

    checkpoint: dict | None = None
    """Where and when the group writes its part of run checkpoints; None for groups without training state."""

    def __init__(self, megatron_cfg: MegatronEngineConfig, model_dir: str, seq_len: int, rank: int = 0,
                 world_size: int = 1, master_port: int = 0, master_addr: str = "127.0.0.1",
                 share_device: bool = False, **kw):
        """``share_device``: colocated ``sync`` on devices: the engine's state leaves the device between this
        group's phases (``release_device``) and comes back for the next one."""
        self.share_device = share_device
        if world_size > 1:  # torch.distributed rendezvous of the worker group at its rank 0's node
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                              MASTER_PORT=str(master_port))
        super().__init__(worker=rank, **kw)
        # The engine joins its group with the run's step timeout: a rank may stay away from the group's next
        # collective for a whole step.
        self.engine = self.make_engine(megatron_cfg, model_dir)
        self.seq_len, self.pad_id = seq_len, 0
        self.fixed_shape = self.engine.fixed_seq_len
        self.multiple = self.engine.seq_multiple  # micro-batch widths round up to it (the kernels' alignment)
        self.token_budget = megatron_cfg.micro_batch_tokens  # 0: micro-batches of micro_batch_size rows
        self.moved = [0, 0]  # real and padded tokens through the engine since the last report
        # Rows of like length in one micro-batch (``row_order``); fixed shapes pad to the cap anyway.
        self.sampler = "shortest" if megatron_cfg.row_order == "shortest" and not self.fixed_shape else "sequential"
        self.ranks = self.engine.ranks
        self._fingerprints: list[torch.Tensor] = []
        self.reporter = self.ranks.writer and self.ranks.dp_rank == 0

    def where(self) -> dict:
        """``TaskService.where`` and the timeout this rank's process group was created with (the run's
        ``workflow.step_timeout_s``; None where the backend does not say)."""
        return {**super().where(), "group_timeout_s": self.engine.group_timeout_s()}

    def acquire_device(self) -> None:
        """Copy parameters and optimizer state back to the device (colocated ``sync`` on devices)."""
        if self.share_device:
            with self.timeline.span(self.name, "onload", self.worker):
                self.engine.onload()

    def release_device(self) -> int:
        """Move parameters and optimizer state to host memory and free the gradient buffers (colocated ``sync``
        on devices; on the CPU stack it runs too, which tests the path, though host memory is the device)."""
        if not self.share_device:
            return 0
        with self.timeline.span(self.name, "offload", self.worker):
            return self.engine.offload()

    def restore(self, resume_dir: str | None, version: int) -> None:
        """Load this group's part of a run checkpoint (model and optimizer) and continue at ``version``."""
        if resume_dir is not None:
            with self.timeline.span(self.name, "load_checkpoint", self.worker):
                self.engine.load(str(Path(resume_dir) / self.name))
            self.engine.version = version

    def run(self, first: int, last: int) -> int:
        """``TaskService.run``; a group that holds training state (a run checkpoint dict) asks the board before each
        step whether the run stops at that step's boundary (a signal, ``workflow.signals``), and then saves its
        part of the checkpoint there (unless the run trained nothing yet) and returns the step it stopped at."""
        import ray

        for step in range(first, last):
            if self.checkpoint is not None:
                stop = ray.get(self.board.trainer_begin.remote(step))
                if stop is not None:
                    if stop["save"] and step > first:
                        self.stop_save(step)
                    ray.get(self.board.trainer_stopped.remote())
                    return step
            self.post(self.run_step(step))
        return last

    def stop_save(self, trained: int) -> bool:
        """The run stops once ``trained`` steps are done: write this group's part of the checkpoint there, unless
        the periodic one of that step was written already (collective over the group)."""
        from asyncflow.workflow.resume import ask_due, staging_path

        cp = self.checkpoint
        if cp is None or ask_due(cp, self.board, trained):
            return False
        with self.timeline.span(self.name, "save_checkpoint", self.worker, step=trained):
            self.engine.save(str(staging_path(cp["root"], trained) / self.name))
        return True

    def maybe_save(self, step: int, checkpoint: dict | None) -> bool:
        """After the update of ``step``: write this group's part of the run checkpoint when one is due
        (collective over the group; the driver commits the folder once every group has reported)."""
        from asyncflow.workflow.resume import ask_due, staging_path

        trained = step + 1
        if not ask_due(checkpoint, self.board, trained):
            return False
        with self.timeline.span(self.name, "save_checkpoint", self.worker, step=trained):
            self.engine.save(str(staging_path(checkpoint["root"], trained) / self.name))
        return True

    def make_engine(self, megatron_cfg: MegatronConfig, model_dir: str):
        """This group's engine (a policy by default; the critic overrides it)."""
        from asyncflow.engines.base import make_train_engine

        return make_train_engine(megatron_cfg.engine, megatron_cfg, model_dir, group_timeout_s=self.timeout_s)

    def stream(self, step: int, fields: list[str], batch_size: int, **kwargs):
        """This rank's share: the same rows for every TP/PP rank of a replica, distinct across replicas.

        Under model parallelism each batch's fingerprint is kept for ``verify_same_rows``.
        """
        kwargs.setdefault("sampler", self.sampler)
        r = self.ranks
        batches = super().stream(step, fields, batch_size, dp_rank=r.dp_rank, dp_size=r.dp_size,
                                 mp_rank=r.mp_rank, mp_size=r.mp_size, **kwargs)
        for batch in batches:
            if r.mp_size > 1:
                self._fingerprints.append(batch_fingerprint(batch))
            yield batch

    def verify_same_rows(self, step: int) -> None:
        """Raise unless every model-parallel rank of this replica read the same batches since the last call.

        Collective over the model-parallel group, called once a pass is over (not inside the pipeline
        schedule, where stages pull micro-batches at different times).
        """
        mine, self._fingerprints = self._fingerprints, []
        if self.ranks.mp_size > 1:
            self.engine.check_same_rows(mine, f"step {step} of {self.name}")

    def forward_pass(self, step: int, fields: list[str], chunk: int, out_field: str, forward,
                     task: str | None = None) -> None:
        """``forward(tokens) -> [b, s-1]`` over the rows of ``step`` as they become ready; the writer rank puts
        each row's response-token slice into ``out_field`` (reference logprobs, critic values)."""
        for batch in self.stream(step, fields, chunk, task=task):
            with self.timeline.span(task or self.name, out_field, self.worker, rows=len(batch)) as span:
                prompts, responses = batch["prompt_ids"], batch["response_ids"]
                lengths = row_tokens(prompts, responses)
                plan = plan_micro_batches(lengths, self.token_budget, self.seq_len, self.multiple) \
                    if self.token_budget else [list(range(len(batch)))]
                slices: list = [None] * len(batch)
                t0 = time.perf_counter()
                for rows in plan:  # packing: one forward per micro-batch of the plan, each as wide as its rows
                    p, r = [prompts[i] for i in rows], [responses[i] for i in rows]
                    tokens, _ = pack_tokens(p, r, self.seq_len_for(p, r), self.pad_id)
                    self.count_moved(row_tokens(p, r), tokens.numel())
                    out = forward(tokens)
                    if self.ranks.writer:
                        for i, piece in zip(rows, response_slices(out, p, r)):
                            slices[i] = piece
                span["engine_s"] = time.perf_counter() - t0  # the forwards alone (``bench/calibrate.py``)
                if self.ranks.writer:
                    self.tq.put(partition_name(step), {out_field: slices}, indexes=batch.indexes)
        self.verify_same_rows(step)

    def count_moved(self, real: list[int], padded: int) -> None:
        """Add a micro-batch's real row tokens and the padded tokens the engine computes on."""
        self.moved[0] += sum(real)
        self.moved[1] += padded

    def moved_metrics(self, prefix: str) -> dict:
        """``<prefix>/padded_tokens_ratio`` (tokens the engine computed on / real tokens) and the real tokens of
        this replica since the last call, then the counter restarts."""
        (real, padded), self.moved = self.moved, [0, 0]
        return {f"{prefix}/real_tokens": float(real), f"{prefix}/padded_tokens_ratio": padded / max(real, 1)}

    def packed_micro_batches(self, step: int, fields: list[str], build, rows: int, task: str | None = None
                             ) -> tuple[list[dict], list[int]]:
        """Packing: this replica's ``rows`` of ``step`` read whole, grouped by ``micro_batch_tokens`` and built by
        ``build(batch)``, as many micro-batches as the replica with most (so every replica's schedule has the
        same length); also the group id of every row, in micro-batch order.

        The TransferQueue's ``token_balanced`` sampler deals the step's rows out to the replicas, equal row
        counts with token counts as equal as its greedy split allows. ``rows`` is a replica's share rounded up
        (``packed_share``): when the data-parallel size does not divide the step's rows, the joint request is for
        more rows than the step has, so it is answered once the partition is complete, and the shares differ by one
        row. The loss needs no correction for that: the engine divides the summed loss by the count over every
        replica (``train_step``'s ``normalizer``)."""
        batches = list(self.stream(step, fields, rows, task=task, allow_partial=False, sampler="token_balanced"))
        if not batches:
            return [], []
        merged = merge_batches(batches)
        lengths = row_tokens(merged["prompt_ids"], merged["response_ids"])
        plan = plan_micro_batches(lengths, self.token_budget, self.seq_len, self.multiple)
        plan = split_to_count(plan, max(self.engine.gather_data_parallel([len(plan)])))
        micro = [build(merged.select(rows)) for rows in plan]
        for rows, mb in zip(plan, micro):
            self.count_moved([lengths[i] for i in rows], mb["tokens"].numel())
        return micro, [merged.meta.group_ids[i] for rows in plan for i in rows]

    def packed_share(self, rows_per_step: int) -> int:
        """The rows a replica asks for when it packs: its share of the step, rounded up."""
        return -(-rows_per_step // self.ranks.dp_size)

    def seq_len_for(self, prompts, responses) -> int:
        """Micro-batch width: fixed under pipeline parallelism, the longest row otherwise."""
        return self.seq_len if self.fixed_shape else fit_seq_len(prompts, responses, self.seq_len, self.multiple)


def batch_fingerprint(batch) -> torch.Tensor:
    """``[rows, index sum, token checksum]`` of a batch's rows and token ids (int64)."""
    total = 0
    for name in ("prompt_ids", "response_ids"):
        if name in batch:
            for i, ids in enumerate(batch[name]):
                ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
                weights = torch.arange(1, ids.numel() + 1, dtype=torch.long)
                total = (total * 1_000_003 + (i + 1) * int(((ids + 1) * weights).sum())) % (1 << 61)
    return torch.tensor([len(batch.indexes), sum(batch.indexes), total], dtype=torch.long)


class ReferenceService(TrainerService):
    """Log-probabilities of the frozen reference policy (forward only).

    Frozen, so stateless: when the group is one rank, a rank whose process dies is started again in place and loads
    the initial weights, which are the reference's (``supervisor.restartable``); the rows it held are read again.
    The death of a rank of a larger group restarts the run from its checkpoint (``workflow.loop.train``)."""

    name = "reference"

    def __init__(self, chunk: int, after_advantage: bool = False, **kw):
        super().__init__(**kw)
        self.chunk = chunk
        # Dynamic sampling: score only the rows the advantage task kept (dropped groups never reach here).
        self.fields = ["prompt_ids", "response_ids"] + (["advantages"] if after_advantage else [])

    def make_engine(self, megatron_cfg: MegatronConfig, model_dir: str):
        """A frozen policy (weights only); with ``reference_placement: offload`` its weights stay in host
        memory and stream to the device layer by layer."""
        from asyncflow.engines.base import make_train_engine

        engine = make_train_engine(megatron_cfg.engine, megatron_cfg, model_dir, trainable=False,
                                   group_timeout_s=self.timeout_s)
        if megatron_cfg.reference_placement == "offload":
            engine.stream_weights_from_host()
        return engine

    def run_step(self, step: int) -> dict | None:
        self.forward_pass(step, self.fields, self.chunk, "ref_logprobs", self.engine.compute_logprobs)
        metrics = self.moved_metrics("reference")
        return self.report(step, metrics) if self.reporter else None


class ActorService(TrainerService):
    """Policy update; the first pass streams micro-batches straight from the TransferQueue."""

    name = "actor"

    def __init__(self, algo: AlgorithmConfig, rows_per_step: int, max_new_tokens: int, checkpoint: dict | None = None,
                 resume_dir: str | None = None, start_version: int = 0, bucket_mb: float = 512.0,
                 staging_session: str = "run", relay: dict | None = None, loss_mask: bool = False,
                 token_versions: bool = False, **kw):
        super().__init__(**kw)
        from asyncflow.algorithms.objective import make_objective

        self.checkpoint = checkpoint
        self.restore(resume_dir, start_version)
        # The loop's weight path: this rank's staging writer over its live shards (None if it sends nothing).
        self.stager, self.plan = self.engine.weight_stager(bucket_mb, staging_session)
        self.relay, self.domain, self.routes = None, None, {}
        if self.stager is not None:
            import ray

            from asyncflow.bridge import routes
            from asyncflow.bridge.staging import source_key

            sources = sorted({source_key(src) for b in self.stager.plan.buckets for src in b.sources})
            host, remote = routes.LOCAL, []
            if relay is not None:  # decided per rollout host: same host reads the segment, others the relay
                host = routes.host_key(relay["transport"], ray.get_runtime_context().get_node_id(), "trainer")
                remote = routes.remote_hosts(host, relay["rollout_hosts"])
            self.domain = host if relay is None or host in relay["rollout_hosts"] else None
            ray.get(self.board.set_plan.remote(self.plan, sources, {source_key(self.stager.rank): host}))
            if remote:  # a thread broadcasts each staged version to one receiver per remote rollout host
                from asyncflow.bridge.relay import RelaySender

                self.relay = RelaySender(self.stager, relay, len(remote))
            self.routes = {"host": host, "source": source_key(self.stager.rank), "sends_to": remote,
                           "buffer_bytes": 0 if self.relay is None else self.relay.buffer_bytes}
        self.stage_stats: dict = {}

        self.algo = algo
        self.mbs = self.engine.micro_batch_size
        self.num_micro = rows_per_step // (self.mbs * self.ranks.dp_size)  # without packing (it divides then)
        self.share = self.packed_share(rows_per_step)
        self.loss_fn = make_objective(algo, max_new_tokens)
        self.max_new_tokens = max_new_tokens
        self.fields = ACTOR_FIELDS + (["ref_logprobs"] if algo.kl_coef > 0 and algo.kl_mode == "loss" else []) + \
            (["loss_mask"] if loss_mask else []) + \
            (["token_versions"] if token_versions else [])  # partial rollout: the version of every token
        self.publish()  # version 0: the weights rollout starts from

    def publish(self) -> None:
        """Stage the current weights as ``engine.version`` and announce them on the board (exporting ranks).

        Each exporting rank copies its own pieces into its shared-memory slot and goes back to training: it
        never waits for rollout, which applies the newest complete version when it admits a step
        (``asyncflow.bridge.staging``). Nothing is gathered and nothing goes through Ray's object store.
        """
        import ray

        from asyncflow.bridge.staging import source_key

        if self.stager is None:
            return
        version = self.engine.version
        with self.timeline.span(self.name, "stage_weights", self.worker, version=version):
            stats = self.stager.stage(version)
            if self.relay is not None:
                self.relay.notify(version)  # returns at once; the receivers announce the version
            if self.domain is not None:  # rollout instances on this host read the segment itself
                ray.get(self.board.publish.remote(version, source_key(self.stager.rank), self.stager.segment,
                                                  self.domain))
        self.stage_stats = {"weights/stage_s": stats.seconds, "weights/staged_mb": stats.bytes / 2**20}

    def relay_state(self) -> dict:
        """This rank's part of the weight path: its host key, the rollout hosts it relays to, its relay
        buffer's bytes, the bytes it broadcast so far and its relay group's generation and members (the indices of
        the hosts it sends to now; empty on ranks that export nothing)."""
        relay = self.relay
        return {**self.routes, **({"relay_sent_bytes": relay.sent_bytes, "relay_generation": relay.generation,
                                   "relay_members": list(relay.members)} if relay is not None else {})}

    def shutdown(self) -> None:
        """Remove this rank's staging segment too."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        super().shutdown()

    def run_step(self, step: int) -> dict | None:
        cache: list[dict] = []
        groups: list[int] = []
        version = self.engine.version

        reads = [0.0]  # seconds the engine waited on the stream (TransferQueue gets, packing)
        lengths: list[int] = []  # response tokens of every row, in the order of ``groups``

        def build(batch):
            lengths.extend(len(r) for r in batch["response_ids"])
            return to_micro_batch(batch, self.seq_len, self.pad_id, version, self.fixed_shape, self.multiple)

        def first_pass():
            batches = iter(self.stream(step, self.fields, self.mbs, allow_partial=False))
            while True:
                t = time.perf_counter()
                batch = next(batches, None)
                if batch is not None:
                    groups.extend(batch.meta.group_ids)
                    mb = build(batch)
                    self.count_moved(row_tokens(batch["prompt_ids"], batch["response_ids"]), mb["tokens"].numel())
                    cache.append(mb)
                reads[0] += time.perf_counter() - t
                if batch is None:
                    return
                yield mb

        t0 = time.time()
        if self.token_budget:  # the step's rows are read whole, then grouped by length
            t = time.perf_counter()
            cache[:], groups[:] = self.packed_micro_batches(step, self.fields, build, self.share)
            reads[0] += time.perf_counter() - t
            num_micro, passes = len(cache), iter(list(cache))
        else:  # streamed: the first pass trains on micro-batches as they arrive
            num_micro, passes = self.num_micro, first_pass()
        with self.timeline.span(self.name, "train", self.worker, step=step) as span:
            t1 = time.perf_counter()
            results = [self.engine.train_step(passes, num_micro, self.loss_fn)]
            for mb, out in zip(cache, results[0]["micro"]):
                mb["old_logprobs"] = out["old_logprobs"]  # the proximal policy of this step
            for _ in range(self.algo.ppo_epochs - 1):
                results.append(self.engine.train_step(iter(cache), num_micro, self.loss_fn))
            # Forward, backward and the optimizer, without the reads (``bench/calibrate.py``).
            span["engine_s"] = time.perf_counter() - t1 - reads[0]
        self.verify_same_rows(step)
        self.engine.version += 1
        self.publish()
        saved = self.maybe_save(step, self.checkpoint)
        # One gather: each replica's rows as one item, so their counts (packed: they may differ by one) show too.
        parts = self.engine.gather_data_parallel([list(zip(groups, lengths))])
        rows, shares = [row for part in parts for row in part], [len(part) for part in parts]
        all_groups = [g for g, _ in rows]
        moved = self.moved_metrics("actor")
        if not self.reporter:
            return None
        # The GRPO group of every trained row: lets the driver prove each prompt was trained exactly once.
        metrics = {**_actor_metrics(results, cache, time.time() - t0), **self.stage_stats}
        metrics["actor/rows"] = float(len(all_groups))  # every replica's rows, not only this one's
        metrics["actor/replica_rows_min"], metrics["actor/replica_rows_max"] = float(min(shares)), float(max(shares))
        metrics["actor/checkpoint_saved"] = float(saved)
        metrics["actor/flat_groups"] = float(_flat_groups(cache, groups))
        metrics.update(response_metrics([n for _, n in rows], self.max_new_tokens))
        metrics.update(moved)
        return self.report(step, metrics, trained_groups=sorted(all_groups))


class CriticService(TrainerService):
    """PPO's critic, two TransferQueue tasks on the same ranks: ``values`` (a forward over each step's rows,
    read by the advantage task's GAE) and ``critic`` (the update on the GAE returns).

    The values of step s come from the critic updated through step s-1: the two phases alternate in one
    actor, so the critic is never stale, while rollout and the actor keep their own pace.
    """

    name = "critic"
    tasks = ("values", "critic")

    def __init__(self, algo: AlgorithmConfig, rows_per_step: int, chunk: int, checkpoint: dict | None = None,
                 resume_dir: str | None = None, start_version: int = 0, **kw):
        super().__init__(**kw)
        from asyncflow.algorithms.objective import make_value_objective

        self.checkpoint = checkpoint
        self.restore(resume_dir, start_version)

        self.algo, self.chunk = algo, chunk
        self.mbs = self.engine.micro_batch_size
        self.num_micro = rows_per_step // (self.mbs * self.ranks.dp_size)  # without packing (it divides then)
        self.share = self.packed_share(rows_per_step)
        self.loss_fn = make_value_objective(algo)

    def make_engine(self, megatron_cfg: CriticConfig, model_dir: str):
        from asyncflow.engines.base import make_critic_engine

        return make_critic_engine(megatron_cfg.engine, megatron_cfg, model_dir, group_timeout_s=self.timeout_s)

    def values_step(self, step: int) -> None:
        """Values of every row of ``step`` (field ``values``, one per response token)."""
        self.forward_pass(step, ["prompt_ids", "response_ids"], self.chunk, "values", self.engine.compute_values,
                          task="values")

    def update_step(self, step: int) -> dict | None:
        """``ppo_epochs`` critic updates on the step's GAE returns; the first streams from the TransferQueue."""
        cache: list[dict] = []
        fields = ["prompt_ids", "response_ids", "values", "returns"]

        def build(batch):
            return to_critic_micro_batch(batch, self.seq_len, self.pad_id, self.fixed_shape, self.multiple)

        def first_pass():
            for batch in self.stream(step, fields, self.mbs, task="critic", allow_partial=False):
                mb = build(batch)
                self.count_moved(row_tokens(batch["prompt_ids"], batch["response_ids"]), mb["tokens"].numel())
                cache.append(mb)
                yield mb

        t0 = time.time()
        num_micro, passes = self.num_micro, first_pass()
        if self.token_budget:  # the step's rows are read whole, then grouped by length
            cache[:], _ = self.packed_micro_batches(step, fields, build, self.share, task="critic")
            num_micro, passes = len(cache), iter(list(cache))
        with self.timeline.span(self.name, "critic_train", self.worker, step=step):
            results = [self.engine.train_step(passes, num_micro, self.loss_fn)]
            for _ in range(self.algo.ppo_epochs - 1):
                results.append(self.engine.train_step(iter(cache), num_micro, self.loss_fn))
        self.verify_same_rows(step)
        self.engine.version += 1
        self.maybe_save(step, self.checkpoint)
        moved = self.moved_metrics("critic")  # the values forward's tokens and the update's
        if not self.reporter:
            return None
        first, last = results[0]["micro"], results[-1]["micro"]
        tokens = max(sum(float(o["tokens"]) for o in first), 1.0)
        metrics = {
            "critic/vf_loss": sum(float(o["vf_sum"]) for o in first) / tokens,
            "critic/value_mean": sum(float(o["value_sum"]) for o in first) / tokens,
            "critic/abs_error": sum(float(o["abs_err_sum"]) for o in first) / tokens,
            "critic/grad_norm": results[-1]["grad_norm"],
            "critic/train_s": time.time() - t0,
            **moved,
        }
        if "clip_sum" in last[0]:
            metrics["critic/clip_frac"] = sum(float(o["clip_sum"]) for o in last) / tokens
        return self.report(step, metrics)

    def phase(self, step: int, phase: str | None = None) -> dict | None:
        if phase == "values":
            return self.values_step(step)
        if phase == "critic":
            return self.update_step(step)
        return self.run_step(step)

    def run_step(self, step: int) -> dict | None:
        self.values_step(step)
        return self.update_step(step)


def _flat_groups(cache: list[dict], groups: list[int]) -> int:
    """GRPO groups (of this replica's rows) whose advantages are all zero: no signal, only batch filler
    (dynamic sampling keeps this at 0)."""
    rows = torch.cat([mb["advantages"].abs().sum(-1) for mb in cache]) if cache else torch.zeros(0)
    signal: dict[int, bool] = {}
    for gid, value in zip(groups, rows.tolist()):
        signal[gid] = signal.get(gid, False) or value > 0
    return sum(not v for v in signal.values())


def _actor_metrics(results: list[dict], cache: list[dict], seconds: float) -> dict:
    first = results[0]["micro"]
    tokens = sum(float(o["tokens"]) for o in first)
    lags = torch.cat([mb["lag"] for mb in cache]).float()
    gap = gap_stats([o["fresh_logprob_gap"] for o in first if "fresh_logprob_gap" in o])
    metrics = {
        "actor/pg_loss": sum(float(o["pg_sum"]) for o in first) / max(tokens, 1),
        "actor/grad_norm": results[-1]["grad_norm"],
        "actor/tokens": tokens,
        "actor/rows": float(lags.numel()),
        "actor/train_s": seconds,
        "staleness/version_lag_mean": lags.mean().item(),
        "staleness/version_lag_max": lags.max().item(),
    }
    if "kl_sum" in first[0]:
        metrics["actor/kl"] = sum(float(o["kl_sum"]) for o in first) / max(tokens, 1)
    if "entropy_sum" in first[0]:
        metrics["actor/entropy"] = sum(float(o["entropy_sum"]) for o in first) / max(tokens, 1)
    if "is_weight_sum" in first[0]:  # the off-policy correction, from the first pass (its proximal policy)
        metrics.update(_is_metrics(first, tokens))
    if "clip_sum" in first[0]:
        metrics["actor/clip_frac"] = sum(float(o["clip_sum"]) for o in results[-1]["micro"]) / max(tokens, 1)
    for stat, value in gap.items():  # mean, p99, max and the number of checked tokens
        metrics[f"check/fresh_logprob_gap_{stat}"] = value
    if "fresh_spanning_tokens" in first[0]:
        metrics["check/fresh_spanning_tokens"] = sum(float(o["fresh_spanning_tokens"]) for o in first)
    return metrics


def response_metrics(lengths: list[int], max_new_tokens: int) -> dict:
    """Length statistics of a step's trained responses and the fraction cut at the generation cap
    (``observability.keys``: ``response/length_*``, ``response/clip_ratio``)."""
    from asyncflow.observability import keys

    if not lengths:
        return {}
    return {keys.RESPONSE_LEN_MEAN: sum(lengths) / len(lengths), keys.RESPONSE_LEN_MAX: float(max(lengths)),
            keys.RESPONSE_LEN_MIN: float(min(lengths)),
            keys.CLIP_RATIO: sum(n >= max_new_tokens for n in lengths) / len(lengths)}


def _is_metrics(first: list[dict], tokens: float) -> dict:
    """Importance weight proximal/behaviour (or current/behaviour for ``tis``) over the step's response tokens:
    mean, max and the fraction the cap truncated. At ``max_staleness`` 0 the weight is 1 up to the logprob gap."""
    tops = [float(o["is_weight_max"]) for o in first if not torch.isnan(torch.as_tensor(o["is_weight_max"]))]
    metrics = {"actor/is_weight_mean": sum(float(o["is_weight_sum"]) for o in first) / max(tokens, 1),
               "actor/is_weight_max": max(tops, default=float("nan"))}
    if "is_truncated_sum" in first[0]:
        metrics["actor/is_truncated_frac"] = sum(float(o["is_truncated_sum"]) for o in first) / max(tokens, 1)
    return metrics
