"""The driver's prompt feeder: first rounds ahead of the services, top-up rounds under dynamic sampling.

Every draw from the prompt stream is logged as ``(step, count, first_round)``. A checkpoint after ``n``
steps saves the stream's cursor from before step ``n``'s first prompts plus the draws made since then;
in async mode those include prompts already fed to later steps and, with dynamic sampling, top-ups of
earlier steps. A resumed run restores the cursor and replays the logged draws in order: draws for steps
below ``n`` (already trained) are discarded, the others go to the same steps as before. So the stream
is consumed exactly as it was, no prompt is trained twice and none is skipped, and the driver keeps
feeding ahead of the services.
"""

from __future__ import annotations

import math

from asyncflow.config import AsyncFlowConfig
from asyncflow.workflow.supervisor import restartable


class Feeder:
    """Puts prompts into the TransferQueue: a step's first round, then (dynamic sampling) top-up rounds."""

    def __init__(self, cfg: AsyncFlowConfig, pipe, source, ckpt, start: int, replay: list | None = None):
        from asyncflow.workflow.sampling import DynamicSampling

        self.cfg, self.pipe, self.source, self.ckpt = cfg, pipe, source, ckpt
        wf = cfg.workflow
        self.fed = start
        self.sampling = (DynamicSampling(wf.prompts_per_step, wf.samples_per_prompt,
                                         cfg.algorithm.max_sampling_factor)
                         if cfg.algorithm.dynamic_sampling else None)
        for step, count, first in replay or []:
            if first and step >= start:
                self.ckpt.before_feed(step)
            self.feed(step, count, first, keep=step >= start)
            if first and step >= start:
                self.fed = max(self.fed, step + 1)

    def feed(self, step: int, count: int, first: bool = False, keep: bool = True) -> None:
        """Draw ``count`` prompts (a group of ``samples_per_prompt`` each) for ``step`` and put them, unless
        ``keep`` is False (a replayed draw of a step the checkpoint already trained)."""
        from asyncflow.data import next_batch

        wf = self.cfg.workflow
        prompts, answers = next_batch(self.source, count)
        budgets = None
        if hasattr(self.source, "sample_budgets"):
            budgets = self.source.sample_budgets(count * wf.samples_per_prompt, self.cfg.rollout.max_new_tokens)
        self.ckpt.log_draw(step, count, first)
        if not keep:
            return
        first_group = None
        if self.sampling is not None:
            first_group = self.sampling.next_group_id(step)
            self.sampling.fed(step, count)
        self.pipe.feed(step, prompts, wf.samples_per_prompt, budgets, answers, first_group=first_group)

    def feed_until(self, step: int) -> None:
        """First rounds of every step below ``step``."""
        while self.fed < min(step, self.cfg.workflow.steps):
            self.ckpt.before_feed(self.fed)
            self.feed(self.fed, self.cfg.workflow.prompts_per_step, first=True)
            self.fed += 1

    def top_up(self) -> None:
        """Dynamic sampling: feed the rounds the advantage task's judgements call for; seal full steps."""
        import ray

        if self.sampling is None:
            return
        self.sampling.progress(ray.get(self.pipe.board.take_sampling.remote()))
        more, full = self.sampling.plan()
        for step, count in more.items():
            self.feed(step, count)
        for step in full:
            self.pipe.seal(step)

    def wait(self, refs: list, collect, ahead=None, sync: bool = False, until=None, recover=None,
             more=None, wake=None) -> list:
        """Wait for ``refs`` (service loops or phases), feeding, topping up and collecting reports meanwhile, or
        until ``until()`` holds (a stop on a signal); returns the refs not done. ``recover(ref, exc)``: the ref
        that replaces a failed one (a restarted service loop; None: none does), or it raises. ``more()``: refs to wait
        on too from now on (service loops started meanwhile: rollout instances added on request); ``wake()``: refs
        whose answer ends a wait early, so that ``more`` sees it at once (a promoted spare's first answer)."""
        import ray

        while refs and not (until is not None and until()):
            if ahead is not None:
                self.feed_until(ahead())
            self.top_up()
            if more is not None:
                refs = refs + more()
            woken = wake() if wake is not None else []
            ready, _ = ray.wait(refs + woken, num_returns=1, timeout=0.2)
            if ready:  # every loop that is done, not only the one that woke the wait
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            finished = set(ready)
            done, refs = ready, [r for r in refs if r not in finished]
            results = []
            for ref in done:
                try:
                    results.append(ray.get(ref))  # re-raises a service's failure here
                except Exception as exc:
                    if recover is None:
                        raise
                    refs.extend(r for r in [recover(ref, exc)] if r is not None)
            if sync:
                collect([r for r in results if isinstance(r, dict)])
            else:
                collect()
        return refs


class StreamFeeder(Feeder):
    """The sample stream's prompts (``workflow.mode: stream``): one partition of prompts that belong to no step yet.

    The driver keeps ``(max_staleness + 2) x prompts_per_step`` prompts fed and not yet claimed by a step (in the
    stream or in an engine), so every engine can fill its reservations; group ids count the prompts in stream
    order. Under dynamic sampling it seals each step once the advantage task has kept its groups.

    What goes through the stream as one is a unit (``config_rules.stream_unit``): a prompt's whole group, or, for an
    estimator that scores a response alone, one response (each prompt is then fed as ``samples_per_prompt`` units of
    one). Group ids count the units, and everything below (depth, claims, checkpoints) counts units.

    A checkpoint after step ``n`` holds the prompt stream's cursor past every prompt fed so far and the prompts fed
    but not trained in steps below ``n`` (``stream_pending``: in the stream, in an engine, or in a later step's
    partition); a resumed run feeds those first, with their group ids, then goes on from the cursor. So no prompt
    is trained twice and none is skipped (a prompt dynamic sampling dropped may come back once).

    When rollout instances are restarted (``supervisor.restartable``) it also makes each step's rows ahead of the
    open step, one ``stream_slot`` field each: the ledger gives every claimed group a slot of its step, and rollout
    writes the group into that slot's rows, once (``sample_stream``).
    """

    def __init__(self, cfg: AsyncFlowConfig, pipe, source, ckpt, start: int, meta: dict | None = None):
        import ray

        from asyncflow.config_rules import stream_unit

        super().__init__(cfg, pipe, source, ckpt, start)
        wf = cfg.workflow
        self.unit = stream_unit(cfg)  # responses per unit: samples_per_prompt, or 1
        self.copies = wf.samples_per_prompt // self.unit  # units a drawn prompt makes
        self.units_per_step = wf.prompts_per_step * self.copies
        self.sampling = None  # the ledger on the board places groups; nothing is fed into a step
        self.dynamic = cfg.algorithm.dynamic_sampling
        self.target = wf.prompts_per_step * wf.samples_per_prompt
        self.sealed: set[int] = set()
        self.fed: dict[int, list] = {}  # group id -> [prompt, answer, budgets] of every unit not known trained
        meta = meta or {}
        if int(meta.get("stream_unit", self.unit)) != self.unit:  # its pending records hold units of another size
            from asyncflow.config_loader import ConfigError

            raise ConfigError(f"the checkpoint's sample stream moved units of {meta['stream_unit']} responses, this "
                              f"run's of {self.unit} (workflow.stream_unit, algorithm.advantage): resume with the "
                              "settings the checkpoint was made with")
        self.next_group = int(meta.get("stream_next_group", 0))
        pending = meta.get("stream_pending", [])
        # The board's ledger counts the claims of this run only: the groups this run fed are the pending ones and
        # those from the checkpoint's cursor on (a resumed run that compared the cursor itself with its claims
        # would feed nothing new, and hang once its pending prompts were fewer than its steps need).
        self.base = self.next_group - len(pending)
        for gid, prompt, answer, budgets in pending:
            self._put([gid], [prompt], None if answer is None else [answer], budgets)
        ckpt.extra = self.checkpoint_meta
        spare = math.ceil(wf.stream_spare * self.units_per_step)
        ray.get(pipe.board.stream_setup.remote(start, wf.steps, self.units_per_step, self.unit, wf.max_staleness,
                                               spare))
        self.slots = "rollout" in restartable(cfg)
        self.slotted = start  # the first step whose slot rows are not made yet
        self._make_slots(start)

    def feed_until(self, step: int) -> None:
        """Top the stream up to its depth (``step`` is not used: the stream's prompts belong to no step)."""
        import ray

        from asyncflow.data import next_batch

        wf = self.cfg.workflow
        state = ray.get(self.pipe.board.stream_state.remote())
        self._make_slots(state["open"])
        while state["open"] < wf.steps and \
                self.next_group - self.base - state["claimed"] < (wf.max_staleness + 2) * self.units_per_step:
            count = wf.prompts_per_step
            prompts, answers = next_batch(self.source, count)
            budgets = None
            if hasattr(self.source, "sample_budgets"):
                budgets = self.source.sample_budgets(count * wf.samples_per_prompt, self.cfg.rollout.max_new_tokens)
            # One unit per response when the stream takes responses one by one: a prompt's copies follow each other.
            prompts = [p for p in prompts for _ in range(self.copies)]
            answers = None if answers is None else [a for a in answers for _ in range(self.copies)]
            units = len(prompts)
            self._put(list(range(self.next_group, self.next_group + units)), prompts, answers, budgets)
            self.next_group += units

    def _make_slots(self, open_step: int) -> None:
        """Make the slot rows of the steps a claim can reach before the next call: claims go to the open step, and
        rollout runs at most ``max_staleness + 1`` steps ahead of training (a put that finds none waits for them)."""
        import torch

        from asyncflow.workflow.partitions import partition_name

        wf = self.cfg.workflow
        if not self.slots:
            return
        rows = wf.prompts_per_step * wf.samples_per_prompt
        for step in range(self.slotted, min(open_step + wf.max_staleness + 3, wf.steps)):
            self.pipe.client.put(partition_name(step), {"stream_slot": torch.arange(rows)})
            self.slotted = step + 1

    def _put(self, gids: list[int], prompts: list, answers: list | None, budgets: list | None) -> None:
        """Put units with consecutive group ids ``gids`` into the stream (each a prompt and ``unit`` budgets) and
        remember them until trained."""
        from asyncflow.workflow.partitions import STREAM_PARTITION

        n = self.unit
        for i, gid in enumerate(gids):
            self.fed[gid] = [[int(t) for t in prompts[i]], None if answers is None else answers[i],
                             None if budgets is None else [int(b) for b in budgets[i * n:(i + 1) * n]]]
        self.pipe.feed(0, prompts, n, budgets, answers, first_group=gids[0], partition=STREAM_PARTITION)

    def checkpoint_meta(self, trained_groups: dict[int, list[int]]) -> dict:
        """The stream's part of a checkpoint taken once the steps of ``trained_groups`` are trained."""
        for groups in trained_groups.values():
            for gid in groups:
                self.fed.pop(gid, None)
        return {"stream_next_group": self.next_group, "stream_unit": self.unit,
                "stream_pending": [[gid, *record] for gid, record in sorted(self.fed.items())]}

    def top_up(self) -> None:
        """Dynamic sampling: seal every step whose groups the advantage task has kept."""
        import ray

        if not self.dynamic:
            return
        for step, (kept, _) in ray.get(self.pipe.board.take_sampling.remote()).items():
            if kept >= self.target and step not in self.sealed:
                self.sealed.add(step)
                self.pipe.seal(step)
