"""Continuous batching on one vLLM engine: requests come and go between engine steps, with no batch barrier.

``VllmStream`` drives ``LLMEngine.step()`` itself. The caller admits a request whenever a slot is free
(``add``), steps the engine (``step``) and gets each response back the moment it finishes. Every token
records the weight version that produced it and its behaviour logprob, so a response may span a weight
update (partial rollout, ``swap_weights``).

Partial rollout recomputes the prefix: at a token boundary (between two engine steps) every in-flight
request is aborted, the new version is applied, and each request is added again with its prompt plus the
tokens generated so far as the new prompt. vLLM then prefills that prefix with the new weights, so every
later token's logprob is exactly what the new version gives for the whole sequence, which is what the
trainer computes (the alternative, keeping the KV cache of the old version, would make the next tokens
attend to keys and values no single version produced). On the tiny CPU models the extra prefill costs
little; on large models it costs one prefill of each in-flight sequence per weight update.

``rollout.partial_kv=keep`` is the other choice: the requests stay in the engine and the next engine step
runs on the new weights over the KV cache the old ones wrote (no prefill; a token's logprob is then the
probability it was sampled with, not what any single version gives for the whole sequence).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

from asyncflow.engines.base import RolloutStream, Sample, StreamRequest


class VllmStream(RolloutStream):
    """Continuous batching over a ``VllmRollout``'s engine (one caller thread; in-process or multi-process).

    ``capacity`` (default ``max_num_seqs``) is how many requests the caller should keep in flight; the
    stream itself never refuses one (vLLM queues what it cannot schedule yet).
    """

    def __init__(self, rollout, temperature: float | None = None, ignore_eos: bool = False, turns: bool = False):
        self.rollout = rollout
        self.engine = rollout.llm.llm_engine
        self.temperature = rollout.cfg.temperature if temperature is None else temperature
        self.ignore_eos = ignore_eos
        self.capacity = rollout.cfg.max_num_seqs
        self._live: dict[str, StreamRequest] = {}  # vLLM request id -> response under construction
        self._ids = itertools.count()
        self.swaps = 0
        # Multi-turn: finished turns are kept until the caller continues them (``continue_turn``) or lets go.
        self.turns = turns
        self._ended: dict[Hashable, StreamRequest] = {}
        self.resumed = 0  # requests carried across a weight swap

    def __len__(self) -> int:
        """Responses in flight (admitted, not finished)."""
        return len(self._live)

    @property
    def free(self) -> int:
        """Slots left below ``capacity``."""
        return max(self.capacity - len(self._live), 0)

    def running(self) -> int:
        """Sequences vLLM's scheduler holds in its running set right now (measured, not assumed): in-process
        engines are read directly; otherwise vLLM's own count of unfinished requests."""
        core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "running"):
            return len(scheduler.running)
        return self.engine.get_num_unfinished_requests()

    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> None:
        """Admit one response of ``prompt`` (``key`` comes back with it) at the engine's current version.
        ``max_new_tokens`` is the budget of the whole response, every turn and observation included."""
        if self.rollout.version < 0:
            raise RuntimeError("this vLLM engine holds a half-applied weight version; apply a complete version "
                               "before generating")
        budget = int(max_new_tokens or self.rollout.cfg.max_new_tokens)
        self._submit(StreamRequest(key, list(prompt), budget, stop=tuple(stop_token_ids)))

    def continue_turn(self, key: Hashable, observation: list[int]) -> bool:
        """Append ``observation`` (masked out of the loss) to the finished turn of ``key`` and generate the
        next turn. False (nothing submitted) when the budget leaves no token for the model."""
        req = self._ended.pop(key)
        req.tokens += observation
        req.logprobs += [0.0] * len(observation)
        req.versions += [self.rollout.version] * len(observation)
        req.mask += [0] * len(observation)
        if len(req.tokens) >= req.budget:
            return False
        self._submit(req)
        return True

    def release(self, key: Hashable) -> None:
        """Forget the finished turn of ``key`` (its trajectory is done)."""
        self._ended.pop(key, None)

    def _submit(self, req: StreamRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, temperature=self.temperature, max_tokens=req.budget - len(req.tokens),
                                logprobs=0, ignore_eos=self.ignore_eos, stop_token_ids=list(req.stop),
                                detokenize=False,  # token ids only: no text is read, and decoding costs time
                                output_kind=RequestOutputKind.DELTA)  # new tokens only: tagged with the version
        request_id = f"s{next(self._ids)}"
        self._live[request_id] = req
        self.engine.add_request(request_id, {"prompt_token_ids": req.prompt + req.tokens}, params)

    def step(self) -> list[tuple[Hashable, Sample]]:
        """One engine step (one token per running sequence); the responses that finished in it."""
        version = self.rollout.version
        done = []
        for out in self.engine.step():
            req = self._live.get(out.request_id)
            if req is None:
                continue
            comp = out.outputs[0]
            new = list(comp.token_ids)
            req.tokens += new
            req.logprobs += [lp[tok].logprob for lp, tok in zip(comp.logprobs, new)]
            req.versions += [version] * len(new)
            req.mask += [1] * len(new)
            if out.finished:
                del self._live[out.request_id]
                req.turns += 1
                if self.turns:
                    self._ended[req.key] = req
                done.append((req.key, self._sample(req, comp.finish_reason, out.request_id)))
        return done

    def _sample(self, req: StreamRequest, finish_reason: str | None, request_id: str) -> Sample:
        return req.to_sample(finish_reason, request_id, self.rollout.version)

    def swap_weights(self, apply: Callable[[], object], keep_kv: bool = False
                     ) -> tuple[object, list[tuple[Hashable, Sample]]]:
        """Partial rollout: stop at this token boundary, run ``apply()`` (it changes the engine's weights),
        and carry on with every in-flight response on the new weights, by recomputing its prefix or, with
        ``keep_kv``, by leaving its request and KV cache in the engine (``rollout.partial_kv``).

        Returns ``apply``'s result and the responses that already used their whole budget (nothing left
        to generate). If ``apply`` raises, the responses are resumed on whatever version the engine then
        serves (the caller decides whether to go on) and the error propagates.
        """
        if keep_kv:  # between two engine steps no forward pass runs: the next step is wholly the new version's
            self.swaps += 1
            self.resumed += len(self._live)
            return apply(), []
        live, self._live = list(self._live.items()), {}
        if live:
            self.engine.abort_request([rid for rid, _ in live])
        self.swaps += 1
        done = []
        try:
            result = apply()
        finally:
            if self.rollout.version >= 0:
                for rid, req in live:
                    if len(req.tokens) >= req.budget:
                        req.turns += 1
                        if self.turns:
                            self._ended[req.key] = req
                        done.append((req.key, self._sample(req, "length", rid)))
                    else:
                        self.resumed += 1
                        self._submit(req)
        return result, done

    def abort(self) -> int:
        """Drop every in-flight response; returns how many."""
        ids = list(self._live)
        if ids:
            self.engine.abort_request(ids)
        self._live.clear()
        return len(ids)
