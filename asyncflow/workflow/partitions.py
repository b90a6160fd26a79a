"""How a run's rows sit in the TransferQueue: one partition per global step, rows put a few at a time."""

from __future__ import annotations

PUT_ROWS = 16
"""Finished responses per TransferQueue put: both rollout paths put every 16th as it finishes, so the next task
starts on the first rows while the engine still decodes the tail; the simulator charges puts by it too."""


STREAM_PARTITION = "prompt-stream"
"""The sample stream's prompts (``workflow.mode: stream``): rows of no step yet; a finished group goes to a step's
partition (``asyncflow.workflow.sample_stream``)."""


def partition_name(step: int) -> str:
    """The TransferQueue partition that holds the samples of global step ``step``."""
    return f"step-{step:06d}"


def row_length(sample) -> int:
    """A generated row's tokens as the trainer packs it (prompt and response): the TransferQueue's row length,
    which the ``shortest`` sampler orders micro-batches by (the prompt's put set it to the prompt alone)."""
    return len(sample.prompt_ids) + len(sample.response_ids)
