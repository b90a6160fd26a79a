"""A Megatron-core trainer for one policy model: TP/PP from config, Megatron DDP and optimizer.

Every step goes through Megatron's own machinery (``get_forward_backward_func`` schedules, DDP grad
buffers, ``finalize_model_grads``, ``get_megatron_optimizer``), on CPU with gloo after
``megatron_patches.apply()`` and unchanged on GPU. Log-probabilities use vocab-parallel cross entropy,
so no rank ever holds the full-vocabulary logits of another rank.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncflow.bridge import hf_layout
from asyncflow.config import MegatronConfig
from asyncflow.engines.megatron.logprobs import token_logprobs
from asyncflow.engines.megatron.model import GPTArch, build_gpt_model, padded_vocab_size, transformer_config
from asyncflow.engines.megatron.parallel import init_megatron

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronTrainer:
    """Holds this rank's model chunk, DDP wrapper and optimizer; call collectively on every rank."""

    def __init__(self, cfg: MegatronConfig, model_dir: str | Path):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        init_megatron(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.seed)
        self.arch = GPTArch.from_pretrained(model_dir)
        dtype = _DTYPES[cfg.params_dtype]
        self.tconfig = transformer_config(
            self.arch,
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            params_dtype=dtype,
        )
        self.padded_vocab = padded_vocab_size(
            self.arch.vocab_size, cfg.make_vocab_size_divisible_by, cfg.tensor_parallel
        )
        module = build_gpt_model(
            self.arch, self.tconfig, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
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
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.version = 0

    # ------------------------------------------------------------------ weights
    @property
    def layer_offset(self) -> int:
        """Global index of this pipeline stage's first layer (from Megatron's own ``layer_number``)."""
        layers = self.model.module.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0

    def _require_tp1(self, what: str) -> None:
        if self.cfg.tensor_parallel != 1:
            raise NotImplementedError(
                f"{what} with tensor_parallel={self.cfg.tensor_parallel} needs the resharding weight bridge; "
                "use load_dist_checkpoint (Megatron distributed checkpoints reshard to any TP/PP)"
            )

    def load_hf(self, model_dir: str | Path) -> None:
        """Load Hugging Face weights into this rank's chunk (TP=1, any PP)."""
        from safetensors.torch import load_file

        self._require_tp1("load_hf")
        hf_state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            hf_state.update(load_file(file))
        state = {
            name: hf_layout.hf_to_mcore(self.arch, name, hf_state, self.padded_vocab, self.layer_offset)
            for name in self.model.module.state_dict()
            if not hf_layout.is_extra_state(name)
        }
        self.model.module.load_state_dict(state, strict=False)

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's chunk as Hugging Face ``(name, tensor)`` pairs (TP=1, any PP stage)."""
        self._require_tp1("export_hf")
        state = self.model.module.state_dict()
        for name, tensor in state.items():
            for hf_name, hf_tensor in hf_layout.mcore_to_hf(self.arch, name, tensor, self.layer_offset):
                yield hf_name, hf_tensor.detach()

    def save_dist_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Save the model as a Megatron distributed checkpoint (loadable at any TP/PP)."""
        from megatron.core import dist_checkpointing

        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self.model.module.sharded_state_dict(), str(ckpt_dir))

    def load_dist_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Load a Megatron distributed checkpoint written at any TP/PP into this rank's chunk."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self.model.module.sharded_state_dict(), str(ckpt_dir))
        self.model.module.load_state_dict(state, strict=False)

    # ------------------------------------------------------------------ compute
    def _run_schedule(self, tokens: torch.Tensor, loss_mask: torch.Tensor, forward_only: bool) -> list[dict]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = min(self.cfg.micro_batch_size, tokens.shape[0])
        if tokens.shape[0] % mbs:
            raise ValueError(f"batch of {tokens.shape[0]} is not a multiple of micro_batch_size {mbs}")
        micro = [
            (tokens[i : i + mbs], loss_mask[i : i + mbs]) for i in range(0, tokens.shape[0], mbs)
        ]
        total_tokens = loss_mask.sum().clamp(min=1)
        seq = tokens.shape[1]
        positions = torch.arange(seq).unsqueeze(0)

        def loss_func(mask, targets_lp):
            nll_sum = -(targets_lp * mask).sum()
            # Schedules divide each micro-batch loss by num_microbatches; scale so that the sum over
            # micro-batches is the token mean over the whole batch.
            loss = nll_sum / total_tokens * len(micro)
            return loss, {"loss_sum": nll_sum.detach(), "logprobs": targets_lp.detach()}

        def forward_step(data_iter, model):
            batch, mask = next(data_iter)
            out = model(batch, positions.expand(batch.shape[0], -1), None)
            if not parallel_state.is_pipeline_last_stage():
                return out, functools.partial(loss_func, mask)  # hidden states for the next stage
            # Position t predicts token t+1: logprobs of tokens 1..s-1.
            return token_logprobs(out[:, :-1], batch[:, 1:], self.arch.vocab_size), functools.partial(
                loss_func, mask
            )

        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    def train_step(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        """One optimizer step on ``tokens`` [b, s] with ``loss_mask`` [b, s-1] (1 = trained position).

        Returns ``loss`` (mean negative log-likelihood over masked tokens; on the last pipeline stage,
        NaN elsewhere) and ``grad_norm``.
        """
        from megatron.core.distributed import finalize_model_grads

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(tokens, loss_mask.float(), forward_only=False)
        finalize_model_grads([self.model])
        ok, grad_norm, _ = self.optimizer.step()
        self.version += 1
        loss = float("nan")
        if outputs:
            loss = float(sum(o["loss_sum"] for o in outputs) / loss_mask.sum().clamp(min=1))
        return {"loss": loss, "grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok)}

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """log p(tokens[:, 1:]) [b, s-1] on the last pipeline stage (None on other stages)."""
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        outputs = self._run_schedule(tokens, mask, forward_only=True)
        if not outputs:
            return None
        return torch.cat([o["logprobs"] for o in outputs], dim=0)

