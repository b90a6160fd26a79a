"""Calling a reward function in whichever shape it has: per row or batched, sync or ``async def``, on token ids or
on text (verl's signature).

The shape is read from the function's parameters (``inspect``), so user code is taken as written:

| parameters                                            | called with                                         |
|-------------------------------------------------------|-----------------------------------------------------|
| ``prompt_ids, response_ids, **info``                  | one row's token ids; ``info`` what the row carries |
| ``data_source, solution_str, ground_truth, extra_info`` | verl's ``compute_score``: the decoded response     |
| ``data_sources, solution_strs, ground_truths, extra_infos`` | verl's batched ``compute_score``: lists        |

A token-id function is batched (lists in, list out) when ``reward.batched`` is true or it is decorated with
:func:`batched`. Any of them may be ``async def``: per-row coroutines of a chunk are awaited together, at most
``reward.max_concurrency`` at once. A reward is a number, or a dict with ``"score"`` and further numbers that are
reported as metrics (``reward/extra/<name>``, averaged over the rows).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncflow.rewards.config import RewardConfig

VERL_ROW = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
ROW_INFO = ("ground_truth", "data_source", "extra_info")
"""What a row may carry besides its token ids (from the prompt source, through the TransferQueue)."""


def batched(fn: Callable) -> Callable:
    """Declare ``fn`` batched: it takes lists (``prompt_ids``, ``response_ids`` and each info key, one entry per
    row) and returns a list of rewards, one per row."""
    fn.batched = True
    return fn


@dataclass
class RewardRow:
    """One response to score, with what its prompt's dataset row carries."""

    prompt_ids: list[int]
    response_ids: list[int]
    ground_truth: Any = None
    data_source: str | None = None
    extra_info: dict | None = None
    info_keys: tuple[str, ...] = field(default=(), repr=False)
    """The info fields the prompt source provided (only those are passed to token-id functions)."""

    @classmethod
    def of(cls, prompt_ids: list[int], response_ids: list[int], answer: Any = None, has_answer: bool = True):
        """A row from its TransferQueue fields: ``answer`` is the plain reference answer, or the dict
        ``{"ground_truth", "data_source", "extra_info"}`` of a dataset row that has them
        (``asyncflow.data.datasets.row_answer``); ``has_answer`` False: the source gives no answers."""
        if not has_answer:
            return cls(prompt_ids, response_ids)
        if isinstance(answer, dict):
            return cls(prompt_ids, response_ids, answer.get("ground_truth"), answer.get("data_source"),
                       answer.get("extra_info"), ROW_INFO)
        return cls(prompt_ids, response_ids, answer, info_keys=("ground_truth",))


@dataclass
class Scored:
    """A row's reward, the extra numbers its function returned, and the error when the function raised."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def params(fn: Callable) -> dict[str, inspect.Parameter]:
    """``fn``'s parameters (a callable object's ``__call__``'s); empty when Python cannot tell."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def shape_of(fn: Callable) -> str:
    """``verl``, ``verl_batch`` or ``tokens``: how ``fn`` takes its rows (see the module docstring)."""
    names = params(fn)
    if "solution_strs" in names:
        return "verl_batch"
    if "solution_str" in names:
        return "verl"
    return "tokens"


def is_async(fn: Callable) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def`` function or object)."""
    return inspect.iscoroutinefunction(fn if inspect.isroutine(fn) else type(fn).__call__)


def _as_scored(value: Any) -> Scored:
    """A function's return value as a :class:`Scored` (a dict needs ``"score"``)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a reward returned as a dict needs a 'score' key; got keys {sorted(value)}")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        return Scored(float(value["score"]), extra)
    return Scored(float(value))


class RewardScorer:
    """Scores chunks of rows with one reward function; a function that raises fails only its rows (the whole
    chunk for a batched function), which get ``reward_on_error`` and the message."""

    def __init__(self, fn: Callable, tokenizer, cfg: RewardConfig | None = None, reward_on_error: float = 0.0):
        self.fn, self.tokenizer = fn, tokenizer
        self.cfg = cfg or RewardConfig()
        self.reward_on_error = reward_on_error
        self.shape = shape_of(fn)
        self.batched = self.shape == "verl_batch" or (self.shape == "tokens" and
                                                      (self.cfg.batched or getattr(fn, "batched", False)))
        self.is_async = is_async(fn)
        accepted = params(fn)
        self.any_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        self.accepted = set(accepted)
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        """Close the function (its ``close()``, if it has one: a client, a model) and the event loop of ``async``
        rewards."""
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _run(self, coroutine):
        # One loop for the scorer's life: a user's async client bound to it keeps working from chunk to chunk.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _info(self, row: RewardRow) -> dict:
        """The row's info for a token-id function: what the source gave, as far as the function accepts it."""
        return {k: getattr(row, k) for k in row.info_keys if self.any_kwargs or k in self.accepted}

    def _row_call(self, row: RewardRow):
        if self.shape == "verl":
            return self.fn(row.data_source, self._text(row.response_ids), row.ground_truth, extra_info=row.extra_info)
        return self.fn(row.prompt_ids, row.response_ids, **self._info(row))

    def _batch_call(self, rows: list[RewardRow]):
        if self.shape == "verl_batch":
            return self.fn(data_sources=[r.data_source for r in rows],
                           solution_strs=[self._text(r.response_ids) for r in rows],
                           ground_truths=[r.ground_truth for r in rows], extra_infos=[r.extra_info for r in rows])
        info = {k: [getattr(r, k) for r in rows] for k in (rows[0].info_keys if rows else ())
                if self.any_kwargs or k in self.accepted}
        return self.fn([r.prompt_ids for r in rows], [r.response_ids for r in rows], **info)

    def _failed(self, exc: BaseException) -> Scored:
        return Scored(self.reward_on_error, error=f"{type(exc).__name__}: {exc}")

    def score(self, rows: list[RewardRow]) -> list[Scored]:
        """One :class:`Scored` per row, in order."""
        if not rows:
            return []
        if self.batched:
            return self._score_batch(rows)
        if self.is_async:
            return self._run(self._score_async(rows))
        out = []
        for row in rows:
            try:
                out.append(_as_scored(self._row_call(row)))
            except Exception as exc:  # noqa: BLE001 - one bad sample (or a bug in user code) must not stop the run
                out.append(self._failed(exc))
        return out

    def _score_batch(self, rows: list[RewardRow]) -> list[Scored]:
        try:
            values = self._batch_call(rows)
            if self.is_async:
                values = self._run(values)
            values = list(values)
            if len(values) != len(rows):
                raise ValueError(f"the batched reward returned {len(values)} rewards for {len(rows)} rows")
            return [_as_scored(v) for v in values]
        except Exception as exc:  # noqa: BLE001 - the chunk fails, the run goes on
            return [self._failed(exc)] * len(rows)

    async def _score_async(self, rows: list[RewardRow]) -> list[Scored]:
        limit = asyncio.Semaphore(max(1, self.cfg.max_concurrency))

        async def one(row: RewardRow) -> Scored:
            async with limit:
                try:
                    return _as_scored(await self._row_call(row))
                except Exception as exc:  # noqa: BLE001 - isolation per row
                    return self._failed(exc)

        return list(await asyncio.gather(*(one(r) for r in rows)))
