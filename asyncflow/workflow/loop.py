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

from pathlib import Path

from asyncflow.config import AsyncFlowConfig

_GENERATION = ("rollout", "reward", "advantage")
"""Sync mode with dynamic sampling runs these together: a step is generated until enough groups are kept."""


def train(cfg: AsyncFlowConfig, resume: bool = False) -> dict:
    """Run ``cfg.workflow.steps`` RL steps (from the newest checkpoint with ``resume``); return the summary.

    Runs on the Ray this process is connected to, if any (left up at the end, with nothing of the run in it),
    else on one it starts for the run (``connect_ray``) and shuts down at the end."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from asyncflow.config import replace_section
    from asyncflow.tiny_model import ensure_model
    from asyncflow.workflow.feeder import Feeder, StreamFeeder
    from asyncflow.workflow.pipeline import connect_ray, start_pipeline
    from asyncflow.workflow.reporting import Reporter
    from asyncflow.workflow.resume import RunCheckpoints, trim_metrics
    from asyncflow.workflow.supervisor import Supervisor

    wf = cfg.workflow
    model_dir = ensure_model(cfg.model)
    # Ray's start is mostly its daemons' work in other processes, and the tokenizer's load mostly this
    # process's imports (transformers, torch): side by side they overlap.
    started = False
    try:  # until a pipeline owns Ray, a failure here shuts down a Ray started for the run
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(_prompt_source, cfg, model_dir)
            started = connect_ray(cfg)
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
                              owns_ray=started)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    reporter = None
    try:
        pipe.create_partitions(wf.steps, wf.prompts_per_step * wf.samples_per_prompt, first=start)
        reporter = Reporter(cfg, pipe, first_step=start, trained_groups=meta.get("trained_groups"),
                            on_step=lambda step: ckpt.step_done(step, reporter.trained_groups))
        feeder = (StreamFeeder(cfg, pipe, source, ckpt, start, meta) if wf.mode == "stream"
                  else Feeder(cfg, pipe, source, ckpt, start, replay=meta.get("replay")))
        if wf.mode == "sync":
            for step in range(start, wf.steps):
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
        elif wf.mode == "stream":
            running = [s.run.remote(start, wf.steps) for s in pipe.services]
            feeder.wait(running, reporter.collect, ahead=lambda: 0)
        else:  # a stateless service whose process dies is started again (``workflow.supervisor``)
            supervisor = Supervisor(cfg, pipe, reporter)
            # Prompts go in one step ahead of what rollout may generate under the staleness bound.
            feeder.wait(supervisor.start(start, wf.steps), reporter.collect,
                        ahead=lambda: reporter.trained_steps + wf.max_staleness + 2, recover=supervisor.recover)
            reporter.extra_summary["service_restarts"] = supervisor.events
        return reporter.finish()
    except BaseException as exc:
        pipe.abort(f"{type(exc).__name__}: {exc}")
        explained = pipe.explain(exc)
        if explained is not exc:
            raise explained from exc
        raise
    finally:
        if reporter is not None:
            reporter.observer.close()  # after a failure: still flush metrics and write the timeline
        pipe.close()


def _prompt_source(cfg: AsyncFlowConfig, model_dir: Path):
    from transformers import AutoTokenizer

    from asyncflow.data import make_prompt_source

    wf = cfg.workflow
    return make_prompt_source(wf.task, AutoTokenizer.from_pretrained(model_dir), wf.seed, cfg.data)
