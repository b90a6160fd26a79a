"""The RL loop: one function for both modes.

    prompts ─► TQ[step s] ─► rollout (vLLM, weights v) ─► reward ─► advantage ─┐
                         └─────────────────────────────► reference ───────────┤
                                                                               ▼
           weights v+1 ◄──── version board ◄──── actor update (Megatron) ◄─ TQ rows
                 │
                 └─► rollout admits step s only when weights v >= s - k exist, so a sample made
                     with version v is trained at step s <= v + k   (k = workflow.max_staleness)

    async: every service loops over steps on its own; rollout of step s+k overlaps training of step s.
    sync:  the driver runs the same services one after another per step (the colocated baseline).
"""

from __future__ import annotations

from pathlib import Path

from asyncflow.config import AsyncFlowConfig


def train(cfg: AsyncFlowConfig) -> dict:
    """Run ``cfg.workflow.steps`` RL steps; return the summary (also written to the output dir)."""
    import ray
    from transformers import AutoTokenizer

    from asyncflow.data import make_prompt_source, next_batch
    from asyncflow.workflow.pipeline import start_pipeline
    from asyncflow.workflow.reporting import Reporter

    wf = cfg.workflow
    model_dir = _model_dir(cfg)
    source = make_prompt_source(wf.task, AutoTokenizer.from_pretrained(model_dir), wf.seed, cfg.data)
    budgets = hasattr(source, "sample_budgets")
    pipe = start_pipeline(cfg, model_dir, source.max_prompt_len, budgets, answers=hasattr(source, "next_batch"))
    fed, reporter = 0, None
    try:
        pipe.create_partitions(wf.steps, wf.prompts_per_step * wf.samples_per_prompt)
        reporter = Reporter(cfg, pipe)

        def feed_until(step: int) -> None:
            nonlocal fed
            while fed < min(step, wf.steps):
                rows = wf.prompts_per_step * wf.samples_per_prompt
                prompts, answers = next_batch(source, wf.prompts_per_step)
                pipe.feed(fed, prompts, wf.samples_per_prompt,
                          source.sample_budgets(rows, cfg.rollout.max_new_tokens) if budgets else None, answers)
                fed += 1

        if wf.mode == "sync":
            for step in range(wf.steps):
                feed_until(step + 1)
                # Lock-step: each task (all its instances or ranks at once) finishes the step before the next.
                for group in pipe.groups.values():
                    reports = ray.get([handle.run_step.remote(step) for handle in group])
                    reporter.collect([r for r in reports if r is not None])
        else:
            running = [s.run.remote(0, wf.steps) for s in pipe.services]
            while running:
                # Prompts go in one step ahead of what rollout may generate under the staleness bound.
                feed_until(reporter.trained_steps + wf.max_staleness + 2)
                done, running = ray.wait(running, timeout=0.2)
                ray.get(done)  # re-raises a service's failure here
                reporter.collect()
        return reporter.finish()
    finally:
        if reporter is not None:
            reporter.observer.close()  # after a failure: still flush metrics and write the timeline
        pipe.close()


def _model_dir(cfg: AsyncFlowConfig) -> Path:
    from asyncflow.tiny_model import make_tiny_model

    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        if not cfg.model.make_tiny_if_missing:
            raise FileNotFoundError(f"model.path {model_dir} has no config.json")
        make_tiny_model(model_dir, family=cfg.model.tiny_family, charset=cfg.model.tiny_charset)
        print(f"created a tiny {cfg.model.tiny_family} model at {model_dir}", flush=True)
    return model_dir


