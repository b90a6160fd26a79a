"""One Megatron rank that loads a distributed checkpoint and writes the full-vocabulary logits of
``harness.fixed_tokens()`` (gathered over TP, from the last pipeline stage)."""

from __future__ import annotations

from pathlib import Path

import torch


def megatron_logits(ckpt: str, model_dir: str, out_dir: str, tp: int, pp: int) -> None:
    """Build the model at (tp, pp), load ``ckpt``, run the pipeline forward, save logits on the last stage."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from asyncflow.bridge.mcore import init_parallel
    from asyncflow.models.megatron import GPTArch, build_gpt_model, transformer_config
    from asyncflow.models.parallel import destroy_megatron
    from tests.bridge.harness import fixed_tokens

    init_parallel(tp, pp)
    arch = GPTArch.from_pretrained(model_dir)
    model = build_gpt_model(arch, transformer_config(arch, tensor_parallel=tp, pipeline_parallel=pp))
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
    model.eval()
    tokens = fixed_tokens()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    captured = []

    def forward_step(data_iter, module):
        batch = next(data_iter)
        output = module(batch, positions, None)
        if parallel_state.is_pipeline_last_stage():
            captured.append(tensor_parallel.gather_from_tensor_model_parallel_region(output))
        return output, lambda o: (o.sum() * 0, {})

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
        )
    if captured and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(captured[0][..., : arch.vocab_size].contiguous(), Path(out_dir) / "logits.pt")
    destroy_megatron()
