"""How a rollout engine turns prompts into finished responses over time (a registry of models).

A model is a function ``serve(pipe, instance, step)``: a simulator process that pulls the step's prompt
rows from the simulated TransferQueue, spends time on the instance's device and puts each response back
when it finishes. ``chunked`` is today's loop (``RolloutService.run_step``): take ``rollout_chunk`` rows,
run them as one engine batch (at most ``max_num_seqs`` at once, the rest admitted as slots free), stream
each response out as it finishes, then take the next chunk. A continuous-batching model (the engine kept
full across chunks, partial rollout) registers beside it with the same signature.

The engine is simulated step by step from ``RolloutCosts``: a step prefills the sequences admitted in it
and decodes one token for every running sequence; steps in which nothing finishes are merged into one
device job, so a chunk costs a few jobs, not one per token.
"""

from __future__ import annotations

from collections.abc import Generator

from asyncflow.registry import Registry
from asyncflow.simulator.costs import RolloutCosts

ROLLOUT_MODELS = Registry("rollout model")


def engine_batch(lengths: list[int], prompt_len: int, costs: RolloutCosts, max_seqs: int
                 ) -> list[tuple[float, list[int]]]:
    """Segments ``(seconds, finished row positions)`` of one engine batch over ``lengths`` (tokens per row).

    A row admitted at a step gets its first token from that step's prefill and finishes ``length - 1`` decode
    steps later; rows wait in arrival order for one of ``max_seqs`` slots. Runs of decode steps without an
    admission are summed in closed form (the attended context grows by one token per running row per step),
    so a batch costs one iteration per finish event, not one per token.
    """
    waiting = list(range(len(lengths)))
    running: dict[int, int] = {}  # row -> tokens generated so far
    segments: list[tuple[float, list[int]]] = []
    work = 0.0
    while waiting or running:
        admitted = waiting[: max(max_seqs - len(running), 0)]
        waiting = waiting[len(admitted):]
        batch, ctx = len(running) + len(admitted), sum(prompt_len + done for done in running.values())
        if admitted:  # one engine step: prefill the admitted rows (their first token), decode the others
            steps = 1
            work += (costs.step_s + costs.per_seq_s * batch + costs.per_ctx_token_s * ctx
                     + (costs.prefill_per_token_s * prompt_len + costs.per_request_s) * len(admitted))
        else:  # decode steps up to the next finish: context ctx, ctx + B, ctx + 2B, ...
            steps = min(lengths[row] - done for row, done in running.items())
            work += (steps * (costs.step_s + costs.per_seq_s * batch)
                     + costs.per_ctx_token_s * (steps * ctx + batch * steps * (steps - 1) / 2))
        for row in running:
            running[row] += steps
        for row in admitted:
            running[row] = 1
        finished = [row for row, done in running.items() if done >= lengths[row]]
        if finished:
            for row in finished:
                del running[row]
            segments.append((work, finished))
            work = 0.0
    return segments


@ROLLOUT_MODELS.register("chunked")
def chunked(pipe, instance: int, step: int) -> Generator:
    """Today's loop: one engine batch per ``rollout_chunk`` rows; responses stream out as they finish."""
    w = pipe.w
    device = pipe.device("rollout", instance)
    while True:
        rows = yield pipe.tq.take(step, "rollout", w.rollout_chunk)
        if not rows:
            return
        start = pipe.sim.now
        lengths = [pipe.lengths[step][r] for r in rows]
        get = pipe.costs.queue.request(len(rows) * w.prompt_len * 8)
        yield from pipe.work(device, get, pipe.costs.service.generate_token_s * sum(lengths))
        for seconds, finished in engine_batch(lengths, w.prompt_len, pipe.costs.rollout, w.max_num_seqs):
            done = [rows[i] for i in finished]
            # The loop puts finished rows a few at a time (16 per put): tokens and logprobs, 12 bytes a token.
            put = pipe.costs.queue.request(sum(pipe.lengths[step][r] for r in done) * 12) * max(len(done) / 16, 1)
            yield device.run(seconds + put)
            pipe.tq.put(step, "response", done, version=pipe.served[instance])
        pipe.span("rollout", "generate", instance, start, rows=len(rows))
