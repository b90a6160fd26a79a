"""A user agent loop, prompt source and reward loaded by dotted path in tests/agents/test_tool_concurrency.py.

The loop ends every model turn after one token (every token is a stop token) and answers each call with one
observation token, so each trajectory runs exactly ``agent.max_turns`` one-token turns. Its first ``observe``
call sleeps ``SLOW_S`` and its second ``HANG_S`` (longer than the test's ``agent.tool_timeout_s``); the others
return at once. Every call appends an event line to the log file the prompt row names in its ``extra_info``
(the loop runs in the rollout's process, and finds the log only through the row's metadata).
"""

import json
import threading
import time

from asyncflow.agents import AgentLoop
from asyncflow.data.sources import Add1Prompts

SLOW_S = 2.0
HANG_S = 30.0
DATA_SOURCE = "toy"


class SlowToolLoop(AgentLoop):
    """One-token turns; the first call's tool takes ``SLOW_S``, the second's ``HANG_S``."""

    def __init__(self, tokenizer):
        self.stop_token_ids = tuple(range(len(tokenizer)))
        self.observation = [tokenizer.convert_tokens_to_ids("0")]
        self.lock = threading.Lock()
        self.calls = 0

    def _event(self, trajectory, **event) -> None:
        with self.lock, open(trajectory.metadata["extra_info"]["log"], "a") as f:
            f.write(json.dumps(event) + "\n")

    def turn_reward(self, trajectory) -> float:
        self._event(trajectory, event="turn", turns=trajectory.turns, metadata=trajectory.metadata,
                    text=trajectory.response_text, prompt_text=trajectory.prompt_text,
                    response_ids=trajectory.response_ids)
        return 0.0

    def observe(self, trajectory):
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        if call in (0, 1):
            name = "slow" if call == 0 else "hang"
            self._event(trajectory, event=f"{name}_start", ground_truth=trajectory.metadata["ground_truth"])
            time.sleep(SLOW_S if call == 0 else HANG_S)
            self._event(trajectory, event=f"{name}_end")
        return self.observation


def make_loop(tokenizer) -> SlowToolLoop:
    """Agent-loop factory."""
    return SlowToolLoop(tokenizer)


class MetadataPrompts(Add1Prompts):
    """Add-one prompts whose rows carry verl-style metadata: ground_truth (the row's place in its batch),
    data_source and extra_info (the event log's path, set by the test as ``MetadataPrompts.log``)."""

    log: str | None = None

    def next_batch(self, count: int):
        prompts = self.next_prompts(count)
        answers = [{"ground_truth": str(i), "data_source": DATA_SOURCE, "extra_info": {"log": self.log, "n": i}}
                   for i in range(count)]
        return prompts, answers


def make_prompts(tokenizer, seed: int = 0, data_cfg=None) -> MetadataPrompts:
    """Prompt-source factory."""
    return MetadataPrompts(tokenizer, seed, data_cfg)


def make_reward(tokenizer):
    """A reward that ignores the answer's shape (this test is about the agent loop)."""

    def reward(prompt_ids, response_ids, **info) -> float:
        return 0.0

    return reward
