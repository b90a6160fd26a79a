"""The Megatron critic (``CRITIC_ENGINES["megatron"]``): the policy's model family with a value head.

It has its own ``CriticConfig`` (``critic:`` section: TP/PP/DP, optimizer), is loaded from the same
Hugging Face checkpoint as the policy (all but the language-model head) and trains through the same
streaming ``train_step`` as the actor: the loss returns numerators, gradients are normalized after the
last micro-batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncflow.config import CriticConfig
from asyncflow.engines.base import CriticEngine
from asyncflow.engines.megatron.actor import MegatronActor


class MegatronCritic(MegatronActor, CriticEngine):
    """Values V(prefix) at every position; ``train_step`` with a value loss (``make_value_objective``)."""

    def __init__(self, cfg: CriticConfig, model_dir: str | Path, load_weights: bool = True,
                 trainable: bool = True, group_timeout_s: float | None = None):
        super().__init__(cfg, model_dir, load_weights=load_weights, head="value", trainable=trainable,
                         group_timeout_s=group_timeout_s)

    @torch.no_grad()
    def compute_values(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """V [b, s-1] on the last pipeline stage (None elsewhere); position t scores the state before token t+1."""
        return self.compute_logprobs(tokens)  # the trainer's per-position output is the value head's

    def weight_stager(self, bucket_mb: float, session: str):
        raise NotImplementedError("a critic's weights are not published to rollout")
