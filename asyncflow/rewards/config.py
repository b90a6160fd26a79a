"""Configuration of how rewards are computed (the ``reward`` section); ``algorithm.reward`` names the function."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """How the reward task calls the function named by ``algorithm.reward``, and the settings of the built-in
    ``remote`` (HTTP) and ``classifier`` (sequence-classification model) rewards."""

    workers: int = 1
    """Reward workers (one process each) taking chunks of rows from the TransferQueue side by side."""
    batched: bool = False
    """The function takes lists (one entry per row of a chunk) and returns a list of rewards; a function can
    declare it itself instead (``@asyncflow.rewards.batched``, or verl's ``data_sources, solution_strs, ...``)."""
    max_concurrency: int = 32
    """``async def`` rewards: calls awaited at once within a chunk, at most."""
    url: str | None = None
    """``algorithm.reward: remote``: the endpoint (OpenRLHF's ``remote_rm_url``), POSTed
    ``{"query": [...], "prompts": [...], "labels": [...]}``, answering ``{"rewards": [...]}`` or a list."""
    timeout_s: float = 60.0
    """``remote``: seconds one request may take before it is retried."""
    retries: int = 3
    """``remote``: attempts after the first; then the chunk fails with the last error (its rows get
    ``algorithm.reward_on_error``)."""
    backoff_s: float = 1.0
    """``remote``: wait before the first retry, doubled before each next one."""
    model_path: str | None = None
    """``algorithm.reward: classifier``: an HF folder of a sequence-classification model (and its tokenizer)."""
    model_label: int = 0
    """``classifier``: the logit used as the reward (a reward model has a single one, label 0)."""
    model_batch_size: int = 16
    """``classifier``: texts per forward pass."""
