"""Configuration of prompt datasets read from files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    """A prompt dataset on disk (``workflow.task: jsonl`` or ``parquet``); the synthetic tasks ignore it."""

    path: str | None = None
    """A .jsonl / .parquet file (or a directory of them) with one prompt per row."""
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """File format; ``auto`` decides by extension."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages ``[{"role", "content"}]``."""
    answer_key: str | None = "ground_truth"
    """Field holding the reference answer given to the reward function (None: no answers)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (with the generation prompt appended)."""
    system_prompt: str | None = None
    """A system message put before every prompt when the chat template is applied."""
    max_prompt_len: int = 1024
    """Prompts longer than this many tokens are an error naming the file and row."""
    shuffle: bool = True
    """Shuffle rows every epoch (seeded by ``workflow.seed``)."""
