"""Multi-turn rollouts: the agent-loop interface and its registry (``agent.loop``).

An agent loop sees a trajectory after every model turn and answers with observation tokens to append (a
tool's output, an environment's reply) or ``None`` when the trajectory is done. vLLM generates between
turns; a turn ends at the model's end-of-sequence, at one of the loop's ``stop_token_ids`` (a tool call)
or when the trajectory's token budget (``rollout.max_new_tokens``) is spent. Observation tokens are part
of the response the trainer sees, but its loss mask is 0 there: only the model's own tokens are trained.

    prompt ─► vLLM turn ─► loop.observe(trajectory) ─► observation tokens ─► vLLM turn ─► ... ─► None: done

Rewards: the reward function scores the whole trajectory at its end. A loop may also reward each model turn
(``turn_reward``, e.g. a well-formed tool call or an environment's step reward); the turn rewards of a
trajectory are summed into its reward, since GRPO-style advantages take one scalar per sample.

Register a loop with ``@AGENT_LOOPS.register("name")`` on a factory ``factory(tokenizer) -> AgentLoop``,
or give a dotted path to such a factory for code outside the repository (the built-in ``calculator`` is
named by its dotted path, so this package never imports its loops). A loop that raises ends its
trajectory; the sample gets ``algorithm.reward_on_error`` and the failure is counted (the run goes on).

Calls run off the engine loop (``asyncflow.agents.calls``): when a turn ends, ``turn_reward`` and ``observe``
run in a worker (a thread, or a coroutine when ``observe`` is ``async def``; ``agent.tool_workers`` at once)
while the engine goes on stepping the other sequences, and the trajectory's next turn starts once the call
returns. So ``observe`` may be called from several threads at once: keep a loop's shared state thread-safe.
A call not answered within ``agent.tool_timeout_s`` ends its trajectory like a raising loop
(``algorithm.reward_on_error``), counted in ``agent/tool_timeouts``.

What a loop sees: the token ids, the prompt row's other fields (``Trajectory.metadata``: ``ground_truth``,
``data_source``, ``extra_info`` where the data carries them) and the decoded text (``prompt_text``,
``response_text``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from asyncflow.registry import Registry

AGENT_LOOPS = Registry("agent loop", builtins={"calculator": "asyncflow.agents.calculator:make_calculator"})


@dataclasses.dataclass
class Trajectory:
    """One sample's trajectory so far, as the agent loop sees it after a model turn."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Every token after the prompt: model turns and the observations between them."""
    loss_mask: list[int]
    """Per response token: 1 if the model generated it, 0 for observation tokens."""
    turns: int
    """Model turns completed (1 after the first)."""
    finish_reason: str | None
    """Why the last turn ended (``stop``: end-of-sequence or a stop token; ``length``: the budget)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The prompt row's fields besides its token ids, where the data carries them: ``ground_truth``,
    ``data_source``, ``extra_info`` (the same values the reward function is given)."""
    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The model's tokenizer (the rollout gives it), which ``prompt_text`` and ``response_text`` decode with."""

    @functools.cached_property
    def prompt_text(self) -> str:
        """The prompt, decoded (special tokens kept), on first use."""
        return self._decode(self.prompt_ids)

    @functools.cached_property
    def response_text(self) -> str:
        """Every response token so far (model turns and observations), decoded (special tokens kept), on first
        use: a tool parser reads the model's call at its end."""
        return self._decode(self.response_ids)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this trajectory has no tokenizer to decode its text with (the rollout gives one)")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class AgentLoop:
    """The interface: ``stop_token_ids`` end a model turn; ``observe`` decides what comes next."""

    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a model turn (the model's tool call), besides end-of-sequence."""

    def observe(self, trajectory: Trajectory) -> list[int] | None:
        """Observation tokens to append after the model's last turn, or None when the trajectory is done. May be
        ``async def`` (awaited on an event-loop thread; it must not block it). Not asked after the turn that
        reaches ``agent.max_turns``."""
        raise NotImplementedError

    def turn_reward(self, trajectory: Trajectory) -> float:
        """Reward for the model's last turn (called after every model turn, before ``observe``); optional, 0 by
        default. The trajectory's turn rewards are added to its end-of-trajectory reward."""
        return 0.0


METADATA_KEYS = ("ground_truth", "data_source", "extra_info")
"""The row fields an agent loop sees (``Trajectory.metadata``), as the reward function does."""


def row_metadata(answer: Any) -> dict[str, Any]:
    """A row's ``Trajectory.metadata`` from its ``ground_truth`` field: a plain answer, or the dict the data
    source makes of a row with ``data_source``/``extra_info`` (``asyncflow.data.datasets``). Absent fields
    (None) are left out."""
    if isinstance(answer, dict) and "ground_truth" in answer and set(answer) <= set(METADATA_KEYS):
        return {k: v for k, v in answer.items() if v is not None}
    return {} if answer is None else {"ground_truth": answer}


def make_agent_loop(spec: str, tokenizer) -> AgentLoop:
    """Build agent loop ``spec`` (registered factory name or dotted path to ``factory(tokenizer)``)."""
    return AGENT_LOOPS.resolve(spec)(tokenizer)
