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
    data_source_key: str | None = "data_source"
    """Field naming the row's dataset (verl's ``data_source``), given to the reward function with the answer;
    optional per row (None: not read)."""
    extra_info_key: str | None = "extra_info"
    """Field of further per-row data for the reward function (verl's ``extra_info``, any JSON value), given with
    the answer; optional per row (None: not read)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (with the generation prompt appended)."""
    system_prompt: str | None = None
    """A system message put before every prompt when the chat template is applied."""
    max_prompt_len: int = 1024
    """Prompts longer than this many tokens are an error naming the file and row."""
    shuffle: bool = True
    """Shuffle rows every epoch (seeded by ``workflow.seed``)."""
    val_path: str | None = None
    """A validation set (.jsonl / .parquet file or directory), read with the options above (keys, chat template,
    ``max_prompt_len``) in file order, for ``workflow.eval_every``; any ``workflow.task`` may have one."""
    val_size: int | None = None
    """Evaluate the first this many validation rows (None: all of them)."""
