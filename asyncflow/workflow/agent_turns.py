"""Multi-turn trajectories on a rollout stream (``agent.loop``), shared by the step-tied continuous loop
(``asyncflow.workflow.rollout_stream``) and the sample stream (``asyncflow.workflow.sample_stream``).

    engine stream ── a turn ends ──► finished(key, sample) ──► its agent-loop call runs in a worker
          ▲                                                    (``asyncflow.agents.calls``)
          └── continue_turn(key, observation) ◄── ready(): observation ──┤
                                                   done / failed / timed out ──► Ended (the trajectory's last
                                                                                 sample, failure, turn rewards)

A trajectory waiting for its call is out of the engine but not done: the loop that drives the stream counts it as
work in flight (``len``), so weights change under it only with partial rollout, as under a sequence being generated.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from asyncflow.agents import Trajectory, row_metadata


@dataclass
class Ended:
    """One trajectory that ended: its last turn's sample (every turn, observations masked out of the loss), whether
    its agent loop failed (raised, ``error``, or did not answer within agent.tool_timeout_s, ``timed_out``), the sum
    of its turn rewards and how many observations were appended."""

    key: Hashable
    sample: object
    error: bool = False
    timed_out: bool = False
    turn_reward: float = 0.0
    observations: int = 0

    @property
    def failed(self) -> bool:
        """Its reward becomes algorithm.reward_on_error."""
        return self.error or self.timed_out


class AgentTurns:
    """The agent loop's side of one rollout stream: the calls in flight and the trajectories waiting for them."""

    def __init__(self, service, stream):
        from asyncflow.agents.calls import AgentCalls

        self.svc, self.stream = service, stream
        self.stop = tuple(service.agent.stop_token_ids)
        self.calls = AgentCalls(service.agent, service.agent_cfg.tool_workers, service.agent_cfg.tool_timeout_s)
        self.meta: dict = {}  # key -> the prompt row's metadata (an agent loop sees the reference answer)
        self.waiting: dict = {}  # key -> the sample of a finished turn whose call runs
        self.rewards: dict = {}  # key -> the sum of its turn rewards so far
        self.observed: dict = {}  # key -> observations appended so far
        self.errors = self.timeouts = 0

    def __len__(self) -> int:
        """Trajectories waiting for their agent-loop call."""
        return len(self.waiting)

    def add(self, key: Hashable, prompt: list[int], budget: int | None, answer) -> None:
        """Start ``key``'s trajectory in the stream; ``answer``: its row's ``ground_truth`` (or None)."""
        self.stream.add(key, prompt, budget, stop_token_ids=self.stop)
        self.meta[key] = row_metadata(answer)

    def finished(self, key: Hashable, sample) -> None:
        """``key``'s turn ended: start the call (``turn_reward``, then ``observe`` unless the turn limit is
        reached); ``ready`` hands back its outcome."""
        trajectory = Trajectory(sample.prompt_ids, sample.response_ids, sample.loss_mask, sample.turns,
                                sample.finish_reason, metadata=self.meta.get(key, {}), tokenizer=self.svc.tokenizer)
        self.waiting[key] = sample
        self.calls.submit(key, trajectory, ask=sample.turns < self.svc.max_turns)

    def ready(self, wait_s: float = 0.0) -> list[Ended]:
        """Continue the trajectories whose calls gave an observation; the others ended: answered done, failed or
        timed out (a loop that raises, or a call past agent.tool_timeout_s, ends its trajectory)."""
        ended = []
        for key, out in self.calls.ready(wait_s):
            sample = self.waiting.pop(key)
            self.rewards[key] = self.rewards.get(key, 0.0) + out.turn_reward
            if out.timed_out:
                self.timeouts += 1
                if self.timeouts == 1:
                    print(f"rollout {self.svc.worker}: an agent-loop call took longer than agent.tool_timeout_s="
                          f"{self.calls.timeout_s}; the sample gets algorithm.reward_on_error", flush=True)
            elif out.error is not None:
                self.errors += 1
                if self.errors == 1:
                    print(f"rollout {self.svc.worker}: agent loop failed ({type(out.error).__name__}: {out.error}); "
                          f"the sample gets algorithm.reward_on_error", flush=True)
            elif out.observation and self.stream.continue_turn(key, list(out.observation)):
                self.observed[key] = self.observed.get(key, 0) + 1
                continue
            self.stream.release(key)
            ended.append(Ended(key, sample, out.error is not None, out.timed_out, self.rewards.pop(key, 0.0),
                               self.observed.pop(key, 0)))
            self.meta.pop(key, None)
        return ended

    def drop(self, keys) -> None:
        """Forget these trajectories (their groups were dropped with the engine's sequences): their calls' outcomes
        are never read, and a key may start again."""
        for key in keys:
            self.calls.drop(key)
            self.stream.release(key)
            for held in (self.meta, self.waiting, self.rewards, self.observed):
                held.pop(key, None)

    def close(self) -> None:
        """Stop the workers (calls still running are dropped)."""
        self.calls.close()


def row_fields(ended: list[Ended]) -> dict:
    """The multi-turn fields of the rows put for ``ended``: the loss mask (observations are not the model's),
    whether the agent loop failed, and the turn rewards."""
    return {"loss_mask": [torch.tensor(e.sample.loss_mask, dtype=torch.float) for e in ended],
            "agent_error": torch.tensor([float(e.failed) for e in ended]),
            "turn_reward": torch.tensor([e.turn_reward for e in ended], dtype=torch.float)}


@dataclass
class TurnStats:
    """The multi-turn counts of the rows a step's report describes."""

    rows: int = 0
    turns: int = 0
    observations: int = 0
    errors: int = 0
    timeouts: int = 0
    turn_reward: float = 0.0

    def add(self, ended: Ended) -> None:
        """Count one trajectory that was put."""
        self.rows += 1
        self.turns += ended.sample.turns
        self.observations += ended.observations
        self.errors += ended.error
        self.timeouts += ended.timed_out
        self.turn_reward += ended.turn_reward

    def metrics(self) -> dict:
        """``agent/*`` of the step's report."""
        rows = max(self.rows, 1)
        return {"agent/turns_mean": self.turns / rows, "agent/observations": float(self.observations),
                "agent/errors": float(self.errors), "agent/tool_timeouts": float(self.timeouts),
                "agent/turn_reward_mean": self.turn_reward / rows}


def model_token_versions(sample) -> list[int]:
    """The versions of the model's tokens of ``sample`` (observations, masked out of the loss, are not)."""
    versions = sample.token_versions or [sample.weight_version] * len(sample.response_ids)
    mask = sample.loss_mask or [1] * len(versions)
    return [v for v, m in zip(versions, mask) if m]
