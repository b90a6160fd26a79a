"""The RL loop: one function for both modes.

    prompts ─► TQ[step s] ─► rollout (vLLM, weights v) ─► reward ─► advantage ─┐
                         ├─────────────────────────────► reference ───────────┤
                         └──► values (critic, PPO) ──► advantage (GAE) ───────┤
                                                                               ▼
           weights v+1 ◄──── version board ◄──── actor update (Megatron) ◄─ TQ rows ─► critic update
                 │
                 └─► rollout admits step s only when weights v >= s - k exist, so a sample made
                     with version v is trained at step s <= v + k   (k = workflow.max_staleness)

    async:  every service loops over steps on its own; rollout of step s+k overlaps training of step s.
    sync:   the driver runs the same services one after another per step (the colocated baseline).
    stream: as async, but rollout takes prompts from one stream and step s trains the first whole groups to
            finish within the bound (``workflow.sample_stream``); a late group is generated again.

The driver feeds prompts ahead of the services, grows steps under DAPO dynamic sampling
(``workflow.feeder``, ``workflow.sampling``) and commits checkpoints as steps complete
(``workflow.resume``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from asyncflow.config import AsyncFlowConfig

_GENERATION = ("rollout", "reward", "advantage")
"""Sync mode with dynamic sampling runs these together: a step is generated until enough groups are kept."""


def train(cfg: AsyncFlowConfig, resume: bool = False) -> dict:
    """Run ``cfg.workflow.steps`` RL steps (from the newest checkpoint with ``resume``); return the summary.

    Runs on the Ray this process is connected to, if any (left up at the end, with nothing of the run in it),
    else on one it starts for the run (``connect_ray``) and shuts down at the end.

    Called from the main thread, it handles SIGTERM and SIGINT (``workflow.signals``): the run stops at the next
    step boundary with a checkpoint there, writes ``summary.json``, tears everything down and raises
    ``RunStopped``.

    When a trainer rank dies, or a TransferQueue storage unit dies with rows the run still needs, and checkpoints
    are on, the run is torn down and started again from its newest complete checkpoint, as ``--resume`` does, up to
    ``workflow.max_restarts`` times (``run_restarts`` in the summary, ``trainer_restarts`` for the trainer deaths)."""
    from asyncflow.workflow.errors import RunLostError
    from asyncflow.workflow.signals import RunStopped, StopSignals

    signals = StopSignals(cfg.checkpoint.signal_grace_s)
    restarts: list[dict] = []  # the restarts of the whole run so far (``workflow.max_restarts``)
    with signals.installed():
        while True:
            try:
                return _train(cfg, resume, signals, restarts)
            except KeyboardInterrupt as exc:  # before the loop began: nothing trained, the resume point stays
                if not signals.stopping_now(exc):
                    raise
                signals.tearing_down()
                raise RunStopped(_resumed_at(cfg, resume), signals.signal_name, _resume_point(cfg),
                                 reason=signals.stop_reason) from None
            except RunLostError as exc:  # everything of the run is gone: start again from its checkpoint
                _restart(cfg, exc, restarts, signals)
                resume = True


def _restart(cfg: AsyncFlowConfig, died, restarts: list[dict], signals) -> None:
    """A trainer rank or a storage unit died (``died``, a ``RunLostError``) and the run was torn down: record a
    restart from the newest complete checkpoint, or raise ``died`` when checkpoints are off or
    ``workflow.max_restarts`` is spent (``RunStopped`` when a signal came meanwhile)."""
    import json
    import time

    from asyncflow.workflow.signals import RunStopped

    limit, point = cfg.workflow.max_restarts, _resume_point(cfg)
    if signals.late_signal is not None:  # asked to stop while the dead run was torn down: stop, resumable
        raise RunStopped(point or 0, signals.late_signal, point, reason=f"{died}; not restarted") from died
    if point is None or limit <= 0:
        raise died
    if len(restarts) >= limit:
        raise type(died)(f"{died}; the run was restarted from its checkpoint {len(restarts)} times already "
                         f"(workflow.max_restarts={limit})", died.group, died.rank, died.step) from died
    step = point if died.step is None else died.step
    event = {"cause": died.kind, "group": died.group, "rank": died.rank, "died_at_step": step,
             "restart": len(restarts) + 1, "checkpoint_step": point, "steps_redone": max(step - point, 0),
             "detected_at": time.time()}
    restarts.append(event)
    out = Path(cfg.observability.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "restarts.jsonl", "a") as f:  # beside the service restarts (``workflow.supervisor``)
        f.write(json.dumps({"service": died.group, "worker": died.rank, **event}) + "\n")
    print(f"{died.who()} died at step {step}; restart {event['restart']}/{limit} from the checkpoint at step "
          f"{point}", flush=True)
    signals.rearm()


def _train(cfg: AsyncFlowConfig, resume: bool, signals, restarts: list[dict]) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from asyncflow.config import replace_section
    from asyncflow.observability.progress import StartupLog
    from asyncflow.tiny_model import ensure_model
    from asyncflow.workflow.errors import RunLostError
    from asyncflow.workflow.feeder import Feeder, StreamFeeder
    from asyncflow.workflow.pipeline import connect_ray, start_pipeline
    from asyncflow.workflow.reporting import Reporter
    from asyncflow.workflow.resume import RunCheckpoints, ask_due, trim_metrics
    from asyncflow.workflow.signals import RunStopped
    wf = cfg.workflow
    startup = StartupLog()
    model_dir = ensure_model(cfg.model)
    # Ray's start is mostly its daemons' work in other processes, and the tokenizer's load mostly this
    # process's imports (transformers, torch): side by side they overlap.
    started = False
    try:  # until a pipeline owns Ray, a failure here shuts down a Ray started for the run
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(_prompt_source, cfg, model_dir)
            startup.phase("starting Ray" if cfg.ray.address is None else f"joining Ray at {cfg.ray.address}")
            started = connect_ray(cfg)
            signals.install()  # ray.init replaced the SIGTERM handler with its own
            source = loading.result()
        ckpt = RunCheckpoints(cfg, source)
        start, resume_dir, meta = ckpt.resume() if resume else (0, None, {})
        ckpt.clean_staging()
        if resume_dir is not None and trim_metrics(cfg.observability.output_dir, start):
            cfg = replace_section(cfg, "observability", append=True)
        if start >= wf.steps:
            raise ValueError(f"the checkpoint is at step {start}; workflow.steps={wf.steps} leaves nothing to train")
        pipe = start_pipeline(cfg, model_dir, source.max_prompt_len, hasattr(source, "sample_budgets"),
                              answers=hasattr(source, "next_batch"), resume_dir=resume_dir, start_step=start,
                              owns_ray=started, startup=startup)
        signals.install()  # a Ray started by start_pipeline replaced it again
        checkpoint = {"interval": ckpt.interval, "steps": wf.steps, "every_minutes": cfg.checkpoint.every_minutes}
        ckpt.due = functools.partial(ask_due, checkpoint, pipe.board)  # the trainers' rule (the board's clock)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    reporter = None
    try:
        pipe.create_partitions(wf.steps, wf.prompts_per_step * wf.samples_per_prompt, first=start)

        def step_done(step: int) -> None:
            if step == start:
                startup.phase(f"first step done (step {step})")
            ckpt.step_done(step, reporter.trained_groups)

        reporter = Reporter(cfg, pipe, first_step=start, trained_groups=meta.get("trained_groups"), on_step=step_done)
        if restarts:
            reporter.extra_summary["run_restarts"] = restarts
            reporter.extra_summary["trainer_restarts"] = [r for r in restarts if r["cause"] == "trainer"]
        feeder = (StreamFeeder(cfg, pipe, source, ckpt, start, meta) if wf.mode == "stream"
                  else Feeder(cfg, pipe, source, ckpt, start, replay=meta.get("replay")))
        run = {"sync": _run_sync, "stream": _run_stream}.get(wf.mode, _run_async)
        run(cfg, pipe, ckpt, reporter, feeder, signals, start)
        return reporter.finish()
    except BaseException as exc:
        signals.tearing_down()
        lost = _storage_lost(pipe, exc)  # before ``abort`` drops the partitions (and their lost rows)
        pipe.abort(f"{type(exc).__name__}: {exc}")
        if signals.stopping_now(exc):  # a second signal, or the grace time is over: no checkpoint at the stop
            stop = RunStopped(reporter.trained_steps if reporter else start, signals.signal_name,
                              _resume_point(cfg), reason=signals.stop_reason)
            if reporter is not None:
                reporter.finish(stopped=stop.record())
            raise stop from None
        explained = pipe.explain(exc)
        if explained is exc and lost is not None:
            explained = lost
        if isinstance(explained, RunLostError):
            explained.step = reporter.trained_steps if reporter else start
        if explained is not exc:
            raise explained from exc
        raise
    finally:
        signals.tearing_down()  # a signal now (the run is over or stopping) must not cut the teardown short
        if reporter is not None:
            reporter.observer.close()  # after a failure: still flush metrics and write the timeline
        pipe.close()


def _run_sync(cfg: AsyncFlowConfig, pipe, ckpt, reporter, feeder, signals, start: int) -> None:
    """Sync mode: the driver runs the services one after another per step (the colocated baseline)."""
    import ray

    for step in range(start, cfg.workflow.steps):
        if signals.requested:
            _stop(cfg, pipe, ckpt, reporter, signals, step, start)
        feeder.feed_until(step + 1)
        stages = pipe.stages
        if feeder.sampling:  # generate, judge and top up the step until it is full
            gen = [(name, phase) for name, phase in stages if name in _GENERATION]
            feeder.wait([h.run_phase.remote(step, p) for name, p in gen for h in pipe.groups[name]],
                        reporter.collect, sync=True)
            stages = [s for s in stages if s not in gen]
        # Lock-step: each task (all its instances or ranks at once) finishes the step before the next.
        for name, phase in stages:
            reports = ray.get([handle.run_phase.remote(step, phase) for handle in pipe.groups[name]])
            reporter.collect([r for r in reports if r is not None])


def _run_stream(cfg: AsyncFlowConfig, pipe, ckpt, reporter, feeder, signals, start: int) -> None:
    """The sample stream: every service loops on its own; the feeder keeps the prompt stream full; a rollout
    instance or a stateless service whose process dies is started again (``workflow.supervisor``)."""
    from asyncflow.workflow.supervisor import Supervisor

    supervisor = Supervisor(cfg, pipe, reporter)
    wait = functools.partial(feeder.wait, collect=reporter.collect, recover=supervisor.recover,
                             more=supervisor.poll, wake=supervisor.pending, ahead=lambda: 0)
    running = wait(supervisor.start(start, cfg.workflow.steps), until=lambda: signals.requested)
    if running:
        _stop_async(cfg, pipe, ckpt, reporter, signals, start, functools.partial(wait, running))
    reporter.extra_summary["service_restarts"] = supervisor.finish()


def _run_async(cfg: AsyncFlowConfig, pipe, ckpt, reporter, feeder, signals, start: int) -> None:
    """Async mode: every service loops over steps on its own; a stateless service whose process dies is started
    again (``workflow.supervisor``)."""
    from asyncflow.workflow.supervisor import Supervisor

    wf = cfg.workflow
    supervisor = Supervisor(cfg, pipe, reporter)
    # Prompts go in one step ahead of what rollout may generate under the staleness bound.
    wait = functools.partial(feeder.wait, collect=reporter.collect, recover=supervisor.recover,
                             more=supervisor.poll, wake=supervisor.pending,
                             ahead=lambda: reporter.trained_steps + wf.max_staleness + 2)
    running = wait(supervisor.start(start, wf.steps), until=lambda: signals.requested)
    if running:
        _stop_async(cfg, pipe, ckpt, reporter, signals, start, functools.partial(wait, running))
    reporter.extra_summary["service_restarts"] = supervisor.finish()


def _stop_async(cfg: AsyncFlowConfig, pipe, ckpt, reporter, signals, start: int, wait) -> None:
    """A signal arrived while the services run on their own: every trainer rank stops at the boundary the board
    fixes (``VersionBoard.request_stop``) and saves its part there; then ``_stop`` commits. ``wait(until=...)``
    waits on the service loops while feeding and collecting. Returns (the run goes on to its end) when that
    boundary is the end of the run."""
    import ray

    at = ray.get(pipe.board.request_stop.remote(start, ckpt.enabled))
    if at >= cfg.workflow.steps:  # the trainers are in the last step already: let the run finish
        wait()
        return
    ranks = sum(len(pipe.groups.get(name, [])) for name in ("actor", "critic"))
    # Until every trainer rank has stopped (and saved) and the other services' reports of the last steps are in;
    # bounded by the grace time.
    wait(until=lambda: reporter.trained_steps >= at and ray.get(pipe.board.trainers_stopped.remote()) >= ranks)
    _stop(cfg, pipe, ckpt, reporter, signals, at, start, saved=True)


def _stop(cfg: AsyncFlowConfig, pipe, ckpt, reporter, signals, trained: int, start: int, saved: bool = False):
    """Stop at the boundary after ``trained`` steps: the trainer groups save their parts (unless ``saved``), the
    driver commits the checkpoint and writes the summary; raises ``RunStopped``."""
    import ray

    from asyncflow.workflow.signals import RunStopped

    path = None
    if ckpt.enabled and trained > start:
        if not saved:
            ray.get([h.stop_save.remote(trained) for name in ("actor", "critic") for h in pipe.groups.get(name, [])])
        signals.boundary_reached()
        path = ckpt.commit_stop(trained, reporter.trained_groups)
    signals.tearing_down()
    stop = RunStopped(trained, signals.signal_name, _resume_point(cfg), None if path is None else str(path))
    reporter.finish(stopped=stop.record())
    raise stop


def _storage_lost(pipe, exc: BaseException):
    """A ``StorageLostError`` when ``exc`` comes from TransferQueue rows the run lost: a ``StorageUnitError``
    anywhere in its chain (a service's, raised in its Ray task), any other TransferQueue error while the controller
    reports a dead unit (a put or get that reached the unit before the controller declared it dead), or while the
    controller itself does not answer (it died: every row is gone with it). None otherwise."""
    import time

    from asyncflow.transfer_queue import StorageUnitError, TransferQueueError
    from asyncflow.transfer_queue.membership import LINK_GRACE_S
    from asyncflow.workflow.errors import StorageLostError

    chain, seen = [], exc
    while isinstance(seen, BaseException) and len(chain) < 8:
        chain.append(seen)
        cause = getattr(seen, "cause", None)  # a Ray task's own exception (other Ray errors keep a text there)
        seen = cause if isinstance(cause, BaseException) else seen.__cause__ or seen.__context__
    if not any(isinstance(e, TransferQueueError) for e in chain):
        return None
    # A client can see a unit's closed connection before the controller declares the unit dead (its link must stay
    # down for LINK_GRACE_S first): ask again for a few seconds before taking the failure for something else.
    deadline = time.monotonic() + LINK_GRACE_S + 4.0
    while True:
        try:
            units = pipe.client.status()["units"]
        except Exception:  # noqa: BLE001 - whatever the reason, the controller and the rows it knew are out of reach
            return StorageLostError("the TransferQueue controller did not answer (it died, or its host did); the "
                                    "rows of the run went with it", "controller", None)
        dead = sorted(int(uid) for uid, unit in units.items() if not unit["alive"])
        if dead or any(isinstance(e, StorageUnitError) for e in chain):
            break
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    which = ", ".join(map(str, dead)) or "?"
    return StorageLostError(f"TransferQueue storage unit {which} died; rows the run still needed were lost with it",
                            "storage", dead[0] if dead else None)


def _resume_point(cfg: AsyncFlowConfig) -> int | None:
    """Where ``--resume`` continues: the newest complete checkpoint's step (0 if none); None when checkpoints
    are off (``checkpoint.dir`` unset, ``checkpoint.interval`` and ``checkpoint.every_minutes`` 0)."""
    from asyncflow.workflow.checkpoints import CheckpointManager
    from asyncflow.workflow.resume import checkpoint_root, checkpoints_on

    if not checkpoints_on(cfg) and cfg.checkpoint.dir is None:
        return None
    root = checkpoint_root(cfg)
    found = CheckpointManager(root, 0).latest() if root.is_dir() else None
    return 0 if found is None else int(found[1]["step"])


def _resumed_at(cfg: AsyncFlowConfig, resume: bool) -> int:
    """The step a run starts at (before it trained anything)."""
    return (_resume_point(cfg) or 0) if resume else 0


def _prompt_source(cfg: AsyncFlowConfig, model_dir: Path):
    from transformers import AutoTokenizer

    from asyncflow.data import make_prompt_source

    wf = cfg.workflow
    return make_prompt_source(wf.task, AutoTokenizer.from_pretrained(model_dir), wf.seed, cfg.data)
