"""The ``remote`` reward: a reward model or verifier behind an HTTP endpoint, in OpenRLHF's ``remote_rm_url`` shape.

One POST per chunk of rows, a JSON body of lists with one entry per row::

    {"query": [prompt + response text, ...], "prompts": [prompt text, ...], "labels": [ground truth, ...]}

answered by ``{"rewards": [float, ...]}`` (OpenRLHF's ``serve_rm`` answers so) or by a bare JSON list. A request
that fails (connection error, HTTP error status, ``reward.timeout_s`` passed, an answer of the wrong shape) is
tried again after ``reward.backoff_s`` seconds, doubled each time, ``reward.retries`` times; then the chunk fails
with an error naming the URL, the attempts and the last error (its rows get ``algorithm.reward_on_error``).
"""

from __future__ import annotations

import time

from asyncflow.rewards.config import RewardConfig


class RemoteRewardError(RuntimeError):
    """The endpoint did not give usable rewards after every attempt."""


class RemoteReward:
    """A batched reward function that asks ``cfg.url`` (see the module docstring)."""

    batched = True

    def __init__(self, tokenizer, cfg: RewardConfig):
        import httpx

        if not cfg.url:
            raise ValueError("algorithm.reward: remote needs reward.url (the endpoint to POST rows to)")
        self.tokenizer, self.cfg = tokenizer, cfg
        self.client = httpx.Client(timeout=cfg.timeout_s)

    def close(self) -> None:
        """Close the HTTP client's connections."""
        self.client.close()

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, prompt_ids: list[list[int]], response_ids: list[list[int]], ground_truth=None,
                 **info) -> list[float]:
        prompts = [self._text(p) for p in prompt_ids]
        body = {"query": [p + self._text(r) for p, r in zip(prompts, response_ids)], "prompts": prompts,
                "labels": list(ground_truth) if ground_truth is not None else [None] * len(prompts)}
        return self.post(body, len(prompts))

    def post(self, body: dict, rows: int) -> list[float]:
        """POST ``body`` until it answers ``rows`` rewards or the attempts run out."""
        import httpx

        wait, last = self.cfg.backoff_s, None
        attempts = self.cfg.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(wait)
                wait *= 2
            try:
                response = self.client.post(self.cfg.url, json=body)
                response.raise_for_status()
                return _rewards(response.json(), rows)
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
        raise RemoteRewardError(f"remote reward {self.cfg.url}: no rewards after {attempts} attempts "
                                f"(reward.retries={self.cfg.retries}, reward.timeout_s={self.cfg.timeout_s}); "
                                f"last error: {last}")


def _rewards(answer, rows: int) -> list[float]:
    """The rewards of an answer, ``{"rewards": [...]}`` or a list; ValueError for anything else."""
    values = answer.get("rewards") if isinstance(answer, dict) else answer
    if not isinstance(values, list):
        raise ValueError(f"expected {{\"rewards\": [...]}} or a list, got {str(answer)[:200]}")
    if len(values) != rows:
        raise ValueError(f"got {len(values)} rewards for {rows} rows")
    return [float(v) for v in values]


def make_remote_reward(tokenizer, cfg: RewardConfig) -> RemoteReward:
    """The ``remote`` reward of the ``reward`` section."""
    return RemoteReward(tokenizer, cfg)
