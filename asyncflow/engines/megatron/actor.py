"""The Megatron train engine (``TRAIN_ENGINES["megatron"]``): actor and reference policies for RL."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from asyncflow.config import MegatronEngineConfig
from asyncflow.engines.base import Ranks, TrainEngine
from asyncflow.engines.megatron import features, groups
from asyncflow.engines.megatron.trainer import MegatronTrainer


class MegatronActor(TrainEngine):
    """A policy on this process's Megatron ranks; ``version`` counts global training steps.

    ``train_step`` takes a loss function that returns *numerators* (sums over tokens or sequences)
    plus a ``normalizer`` metric; gradients are divided by the normalizer summed over all
    micro-batches (and data-parallel ranks) only after the last micro-batch. That is what lets the
    first pass stream micro-batches from the TransferQueue before the batch's token count is known.
    """

    def __init__(self, cfg: MegatronEngineConfig, model_dir: str | Path, load_weights: bool = True, head: str = "lm",
                 trainable: bool = True, group_timeout_s: float | None = None):
        """``group_timeout_s``: bounds every collective of the process groups this rank joins (see
        ``TrainableEngine``)."""
        self.trainer = MegatronTrainer(cfg, model_dir, head=head, trainable=trainable, group_timeout_s=group_timeout_s)
        if load_weights:
            self.trainer.load_initial_weights(model_dir)
        self.version = 0
        self._offloader = None
        self.streamer = None
        self._logprobs = self.trainer.logprobs  # layer_major.logprobs once the weights stream from host memory
        self._ranks = groups.ranks()

    @property
    def arch(self):
        """The model's ``GPTArch``."""
        return self.trainer.arch

    @property
    def ranks(self) -> Ranks:
        """See ``TrainableEngine.ranks`` (Megatron's parallel state)."""
        return self._ranks

    @property
    def micro_batch_size(self) -> int:
        """``micro_batch_size`` of the ``trainer`` (or ``critic``) section."""
        return self.trainer.cfg.micro_batch_size

    @property
    def fixed_seq_len(self) -> bool:
        """Pipeline stages exchange activations of one fixed shape (unless packing sends each one's shape)."""
        return self.trainer.cfg.pipeline_parallel > 1 and not self.trainer.cfg.micro_batch_tokens

    @property
    def seq_multiple(self) -> int:
        """See ``TrainableEngine.seq_multiple`` (``features.seq_multiple``)."""
        return features.seq_multiple(self.trainer.cfg)

    def gather_data_parallel(self, items: list) -> list:
        """See ``TrainableEngine.gather_data_parallel``."""
        return groups.gather_data_parallel(items)

    def check_same_rows(self, fingerprints: list[torch.Tensor], what: str) -> None:
        """See ``TrainableEngine.check_same_rows``."""
        groups.check_same_rows(fingerprints, what)

    def group_timeout_s(self) -> float | None:
        """See ``TrainableEngine.group_timeout_s``."""
        return groups.group_timeout_s()

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """log p(tokens[:, 1:]) [b, s-1]; rows are padded up to a multiple of the micro-batch size (with
        ``micro_batch_tokens`` the caller packed ``tokens`` as one micro-batch)."""
        mbs = self.trainer.cfg.micro_batch_size
        rows = tokens.shape[0]
        pad = (-rows) % mbs if rows > mbs and not self.trainer.cfg.micro_batch_tokens else 0
        if pad:
            tokens = torch.cat([tokens, tokens[-1:].expand(pad, -1)], dim=0)
        out = self._logprobs(tokens)
        return None if out is None else out[:rows]

    def train_step(self, micro_batches: Iterable[dict[str, torch.Tensor]], num_microbatches: int,
                   loss_fn: Callable) -> dict:
        """One optimizer step over ``micro_batches``; returns ``grad_norm``, ``update_ok`` and the
        per-micro-batch metrics (``micro``) of the last pipeline stage."""
        self.trainer.zero_grad()
        outputs = self.trainer.forward_backward(micro_batches, num_microbatches, loss_fn)
        from megatron.core import parallel_state as ps

        # On the engine's device: NCCL reduces device tensors only.
        normalizer = torch.tensor([float(sum(float(o["normalizer"]) for o in outputs))], device=self.trainer.device)
        if torch.distributed.is_initialized():
            # The same global count on every rank: summed over replicas (data parallel) and handed from
            # the last pipeline stage to the others (which contribute 0); TP ranks already agree.
            torch.distributed.all_reduce(normalizer, group=ps.get_data_parallel_group())
            torch.distributed.all_reduce(normalizer, group=ps.get_pipeline_model_parallel_group())
        # Megatron's DDP averages gradients over replicas and context-parallel ranks (x 1/(dp x cp)); the loss
        # is a sum over all of their tokens divided by the global count, hence the factor dp x cp.
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.trainer.model.scale_gradients(dp / max(normalizer.item(), 1.0))
        stats = self.trainer.optimizer_step()
        return {**stats, "normalizer": normalizer.item(), "micro": outputs}

    def offload(self) -> int:
        """See ``TrainableEngine.offload`` (``offload.train_state_offloader``: parameters and Adam state to host
        memory, gradient buffers freed), collected again at every offload (Adam's moments appear at the first step)."""
        from asyncflow.engines.megatron.offload import train_state_offloader

        if self._offloader is None:
            self._offloader = train_state_offloader(self.trainer)
        return self._offloader.offload()

    def onload(self) -> None:
        """See ``TrainableEngine.onload``."""
        if self._offloader is not None:
            self._offloader.onload()

    def stream_weights_from_host(self) -> None:
        """See ``TrainEngine.stream_weights_from_host`` (``offload.LayerStreamer``; frozen engines only). Each layer
        is loaded once per ``compute_logprobs`` call (``layer_major``, at any TP and PP), or once per micro-batch in
        the layouts ``layer_major.supported`` leaves to Megatron's schedule (context parallelism, ...)."""
        import functools

        from asyncflow.engines.megatron import layer_major
        from asyncflow.engines.megatron.offload import LayerStreamer

        if self.trainer.trainable:
            raise ValueError("only a frozen engine (trainable=False) streams its weights from host memory")
        module = self.trainer.module
        self.streamer = LayerStreamer(module, module.decoder.layers, self.trainer.device)
        if layer_major.supported(self.trainer):
            self._logprobs = functools.partial(layer_major.logprobs, self.trainer, self.streamer)

    def weight_stager(self, bucket_mb: float, session: str):
        """See ``TrainEngine.weight_stager`` (``MegatronTrainer.weight_stager``)."""
        return self.trainer.weight_stager(bucket_mb, session)

    def save(self, path: str) -> None:
        """Model and optimizer state, a Megatron distributed checkpoint (collective on every rank).

        ``version`` is not stored: the run checkpoint's ``meta.json`` holds it.
        """
        self.trainer.save_checkpoint(path)

    def load(self, path: str) -> None:
        """Restore ``save`` output at any TP/PP (the caller restores ``version``)."""
        self.trainer.load_checkpoint(path)
