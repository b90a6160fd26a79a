"""A Megatron-core trainer for one policy model: TP/PP from config, Megatron DDP and optimizer.

Every step goes through Megatron's own machinery (``get_forward_backward_func`` schedules, DDP grad
buffers, ``finalize_model_grads``, ``get_megatron_optimizer``), on CPU with gloo after
``megatron_patches.apply()`` and unchanged on GPU. Log-probabilities use vocab-parallel cross entropy,
so no rank ever holds the full-vocabulary logits of another rank.

Device boundary: callers hand in CPU tensors and get CPU tensors back. Each micro-batch moves to
``self.device`` (``asyncflow.models.device.engine_device``) as Megatron's schedule pulls it, and the
schedule's outputs move back to the CPU once it is done (see ``forward_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from asyncflow.config import MegatronEngineConfig
from asyncflow.engines.megatron import context_parallel, thd
from asyncflow.engines.megatron.logprobs import token_logprobs
from asyncflow.models.device import CPU, engine_device, to_device
from asyncflow.models.megatron import GPTArch, build_gpt_model, padded_vocab_size, transformer_config
from asyncflow.models.parallel import init_megatron
from asyncflow.models.provider import model_context

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(logprobs [mbs, s-1], micro_batch) -> (loss, metrics)``; losses sum to the batch loss."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronTrainer:
    """Holds this rank's model chunk, DDP wrapper and optimizer; call collectively on every rank.

    ``head="lm"`` is the policy (per-position outputs are log-probabilities of the next token);
    ``head="value"`` is a critic: the language-model head is replaced by a scalar value head
    (``ValueHead``) and per-position outputs are values. ``trainable=False`` builds a frozen model for
    forward passes only (the reference policy): no DDP wrapper, gradient buffers or optimizer.
    """

    def __init__(self, cfg: MegatronEngineConfig, model_dir: str | Path, head: str = "lm", trainable: bool = True,
                 group_timeout_s: float | None = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from asyncflow.engines.megatron import features

        self.arch = GPTArch.from_pretrained(model_dir)
        # Features this machine cannot run fail here, naming the key, before any process group starts.
        features.check(cfg, "critic" if head == "value" else "trainer", is_moe=self.arch.is_moe)
        self.cfg = cfg
        init_megatron(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.seed, expert_parallel=cfg.expert_parallel,
                      context_parallel=cfg.context_parallel, timeout_s=group_timeout_s)
        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        self.head = head
        self.device = engine_device()  # this rank's model, micro-batches and collectives; CPU on the CPU stack
        if head == "value":  # the critic has no output embedding to tie to the input one
            self.arch = dataclasses.replace(self.arch, tie_word_embeddings=False)
        dtype = _DTYPES[cfg.params_dtype]
        self.tconfig = transformer_config(
            self.arch,
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            params_dtype=dtype,
            expert_parallel=cfg.expert_parallel,
            **features.transformer_kwargs(cfg, self.arch.is_moe),
        )
        self.padded_vocab = padded_vocab_size(
            self.arch.vocab_size, cfg.make_vocab_size_divisible_by, cfg.tensor_parallel
        )
        if cfg.model_provider:
            context = model_context(self.arch, cfg.make_vocab_size_divisible_by)
            module = _user_model(cfg.model_provider, self.tconfig, context)
        else:
            module = build_gpt_model(
                self.arch, self.tconfig, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by
            )
        if head == "value" and getattr(module, "post_process", False):
            # before DDP wraps the parameters
            module.output_layer = ValueHead(self.arch.hidden_size, dtype, self.device)
        self.module = module  # the GPTModel chunk of this rank (the bridge and checkpoints read it)
        self.trainable = trainable
        self.version = 0
        if not trainable:
            # A frozen model (the reference): no DDP gradient buffers and no optimizer, so it costs its
            # weights only (a DDP-wrapped bf16 model would add 4-byte gradients and, through the optimizer,
            # fp32 master weights: 5x the memory).
            for p in module.parameters():
                p.requires_grad_(False)
            self.model, self.optimizer = module, None
            return
        ddp_config = DistributedDataParallelConfig(**features.ddp_kwargs(cfg))
        self.model = DistributedDataParallel(self.tconfig, ddp_config, module)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            weight_decay=cfg.weight_decay,
            clip_grad=cfg.clip_grad,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            **features.optimizer_kwargs(cfg),
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    # ------------------------------------------------------------------ weights
    @property
    def layer_offset(self) -> int:
        """Global index of this pipeline stage's first layer (from Megatron's own ``layer_number``)."""
        layers = self.module.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0

    def _require_trainable(self) -> None:
        if not self.trainable:
            raise RuntimeError("this MegatronTrainer was built with trainable=False (a frozen reference model)")

    def _require_tp1(self, what: str) -> None:
        """Kept for callers that need a world of one TP rank; the bridge methods below work at any TP/PP."""
        if self.cfg.tensor_parallel != 1:
            raise NotImplementedError(f"{what} needs tensor_parallel=1 (got {self.cfg.tensor_parallel})")

    def bridge_layout(self):
        """The weight bridge's ``ParallelLayout`` of this model (collective over the pipeline group)."""
        from asyncflow.bridge.mcore import model_layout

        return model_layout(self.module, self.arch, self.cfg.make_vocab_size_divisible_by)

    def load_hf(self, model_dir: str | Path) -> None:
        """Load Hugging Face weights into this rank's chunk at any TP/PP, reading only this rank's slices."""
        from asyncflow.bridge.mcore import HFReader, load_hf_into, model_rank

        layout = self.bridge_layout()
        # A critic keeps its fresh value head: the checkpoint's lm_head has no counterpart in it.
        skip = ("output_layer.",) if self.head == "value" else ()
        load_hf_into(self.module, self.arch, layout, model_rank()[0], HFReader(model_dir), skip=skip)
        self._refresh_main_params()

    def load_initial_weights(self, model_dir: str | Path) -> None:
        """Load the run's initial weights: ``trainer.load_dir`` as ``trainer.load_format`` says, else ``model_dir``'s
        Hugging Face weights (``initial_weights.resolve``)."""
        from asyncflow.engines.megatron import initial_weights

        kind, path = initial_weights.resolve(getattr(self.cfg, "load_dir", None),
                                             getattr(self.cfg, "load_format", "auto"), model_dir)
        if kind == initial_weights.MEGATRON_DIST:
            self.load_dist_checkpoint(path)
        else:
            self.load_hf(path)

    def _refresh_main_params(self) -> None:
        """Copy the model's weights into the optimizer's fp32 main params after a load of model weights only.

        The optimizer is built with the model (its mixed-precision and distributed variants copy each 16-bit
        parameter into an fp32 main param then) and the weights are loaded afterwards; every step then writes
        the main params back into the model. Without this refresh the first step brings back the random
        initial weights. A no-op for float32 without the distributed optimizer (the optimizer steps the model's
        own parameters) and for frozen models (no optimizer).
        """
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's chunk as full Hugging Face ``(name, tensor)`` pairs, any TP/PP stage.

        Collective over the tensor-parallel group when TP > 1 (one all-gather per parameter); the
        weight sync path (``weight_stager``) never gathers.
        """
        from asyncflow.bridge.mcore import export_full_hf, model_rank

        layout = self.bridge_layout()
        yield from export_full_hf(self.module, self.arch, layout, model_rank()[0])

    def sync_plan(self, bucket_mb: float):
        """The bridge ``SyncPlan`` of this model and its plain-dict form for the receivers."""
        from asyncflow.bridge.buckets import SyncPlan
        from asyncflow.bridge.sync import plan_to_dict

        bucket_bytes = int(bucket_mb * 2**20)
        # Checkpoint format, one reload call per version: experts may travel in separate buckets.
        plan = SyncPlan(self.arch, self.bridge_layout(), bucket_bytes, _DTYPES[self.cfg.params_dtype],
                        split_experts=True)
        return plan, plan_to_dict(plan, bucket_bytes)

    def weight_stager(self, bucket_mb: float, session: str):
        """This rank's ``bridge.staging.StagingWriter`` over its live parameters, and the plan as plain data.

        The writer is None on ranks that send nothing (data-parallel and expert-data-parallel replicas, and
        ranks whose every parameter another rank sends). Collective over the pipeline group (the layout).
        Its segment is named ``afq-<pid>-w<session>-<tp.pp.ep>`` so that a SIGKILLed run's segments are
        swept like the TransferQueue's (``transfer_queue.shm.remove_stale``).
        """
        import os

        from asyncflow.bridge.mcore import model_offsets, model_rank
        from asyncflow.bridge.staging import StagingWriter, source_key
        from asyncflow.bridge.sync import global_state

        plan, plan_dict = self.sync_plan(bucket_mb)
        rank, is_source = model_rank()
        if not is_source or not any(rank in b.sources for b in plan.buckets):
            return None, plan_dict
        offsets = model_offsets(self.module, self.arch, plan.layout, rank)
        segment = f"afq-{os.getpid()}-w{session}-{source_key(rank)}"
        return StagingWriter(plan, rank, global_state(self.module, *offsets), segment), plan_dict

    def save_dist_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Save the model as a Megatron distributed checkpoint (loadable at any TP/PP)."""
        from megatron.core import dist_checkpointing

        from asyncflow.engines.megatron.checkpoint_io import InProcessSaveStrategy

        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self.module.sharded_state_dict(), str(ckpt_dir),
                                sharded_strategy=InProcessSaveStrategy())

    def load_dist_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Load a Megatron distributed checkpoint written at any TP/PP into this rank's chunk."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self.module.sharded_state_dict(), str(ckpt_dir))
        self.module.load_state_dict(state, strict=False)
        self._refresh_main_params()

    def _train_state(self, is_loading: bool) -> dict:
        """The sharded state of model and optimizer, keyed as Megatron-LM's own checkpoints are."""
        model_state = self.module.sharded_state_dict()
        # The optimizer maps its state to the model's ShardedTensors by parameter identity, so both
        # must come from one call; is_loading makes it allocate the Adam moments it will be read into.
        optim_state = self.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
        return {"model": model_state, "optimizer": optim_state}

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Save model and optimizer state (Adam moments and step) as a Megatron distributed checkpoint.

        Collective over every rank of the world. The model part loads at any TP/PP; so does the
        optimizer part, since its tensors are sharded exactly like the parameters they belong to.
        """
        from megatron.core import dist_checkpointing

        from asyncflow.engines.megatron.checkpoint_io import InProcessSaveStrategy

        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._train_state(is_loading=False), str(ckpt_dir),
                                sharded_strategy=InProcessSaveStrategy())

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Restore model and optimizer from ``save_checkpoint`` output written at any TP/PP (collective)."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self._train_state(is_loading=True), str(ckpt_dir))
        # strict: a resumed run must not silently keep freshly initialized weights.
        self.module.load_state_dict(state["model"], strict=True)
        # The optimizer's state holds its fp32 main params (saved by ``save_checkpoint``), so loading it restores
        # them at full precision; no refresh from the 16-bit model weights.
        self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ compute
    def forward_backward(
        self,
        micro_batches: Iterable[dict[str, torch.Tensor]],
        num_microbatches: int,
        loss_fn: LossFn,
        forward_only: bool = False,
    ) -> list[dict[str, torch.Tensor]]:
        """Run Megatron's schedule over ``micro_batches`` (an iterator may stream them as they arrive).

        Each micro-batch is a dict with ``tokens`` [mbs, s] (the same shape for all under pipeline
        parallelism, unless ``micro_batch_tokens`` turned on Megatron's variable sequence lengths) plus
        whatever ``loss_fn`` reads. ``loss_fn(logprobs, micro_batch)`` gets
        log p(tokens[:, 1:]) [mbs, s-1] and returns ``(loss, metrics)`` where the *sum* of the losses
        over micro-batches is the batch loss. Returns the metrics of each micro-batch on the last
        pipeline stage, ``[]`` elsewhere. Gradients accumulate in Megatron's DDP buffers.

        Micro-batches may live anywhere (the workflow builds them on the CPU); each is moved to
        ``self.device`` here, once, and ``loss_fn`` sees it there. The returned metrics are on the CPU.
        """
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterator = iter(micro_batches)
        first = next(iterator)
        # With variable_seq_lengths (packing) the stages exchange each micro-batch's shape and these two only
        # size the schedule's first receive; otherwise every micro-batch has this shape.
        mbs, seq = first["tokens"].shape
        cp = self.cfg.context_parallel

        def scaled_loss(mb, logprobs):
            loss, metrics = loss_fn(logprobs, mb)
            # Megatron's schedule divides each micro-batch loss by num_microbatches; undo it so the
            # loss_fn contract (losses sum to the batch loss) holds.
            return loss * num_microbatches, metrics

        packed_attention = thd.enabled(self.cfg.micro_batch_tokens)

        def forward_step(data_iter, model):
            mb = to_device(next(data_iter), self.device)  # the one host -> device copy of a micro-batch
            unpack = None
            if packed_attention and "row_tokens" in mb:  # rows concatenated, attention per row (untested: TE)
                ids, pos, labels, params = thd.pack(mb["tokens"], mb["row_tokens"])
                out = model(ids, pos, None, packed_seq_params=params)
                scored = out
                unpack = functools.partial(thd.unpack, lengths=mb["row_tokens"], seq=mb["tokens"].shape[1])
            elif cp > 1:  # this rank's 2 of 2 x CP chunks; labels are shifted before the split
                mb, pos, labels = context_parallel.split(mb, seq, cp)
                out = model(mb["tokens"], pos, None)
                scored = out  # every local position has its label (0 past the end, masked)
            else:
                tokens = mb["tokens"]
                positions = torch.arange(tokens.shape[1], device=self.device).expand(tokens.shape[0], -1)
                out = model(tokens, positions, None)
                scored, labels = out[:, :-1], tokens[:, 1:]  # position t predicts token t+1
            if not parallel_state.is_pipeline_last_stage():
                return out, functools.partial(scaled_loss, mb)  # hidden states for the next stage
            unpack = unpack or (lambda values: values)
            if self.head == "value":  # aligned like the logprobs: position t is the state before token t+1
                return unpack(scored[..., 0].float()), functools.partial(scaled_loss, mb)
            logprobs = unpack(token_logprobs(scored, labels, self.arch.vocab_size))
            if getattr(loss_fn, "needs_entropy", False):  # an entropy bonus (or metric) reads the whole distribution
                from asyncflow.engines.megatron.logprobs import token_entropy

                # Only a bonus needs its gradient; a metric-only entropy keeps nothing alive for backward.
                with torch.set_grad_enabled(torch.is_grad_enabled() and getattr(loss_fn, "entropy_grad", True)):
                    mb = {**mb, "entropy": unpack(token_entropy(scored, self.arch.vocab_size))}
            return logprobs, functools.partial(scaled_loss, mb)

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=itertools.chain([first], iterator),
            model=[self.model],
            num_microbatches=num_microbatches,
            seq_length=context_parallel.padded_length(seq, cp) if cp > 1 else seq,  # Megatron divides it by CP
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
        if cp > 1:  # every CP rank gets the whole micro-batch's metrics and per-position outputs
            group = parallel_state.get_context_parallel_group()
            outputs = [context_parallel.reduce_metrics(o, seq, cp, group) for o in outputs]
        # After the schedule, not per micro-batch: a device -> host copy waits for the GPU.
        return [to_device(o, CPU) for o in outputs]

    def zero_grad(self) -> None:
        """Clear DDP grad buffers and optimizer state gradients before a new accumulation."""
        self._require_trainable()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """Reduce gradients across data-parallel ranks and step the optimizer; bumps ``version``."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        ok, grad_norm, _ = self.optimizer.step()
        self.version += 1
        return {"grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok)}

    def _split(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        batch = next(iter(tensors.values())).shape[0]
        # Packing: the caller formed the micro-batch by its token budget (``workflow.batching.plan_micro_batches``).
        mbs = batch if self.cfg.micro_batch_tokens else min(self.cfg.micro_batch_size, batch)
        if batch % mbs:
            raise ValueError(f"batch of {batch} is not a multiple of micro_batch_size {mbs}")
        return [{k: v[i : i + mbs] for k, v in tensors.items()} for i in range(0, batch, mbs)]

    def train_step(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        """One supervised optimizer step on ``tokens`` [b, s] with ``loss_mask`` [b, s-1] (1 = trained).

        Returns ``loss`` (mean negative log-likelihood over masked tokens on the last pipeline stage,
        NaN elsewhere), ``grad_norm`` and ``update_ok``.
        """
        total = loss_mask.sum().clamp(min=1)

        def nll(logprobs, mb):
            nll_sum = -(logprobs * mb["loss_mask"]).sum()
            return nll_sum / total, {"nll_sum": nll_sum.detach()}

        micro = self._split({"tokens": tokens, "loss_mask": loss_mask.float()})
        self.zero_grad()
        outputs = self.forward_backward(micro, len(micro), nll)
        stats = self.optimizer_step()
        loss = float(sum(o["nll_sum"] for o in outputs) / total) if outputs else float("nan")
        return {"loss": loss, **stats}

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """log p(tokens[:, 1:]) [b, s-1] on the last pipeline stage (None on other stages)."""
        micro = self._split({"tokens": tokens})
        outputs = self.forward_backward(
            micro, len(micro), lambda lp, mb: (lp.sum() * 0, {"logprobs": lp.detach()}), forward_only=True
        )
        if not outputs:
            return None
        return torch.cat([o["logprobs"] for o in outputs], dim=0)


class ValueHead(torch.nn.Module):
    """A scalar value per position, in place of ``GPTModel.output_layer`` (same call signature).

    Replicated on every tensor-parallel rank: without sequence parallelism the final hidden states are
    identical across TP ranks, so the head's gradients are too and need no extra reduction.
    Zero-initialized, so the critic starts from V = 0 (the usual choice for outcome rewards in [0, 1]).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device = CPU):
        super().__init__()
        # Named ``weight`` (not a nested Linear): Megatron's sharded_state_dict expects output_layer.weight.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _user_model(path: str, tconfig, context):
    """Call a user's Megatron model provider: ``fn(config, pre_process, post_process[, context]) -> GPTModel``.

    The same signature as Megatron-LM's ``model_provider`` plus the ``TransformerConfig`` that AsyncFlow derived
    from the checkpoint and, for a provider that takes it, the ``ModelContext`` (``asyncflow.models.provider``).
    """
    from asyncflow.models.provider import call_provider
    from asyncflow.registry import load_object

    module = call_provider(load_object(path), tconfig, context)
    embedding = getattr(getattr(module, "embedding", None), "word_embeddings", None)
    if embedding is not None:  # a wrong vocabulary would otherwise fail deep inside the weight loader
        rows = embedding.weight.shape[0] * context.parallel.tensor_parallel
        if rows != context.padded_vocab_size:
            raise ValueError(f"trainer.model_provider={path} built an embedding of {rows} rows; the checkpoint needs "
                             f"{context.padded_vocab_size} (context.padded_vocab_size: GPTModel's vocab_size)")
    return module
