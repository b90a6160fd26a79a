"""RL task services. Each pulls the fields it needs from the TransferQueue and puts back what it makes.

| service    | reads                                        | writes                                  |
|------------|----------------------------------------------|-----------------------------------------|
| rollout    | prompt_ids                                   | response_ids, behaviour_logprobs, version |
| reward     | prompt_ids, response_ids                     | rewards                                 |
| reference  | prompt_ids, response_ids                     | ref_logprobs                            |
| advantage  | rewards (whole GRPO groups)                  | advantages                              |
| actor      | prompts, responses, logprobs, advantages     | new weights (version board)             |

``run_step(step)`` processes one partition (one global step) as its rows become ready; ``run(steps)``
loops over steps and posts each step's report to the version board. The same ``run_step`` serves
the async mode (every service loops on its own) and the sync mode (the driver calls them in turn).
Each service runs in its own Ray actor (the trained models', in ``train_services``, in one actor per
rank); it receives only the config sections it needs.
"""

from __future__ import annotations

import os
import time

import torch

from asyncflow.config import AgentConfig, AlgorithmConfig, TransferQueueConfig, VllmConfig
from asyncflow.workflow.errors import WeightApplyError
from asyncflow.workflow.partitions import PUT_ROWS, partition_name, row_length
from asyncflow.workflow.rollout_stream import ContinuousRollout


class TaskService:
    """Common plumbing: a TransferQueue client, a timeline, the board, and the step loop."""

    name = "task"

    def __init__(self, tq_address: str, tq_cfg: TransferQueueConfig, board, threads: int, worker: int = 0,
                 timeout_s: float = 600.0, cpus: list[int] | None = None, partial_batches: bool = False,
                 redo: bool = False):
        """``redo``: the driver restarts this worker when it dies (``asyncflow.workflow.supervisor``): rows are
        acked only once their outputs are put, and puts skip rows whose outputs a dead predecessor wrote."""
        from asyncflow.observability import Timeline
        from asyncflow.transfer_queue import TransferQueueClient
        from asyncflow.workflow.supervisor import RedoClient, writer_of

        if cpus:  # Ray reserves CPUs but does not pin; pinning keeps side-by-side workers off each other's cores
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        self.redo = redo
        # Its puts carry a tag that names the worker, so that the driver can roll back a put it prepared and never
        # committed when its process dies (``Supervisor._died``).
        self.tq = (RedoClient if redo else TransferQueueClient)(tq_address, tq_cfg, writer=writer_of(self.name, worker))
        self.board = board
        self.worker = worker
        self.timeout_s = timeout_s
        # Dynamic sampling grows a step's partition in rounds of any size: take what is ready, never
        # wait for a full batch that may not come until the partition is sealed.
        self.partial_batches = partial_batches
        self.timeline = Timeline()

    def stream(self, step: int, fields: list[str], batch_size: int, task: str | None = None, **kwargs):
        """Micro-batches of this task's unread rows of ``step`` until the partition is exhausted
        (``task``: the TransferQueue consumer name, when a service runs more than one task)."""
        from asyncflow.transfer_queue import StorageUnitError

        kwargs.setdefault("allow_partial", self.partial_batches)
        while True:
            batch = self._get(partition_name(step), task or self.name, fields, batch_size, **kwargs)
            # Lost rows would otherwise end the step early: a step trained on part of its rows, or none.
            if batch.meta.lost_rows:
                raise StorageUnitError(f"step {step}: {batch.meta.lost_rows} of its rows were lost with a "
                                       "TransferQueue storage unit that died (or stopped sending heartbeats for "
                                       "transfer_queue.heartbeat_timeout_s); the run cannot train that step whole")
            if batch.done:
                return
            yield batch
            if self.redo:  # the caller has put what it made of the batch: its rows are done
                self.tq.ack(batch.meta)

    def _get(self, partition: str, task: str, fields: list[str], batch_size: int, **kwargs):
        """The next batch, waiting up to ``timeout_s``; a restartable worker reads without acking (``stream``
        acks once what it made of the batch is put). A get it leaves waiting when it dies is dropped by the
        supervisor (``cancel_reads``), so it waits as long as any get."""
        return self.tq.get(partition, task, fields, batch_size, timeout=self.timeout_s, ack=not self.redo, **kwargs)

    def post(self, report: dict | None) -> None:
        """Hand a step's report to the board (ranks that do not report return None)."""
        import ray

        if report is not None:
            ray.get(self.board.report.remote(report))

    def run_step(self, step: int) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def report(self, step: int, metrics: dict, **extra) -> dict:
        """A step's metrics plus the spans recorded since the last report (and ``extra`` records)."""
        return {"step": step, "service": self.name, "worker": self.worker, "metrics": metrics,
                "spans": self.timeline.export_spans(clear=True), **extra}

    def run_phase(self, step: int, phase: str | None = None) -> dict | None:
        """One phase of a step in sync mode, with this worker's device memory taken back for it and released
        after it (colocated on devices; see ``acquire_device``)."""
        self.acquire_device()
        try:
            report = self.phase(step, phase)
        finally:
            self.release_device()
        if report is not None:  # the release belongs to this step's timeline, not the next one's
            report["spans"] += self.timeline.export_spans(clear=True)
        return report

    def phase(self, step: int, phase: str | None = None) -> dict | None:
        """The work of one phase (services with a single phase run the whole step)."""
        return self.run_step(step)

    def acquire_device(self) -> None:  # noqa: B027 - optional hook
        """Colocated ``sync`` on devices: take back the device memory released by ``release_device``."""

    def release_device(self) -> int:
        """Colocated ``sync`` on devices: give this worker's device memory to the task that runs next (vLLM
        sleeps, Megatron offloads); returns the bytes released."""
        return 0

    def run(self, first: int, last: int) -> int:
        """Process steps ``first .. last-1`` in order, posting each report to the board."""
        for step in range(first, last):
            self.post(self.run_step(step))
        return last

    def ping(self) -> str:
        """Liveness check used at start-up."""
        return self.name

    def where(self) -> dict:
        """This worker's node, the accelerator ids Ray assigned to it and its process (for placement checks and
        logs)."""
        import ray

        from asyncflow.workflow import priority

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "devices": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v},
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "cpu_policy": priority.policy(),
                "master_addr": os.environ.get("MASTER_ADDR"), "master_port": os.environ.get("MASTER_PORT"),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def transfers(self) -> dict:
        """This worker's node, the TransferQueue address it was given and the payload bytes its client moved
        through shared memory (same host) and through sockets."""
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "tq_address": self.tq.address,
                "moved_bytes": dict(self.tq.moved_bytes)}

    def shutdown(self) -> None:
        """Release what the service holds beyond its own process (before the actor is killed)."""
        self.tq.close()


class RolloutService(TaskService):
    """Generation under the staleness rule; finished responses stream into the TransferQueue."""

    name = "rollout"

    def __init__(self, vllm_cfg: VllmConfig, model_dir: str, max_staleness: int, chunk: int, budgets: bool = False,
                 relay: dict | None = None, share_device: bool = False, visible_devices: list[str] | None = None,
                 agent: AgentConfig | None = None, stream: bool = False, group_size: int = 1,
                 answers: bool = False, evaluation=None, **kw):
        """``share_device``: colocated ``sync`` on devices (the engine sleeps between its phases);
        ``visible_devices``: the devices of its engine there (``Placement.rollout_devices``); ``stream``: the
        sample stream (``workflow.mode: stream``) of whole groups of ``group_size``, carrying reference answers
        (``answers``) from the prompt stream to the steps; ``evaluation``: the validation set this instance
        evaluates between steps (``asyncflow.workflow.evaluation.EvalSpec``; instance 0 only)."""
        super().__init__(**kw)
        self.sample_stream, self.group_size, self.answers = stream, group_size, answers
        from asyncflow.engines.base import make_rollout_engine

        self.share_device = share_device
        # Unpinned workers still keep to as many cores as they have threads.
        cpus = kw.get("cpus") or list(range(kw.get("threads", 1)))
        self.engine = make_rollout_engine(vllm_cfg.engine, vllm_cfg, model_dir, share_device=share_device, cpus=cpus,
                                          visible_devices=visible_devices)
        self.max_staleness = max_staleness
        self.chunk = chunk
        multi_turn = agent is not None and agent.loop is not None
        self.continuous, self.partial = vllm_cfg.continuous or vllm_cfg.partial or multi_turn, vllm_cfg.partial
        self.partial_kv = vllm_cfg.partial_kv
        self.agent, self.agent_cfg, self.tokenizer = None, agent, None
        self.max_turns = agent.max_turns if multi_turn else 1
        if multi_turn:  # multi-turn rollouts run on the continuous stream (asyncflow.workflow.rollout_stream)
            from transformers import AutoTokenizer

            from asyncflow.agents import make_agent_loop

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the loop's, and its trajectories' text
            self.agent = make_agent_loop(agent.loop, self.tokenizer)
        self.fields = ["prompt_ids"] + (["max_new_tokens"] if budgets else [])
        self.apply_stats: dict = {}  # how the version admitted for the current step was applied
        self.max_stale_retries = 5
        self.model_dir, self.relay, self.receivers = model_dir, relay, []
        # Where this instance reads staged versions: its host's domain on the board, holding the segments of
        # the exporting ranks on this host and this host's relay mirrors of the others (bridge/routes.py).
        from asyncflow.bridge import routes

        self.domain = routes.LOCAL if relay is None else relay["rollout_hosts"][self.worker]
        self.owns_receiver = relay is not None and routes.receiver_owner(relay["rollout_hosts"], self.worker)
        self.relay_started = False
        # Weight bytes this instance's vLLM ranks read, cumulative over versions: by the way the segment came
        # (``shm``: an exporting rank's own staging segment on this host; ``relay``: this host's mirror of a
        # rank on another host) and by source (``layout.json``, beside the TransferQueue's ``moved_bytes``).
        self.weight_bytes = {"shm": 0, "relay": 0}
        self.weight_sources: dict[str, dict] = {}
        self.evaluator = None
        if evaluation is not None:
            from asyncflow.workflow.evaluation import Evaluator

            self.evaluator = Evaluator(evaluation, model_dir, evaluated=self._evaluated())

    def take_slot(self, worker: int, evaluation=None) -> int:
        """A spare instance (built idle: no loop, no weights) takes the place of dead instance ``worker``: its
        TransferQueue tag, its holder name on the stream's ledger and its weight domain become that instance's, as
        a restarted process of it would have them (``Supervisor._promote``); ``evaluation``: instance 0's
        validation set, evaluated from the next due version as a restarted instance 0 does. Returns ``worker``."""
        from asyncflow.bridge import routes
        from asyncflow.workflow import priority
        from asyncflow.workflow.supervisor import writer_of

        priority.foreground()  # a refill spare warmed up in the CPU's background; it serves as the others do
        self.worker = worker
        self.tq.writer = writer_of(self.name, worker)
        if self.relay is not None:
            self.domain = self.relay["rollout_hosts"][worker]
            self.owns_receiver = routes.receiver_owner(self.relay["rollout_hosts"], worker)
        if evaluation is not None and self.evaluator is None:
            from asyncflow.workflow.evaluation import Evaluator

            self.evaluator = Evaluator(evaluation, self.model_dir, restarted=True, evaluated=self._evaluated())
        return worker

    def _evaluated(self) -> int:
        """The newest version whose evaluation was reported in this run (the board's; -1: none)."""
        import ray

        return ray.get(self.board.evaluated.remote())

    def shutdown(self) -> None:
        """Stop the engine first: its workers may be separate processes (vLLM at TP > 1)."""
        self.engine.close()
        for receiver in self.receivers:
            receiver.close()
        if self.evaluator is not None:
            self.evaluator.close()
        super().shutdown()

    def acquire_device(self) -> None:
        """Wake the engine (weights and KV cache reallocated); ``run_step`` then applies the newest weights."""
        if self.share_device:
            with self.timeline.span(self.name, "wake", self.worker):
                self.engine.wake()

    def release_device(self) -> int:
        """Put the engine to sleep: weights and KV cache released (a no-op where the engine cannot, e.g. vLLM-cpu)."""
        if not self.share_device:
            return 0
        with self.timeline.span(self.name, "sleep", self.worker):
            return self.engine.sleep()

    def _start_relay(self) -> None:
        """This host's relay receiver (its first rollout instance runs it): mirror the slots of every exporting
        rank on another host; the ranks on this host publish their own segments here."""
        import uuid

        import ray

        from asyncflow.bridge import routes
        from asyncflow.bridge.relay import RelayReceiver
        from asyncflow.bridge.shards import MRank

        info = ray.get(self.board.wait_for_plan.remote(self.timeout_s, hosts=True))
        plan = self.engine.relay_plan(info["plan"], self.model_dir)
        tag = uuid.uuid4().hex[:8]

        def announce(version: int, source: str, segment: str) -> None:
            self.board.publish.remote(version, source, segment, self.domain, via="relay")

        for key in info["sources"]:
            remote = routes.remote_hosts(info["hosts"][key], self.relay["rollout_hosts"])
            if self.domain not in remote:  # the rank is on this host: its own segment is read here
                continue
            src = MRank(*(int(x) for x in key.split(".")))
            self.receivers.append(RelayReceiver(plan, src, self.relay, remote.index(self.domain), len(remote),
                                                f"afq-{os.getpid()}-wr{tag}-{key}", announce))
        self.relay_started = True

    def relay_state(self) -> dict:
        """This instance's part of the weight path: its host key, and the mirrors it owns (only the first
        instance of a host owns any)."""
        return {"host": self.domain, "owner": self.owns_receiver, "mirrors": [r.segment for r in self.receivers],
                "buffer_bytes": [r.buffer_bytes for r in self.receivers],
                "read_bytes": dict(self.weight_bytes), "read_by_source": {k: dict(v) for k, v in
                                                                          self.weight_sources.items()},
                "relay_received_bytes": sum(r.received_bytes for r in self.receivers),
                "relay_versions": sum(r.versions for r in self.receivers),
                "relay_generations": sorted({n for r in self.receivers for n in r.generations})}

    def _count_read(self, staging: dict, stats: dict) -> dict[str, int]:
        """Add this version's bytes (every vLLM rank's, by source) to the counters; returns them by way."""
        now = {"shm": 0, "relay": 0}
        via = staging.get("via", {})
        for rank in stats.get("ranks", []):
            for source, n in rank.get("bytes_by_source", {}).items():
                way = via.get(source, "shm")
                now[way] = now.get(way, 0) + n
                entry = self.weight_sources.setdefault(source, {"via": way, "bytes": 0})
                entry["via"], entry["bytes"] = way, entry["bytes"] + n
        for way, n in now.items():
            self.weight_bytes[way] = self.weight_bytes.get(way, 0) + n
        return now

    def _admit(self, step: int) -> int:
        """Wait until weights recent enough for ``step`` are staged, apply the newest; return its version."""
        import ray

        from asyncflow.workflow.board import admitted_version

        if self.owns_receiver and not self.relay_started:
            self._start_relay()
        for receiver in self.receivers:
            receiver.check()
        with self.timeline.span(self.name, "wait_weights", self.worker):
            version, staging = ray.get(self.board.wait_for_version.remote(
                admitted_version(step, self.max_staleness), self.timeout_s, self.domain))
        self.apply_stats = {}
        if version != self.engine.weight_version:
            self._apply(version, staging)
        return self.engine.weight_version

    def _apply(self, version: int, staging: dict) -> None:
        """Apply staged ``version``, or a newer one if the trainer overwrote it meanwhile.

        The engine serves either the old version or, once every bucket is in, the new one: it never
        generates in between. A failed apply is retried once with the newest version; a second failure
        stops the run with an error naming this instance and the version.
        """
        import ray

        from asyncflow.bridge.staging import StaleStagingError

        stale, failed, t0 = 0, None, time.perf_counter()
        while True:
            newer = version  # the version to wait for if this attempt does not succeed
            ray.get(self.board.rollout_state.remote(self.worker, self.engine.weight_version, version))
            try:
                with self.timeline.span(self.name, "load_weights", self.worker, version=version):
                    stats = self.engine.apply_staged(staging, version)
                break
            except StaleStagingError:
                stale += 1  # the trainer staged newer versions over this one while it was read: take the newest
                newer = version + 1
                if stale > self.max_stale_retries:
                    raise WeightApplyError(
                        f"rollout instance {self.worker}: weight version {version} was overwritten {stale} times "
                        f"while it was applied (applying is slower than two training steps)") from None
            except Exception as exc:
                if failed is not None:
                    raise WeightApplyError(f"rollout instance {self.worker} failed to apply weight version "
                                           f"{version} twice: {exc}") from exc
                failed = exc
                print(f"rollout instance {self.worker}: applying weight version {version} failed ({exc}); "
                      f"retrying with the newest version", flush=True)
            version, staging = ray.get(self.board.wait_for_version.remote(newer, self.timeout_s, self.domain))
        ray.get(self.board.rollout_state.remote(self.worker, version, None))
        read = self._count_read(staging, stats)
        self.apply_stats = {"weights/apply_s": time.perf_counter() - t0, "weights/buckets": float(stats["buckets"]),
                            "weights/stale_retries": float(stale),
                            "weights/received_mb_per_rank": max(stats["bytes_per_rank"]) / 2**20,
                            "weights/read_shm_mb": read["shm"] / 2**20, "weights/read_relay_mb": read["relay"] / 2**20}

    def run(self, first: int, last: int) -> int:
        if self.sample_stream:
            from asyncflow.workflow.sample_stream import StreamRollout

            StreamRollout(self, self.partial, self.group_size, self.answers).run(first, last, self.post)
            return last
        if not self.continuous:
            return super().run(first, last)
        ContinuousRollout(self, self.partial, evaluate=True).run(first, last, self.post)
        return last

    def _evaluate(self, version: int) -> tuple[dict, list[dict]] | None:
        """The validation set at ``version`` when an evaluation is due (between generations, never inside one)."""
        if self.evaluator is None or not self.evaluator.due(version):
            return None
        with self.timeline.span(self.name, "evaluate", self.worker, version=version):
            return self.evaluator.run(self.engine, version)

    def evaluate_drained(self, admit: int, post, step: int | None = None) -> None:
        """The streaming loops' evaluation (``ContinuousRollout``, ``StreamRollout``), once they drained the
        engine for it: apply the newest weights allowed for step ``admit`` (``_admit``) and, when still due,
        evaluate them and ``post`` the result as a report of its own (``EVAL_SERVICE``) for ``step`` (default
        ``admit``: the step the loop admits next). Its own service name keeps it from counting as the step's
        rollout report; the driver logs it with ``step``, or with the next step it logs when ``step`` was logged
        meanwhile or holds another evaluation (``workflow.reporting``)."""
        from asyncflow.workflow.evaluation import EVAL_SERVICE

        evaluated = self._evaluate(self._admit(admit))
        if evaluated is not None:
            report = {**self.report(admit if step is None else step, {}), "service": EVAL_SERVICE}
            post(self._with_evaluation(report, evaluated))

    @staticmethod
    def _with_evaluation(report: dict, evaluated: tuple[dict, list[dict]] | None) -> dict:
        if evaluated is not None:
            report["metrics"].update(evaluated[0])
            report["eval_samples"] = evaluated[1]
        return report

    def run_step(self, step: int) -> dict:
        if self.continuous:  # sync mode: one step through the same stream (no chunks within the step)
            from asyncflow.workflow.board import admitted_version

            evaluated, stats = None, {}
            if self.evaluator is not None and self.evaluator.due(admitted_version(step, self.max_staleness)):
                evaluated, stats = self._evaluate(self._admit(step)), dict(self.apply_stats)
            reports: list[dict] = []
            ContinuousRollout(self, self.partial).run(step, step + 1, reports.append)
            reports[0]["metrics"] = {**stats, **reports[0]["metrics"]}
            return self._with_evaluation(reports[0], evaluated)
        version = self._admit(step)
        evaluated = self._evaluate(version)
        part, pending, rows, tokens = partition_name(step), [], 0, 0

        def flush():
            if pending:
                self.tq.put(part, {
                    "response_ids": [torch.tensor(s.response_ids, dtype=torch.long) for _, s in pending],
                    "behaviour_logprobs": [torch.tensor(s.response_logprobs) for _, s in pending],
                }, indexes=[i for i, _ in pending], versions=[s.weight_version for _, s in pending],
                    lengths=[row_length(s) for _, s in pending])
                pending.clear()

        for batch in self.stream(step, self.fields, self.chunk):
            with self.timeline.span(self.name, "generate", self.worker, rows=len(batch)) as span:
                prompts = [p.tolist() for p in batch["prompt_ids"]]
                budgets = batch["max_new_tokens"].tolist() if "max_new_tokens" in batch else None
                puts = [0.0]  # seconds of TransferQueue puts inside the engine's callbacks

                def on_sample(i, sample, indexes=batch.indexes, puts=puts):
                    pending.append((indexes[i], sample))
                    if len(pending) >= PUT_ROWS:  # stream out as they finish, a few rows per put
                        t = time.perf_counter()
                        flush()
                        puts[0] += time.perf_counter() - t

                t0 = time.perf_counter()
                samples = self.engine.generate(prompts, n=1, on_sample=on_sample, max_new_tokens=budgets,
                                               ignore_eos=budgets is not None)
                # The engine's own time, without the puts: ``bench/calibrate.py`` sets the profile's speed by it.
                span["engine_s"] = time.perf_counter() - t0 - puts[0]
                flush()
            rows += len(samples)
            tokens += sum(len(s.response_ids) for s in samples)
        return self._with_evaluation(self.report(step, {
            "rollout/rows": rows, "rollout/tokens": tokens, "rollout/version": version,
            "rollout/weight_buckets": self.apply_stats.get("weights/buckets", 0.0), **self.apply_stats}), evaluated)


class RewardService(TaskService):
    """Rewards by the function ``algorithm.reward`` names, in any shape ``asyncflow.rewards.scorer`` reads (per
    row or batched, sync or async, token ids or verl's text signature); a function that raises is isolated.
    ``reward.workers`` of these take chunks of the same steps side by side (each row is read by one of them)."""

    name = "reward"

    def __init__(self, reward: str, model_dir: str, chunk: int, reward_on_error: float = 0.0,
                 with_answers: bool = False, agent_errors: bool = False, reward_cfg=None,
                 tokenizer_class: str | None = None, **kw):
        """``tokenizer_class``: the policy tokenizer's class as the driver resolved it
        (``asyncflow.models.tokenizer``); None loads it through ``AutoTokenizer``."""
        super().__init__(**kw)
        from asyncflow.models.tokenizer import load_tokenizer
        from asyncflow.rewards import RewardScorer, make_reward_fn

        tokenizer = load_tokenizer(model_dir, tokenizer_class)
        self.scorer = RewardScorer(make_reward_fn(reward, tokenizer, reward_cfg), tokenizer, reward_cfg,
                                   reward_on_error)
        self.chunk, self.reward_on_error, self.with_answers = chunk, reward_on_error, with_answers
        # Multi-turn rows carry ``agent_error`` (the agent loop failed on them) and ``turn_reward`` (the sum of
        # their per-turn rewards, added to the end-of-trajectory reward).
        self.agent_errors = agent_errors

    def run_step(self, step: int) -> dict:
        from asyncflow.rewards.scorer import RewardRow

        failures, first_error, rows_scored, extra = 0, None, 0, {}
        fields = ["prompt_ids", "response_ids"] + (["ground_truth"] if self.with_answers else []) + \
            (["agent_error", "turn_reward"] if self.agent_errors else [])
        for batch in self.stream(step, fields, self.chunk):
            with self.timeline.span(self.name, "score", self.worker, rows=len(batch)):
                answers = batch["ground_truth"] if self.with_answers else [None] * len(batch)
                rows = [RewardRow.of(p.tolist(), r.tolist(), a, self.with_answers)
                        for p, r, a in zip(batch["prompt_ids"], batch["response_ids"], answers)]
                scored = [(s.reward, s.error) for s in self._score(rows, extra)]
                if self.agent_errors:  # the agent loop failed on these rows (counted by the rollout as agent/errors)
                    scored = [(self.reward_on_error, None) if float(f) else (sc[0] + float(tr), sc[1])
                              for sc, f, tr in zip(scored, batch["agent_error"], batch["turn_reward"])]
                errors = [e for _, e in scored if e]
                failures += len(errors)
                rows_scored += len(rows)
                first_error = first_error or (errors[0] if errors else None)
                self.tq.put(partition_name(step), {"rewards": torch.tensor([r for r, _ in scored])},
                            indexes=batch.indexes)
        if first_error:
            print(f"reward: {failures} sample(s) of step {step} failed to score, e.g. {first_error}", flush=True)
        means = {f"reward/extra/{k}_mean": total / count for k, (total, count) in extra.items()}
        return self.report(step, {"reward/failures": float(failures), "reward/rows": float(rows_scored), **means})

    def _score(self, rows: list, extra: dict) -> list:
        """Score ``rows``; the extra numbers a function returned add up in ``extra`` (name -> (sum, count))."""
        scored = self.scorer.score(rows)
        for s in scored:
            for key, value in s.metrics.items():
                total, count = extra.get(key, (0.0, 0))
                extra[key] = (total + value, count + 1)
        return scored

    def shutdown(self) -> None:
        """Close the scorer's event loop too."""
        self.scorer.close()
        super().shutdown()


class AdvantageService(TaskService):
    """Advantages; receives whole GRPO groups only (the group sampler), or the whole step."""

    name = "advantage"

    def __init__(self, algo: AlgorithmConfig, group_size: int, chunk: int, rows_per_step: int, **kw):
        super().__init__(**kw)
        from asyncflow.algorithms.advantages import estimator_scope

        self.algo, self.group_size = algo, group_size
        self.scope = estimator_scope(algo.advantage)
        # Group-scope estimators stream whole groups; batch-scope ones (whitening) need the whole step;
        # GAE (critic scope) is per sequence and streams, unless its advantages are whitened over the batch.
        whole_step = self.scope == "batch" or (self.scope == "critic" and algo.whiten_advantages)
        self.chunk = rows_per_step if whole_step else max(chunk // group_size, 1) * group_size
        self.kl_in_reward = algo.kl_coef > 0 and algo.kl_mode == "reward"
        self.rows_per_step = rows_per_step
        self.dynamic_sampling = algo.dynamic_sampling
        if self.dynamic_sampling:  # judged a group at a time: a round of extra prompts may be one group
            self.chunk = group_size

    def run_step(self, step: int) -> dict:
        if self.scope == "critic":
            return self._gae_step(step)
        return self._outcome_step(step)

    def _gae_step(self, step: int) -> dict:
        """PPO: per-token advantages and returns by GAE over the critic's values (fields ``advantages`` and
        ``returns``, one value per response token); the outcome reward sits on the last token."""
        from asyncflow.algorithms import gae, kl_penalty, outcome_token_rewards, whiten

        fields = ["rewards", "values"] + (["behaviour_logprobs", "ref_logprobs"] if self.kl_in_reward else [])
        all_rewards = []
        for batch in self.stream(step, fields, self.chunk):
            with self.timeline.span(self.name, "gae", self.worker, rows=len(batch)):
                scores = torch.as_tensor(batch["rewards"]).float().reshape(-1)
                all_rewards.append(scores)
                lengths = [len(v) for v in batch["values"]]
                width = max(max(lengths), 1)
                mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
                values = torch.zeros(len(lengths), width)
                for i, v in enumerate(batch["values"]):
                    values[i, : len(v)] = torch.as_tensor(v).float()
                kl = None
                if self.kl_in_reward:
                    kl = torch.zeros(len(lengths), width)
                    for i, (b, r) in enumerate(zip(batch["behaviour_logprobs"], batch["ref_logprobs"])):
                        kl[i, : len(b)] = kl_penalty(self.algo.kl_estimator, torch.as_tensor(b), torch.as_tensor(r))
                token_rewards = outcome_token_rewards(scores, mask, kl, self.algo.kl_coef)
                adv, returns = gae(token_rewards, values, mask, self.algo.gae_gamma, self.algo.gae_lambda)
                if self.algo.whiten_advantages:
                    adv = whiten(adv, mask)
                self.tq.put(partition_name(step), {"advantages": [adv[i, :n].clone() for i, n in enumerate(lengths)],
                                                   "returns": [returns[i, :n].clone() for i, n in enumerate(lengths)]},
                            indexes=batch.indexes)
        return self._reward_report(step, all_rewards)

    def _reward_report(self, step: int, all_rewards: list, **metrics) -> dict:
        rewards = torch.cat(all_rewards) if all_rewards else torch.zeros(0)
        return self.report(step, {"reward/mean": rewards.mean().item() if len(rewards) else float("nan"),
                                  "reward/max": rewards.max().item() if len(rewards) else float("nan"), **metrics})

    def _outcome_step(self, step: int) -> dict:
        from asyncflow.algorithms import compute_advantages, kl_penalty

        fields = ["rewards"] + (["behaviour_logprobs", "ref_logprobs"] if self.kl_in_reward else [])
        all_rewards, kept_rewards, kept, judged = [], [], 0, 0
        for batch in self.stream(step, fields, self.chunk, sampler="group",
                                 sampler_args={"group_size": self.group_size}):
            with self.timeline.span(self.name, "advantages", self.worker, rows=len(batch)):
                rewards = torch.as_tensor(batch["rewards"]).float().reshape(-1)
                all_rewards.append(rewards)
                if self.dynamic_sampling:
                    judged += len(batch)
                    batch, rewards = self._keep_groups(step, batch, rewards, self.rows_per_step - kept)
                    kept += len(rewards)
                    kept_rewards.append(rewards)
                    self.board.sampling_progress.remote(step, kept, judged)
                    if not len(rewards):
                        continue
                if self.kl_in_reward:
                    kl = torch.stack([kl_penalty(self.algo.kl_estimator, b, r).sum()
                                      for b, r in zip(batch["behaviour_logprobs"], batch["ref_logprobs"])])
                    rewards = rewards - self.algo.kl_coef * kl
                adv = compute_advantages(self.algo.advantage, rewards, batch.meta.group_ids,
                                         **_advantage_kwargs(self.algo))
                self.tq.put(partition_name(step), {"advantages": adv}, indexes=batch.indexes)
        # reward/mean stays the mean over every judged row (the policy's reward, unbiased); the rows kept for
        # training are biased towards groups with mixed outcomes and are reported apart.
        extra = {"sampling/judged_rows": float(judged), "sampling/kept_rows": float(kept),
                 "sampling/kept_reward_mean": torch.cat(kept_rewards).mean().item() if kept else float("nan")} \
            if self.dynamic_sampling else {}
        return self._reward_report(step, all_rewards, **extra)

    def _keep_groups(self, step: int, batch, rewards: torch.Tensor, room: int):
        """DAPO dynamic sampling: keep the groups whose rewards differ, up to ``room`` rows; drop the rest
        from the TransferQueue (nobody reads them again) and return the kept rows."""
        groups = torch.as_tensor(batch.meta.group_ids)
        keep = torch.zeros(len(rewards), dtype=torch.bool)
        for gid in torch.unique(groups, sorted=False).tolist():
            rows = groups == gid
            if rewards[rows].max() > rewards[rows].min() and int(keep.sum()) + int(rows.sum()) <= room:
                keep |= rows
        dropped = [i for i, k in zip(batch.indexes, keep.tolist()) if not k]
        if dropped:
            self.tq.clear(partition_name(step), dropped, force=True)
        return batch.select(keep.nonzero().flatten().tolist()), rewards[keep]


def _advantage_kwargs(algo: AlgorithmConfig) -> dict:
    if algo.advantage == "grpo":
        return {"eps": algo.adv_eps, "norm_by_std": algo.norm_adv_by_std}
    return {}
