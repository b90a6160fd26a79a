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
"""

from __future__ import annotations

import dataclasses

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


class AgentLoop:
    """The interface: ``stop_token_ids`` end a model turn; ``observe`` decides what comes next."""

    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a model turn (the model's tool call), besides end-of-sequence."""

    def observe(self, trajectory: Trajectory) -> list[int] | None:
        """Observation tokens to append after the model's last turn, or None when the trajectory is done."""
        raise NotImplementedError

    def turn_reward(self, trajectory: Trajectory) -> float:
        """Reward for the model's last turn (called after every model turn, before ``observe``); optional, 0 by
        default. The trajectory's turn rewards are added to its end-of-trajectory reward."""
        return 0.0


def make_agent_loop(spec: str, tokenizer) -> AgentLoop:
    """Build agent loop ``spec`` (registered factory name or dotted path to ``factory(tokenizer)``)."""
    return AGENT_LOOPS.resolve(spec)(tokenizer)
