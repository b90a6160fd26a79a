"""Log-probabilities of a streamed reference model, layer-major: each decoder layer visits the device once a call.

A ``LayerStreamer`` (``trainer.reference_placement: offload``) keeps the reference's weights in host memory and
loads a decoder layer whenever a forward pass runs it. Megatron's schedule runs the whole model once per
micro-batch, so a call of N micro-batches copies every layer N times host -> device (the recipes use micro-batches
of one row: at 7B-32B that is terabytes a step). Here the loops are swapped, on every pipeline stage:

1. take every micro-batch's input: the first stage embeds them (``GPTModel._preprocess``: the embedding and rotary
   embedding ``GPTModel.forward`` computes, nothing else); a later stage receives the previous stage's hidden
   states of every micro-batch over the pipeline group (shapes known from the micro-batches', as Megatron's
   schedule knows them) and computes the rotary embedding the same way;
2. for each decoder layer of the stage: load it once, run it over every micro-batch's hidden states, drop it;
3. a stage before the last sends every micro-batch's hidden states to the next stage and returns None (as
   ``MegatronTrainer.logprobs`` does there); the last stage computes, per micro-batch, the final norm, the
   output layer and the vocab-parallel ``token_logprobs`` of the normal path.

Each micro-batch meets the same layer calls with the same arguments as in ``TransformerBlock.forward`` (attention
mask None: causal; the rng tracker forked under sequence parallelism) and crosses a stage boundary as the same
tensor, so the results equal the resident model's. Tensor parallelism changes nothing: a layer's weights are this
rank's shard and its collectives run inside it, in the same order on every rank of the group (expert parallelism
too: every rank runs the same loop); each TP rank exchanges with its own peer of the next stage.

Pipeline parallelism gives up the overlap of Megatron's schedule for this call: a stage starts when the previous
one has run all its layers over every micro-batch, so the stages compute one after another. The reference is
bound by its host -> device copies (a layer per micro-batch before, a layer per call now), not by that compute.
The exchange uses ``torch.distributed`` send/recv on the engine's device: tested with gloo on the CPU, correct by
construction but untested here with NCCL.

Memory: the hidden states of every micro-batch of the call stay on the device between layers, on every stage,
about ``rows x seq x hidden x bytes`` (divided by TP under sequence parallelism; rows = the call's rows, at most
``workflow.score_chunk`` in the loop; ``planner.memory.reference_terms`` counts it per stage). Per micro-batch, the
transient activations of one layer and the logits are those of the normal path.

Not reproduced here (``supported`` is False, those layouts keep the per-micro-batch path, nothing is raised):
context parallelism, virtual (interleaved) pipeline stages, multi-token prediction and fp8/fp4 contexts (no recipe
uses them).
"""

from __future__ import annotations

import contextlib

import torch

from asyncflow.engines.megatron.logprobs import token_logprobs


def supported(trainer) -> bool:
    """Whether ``logprobs`` reproduces this trainer's forward: no context parallelism or virtual pipeline stages,
    the language-model head, no multi-token prediction, no fp8/fp4 (any number of pipeline stages)."""
    cfg, config, module = trainer.cfg, trainer.tconfig, trainer.module
    return (cfg.context_parallel == 1 and trainer.head == "lm"
            and not getattr(config, "virtual_pipeline_model_parallel_size", None)
            and not getattr(module, "mtp_process", False) and not config.fp8 and not getattr(config, "fp4", None))


def _boundary_shape(trainer, micro: torch.Tensor) -> tuple[int, int, int]:
    """[s, b, h] of the hidden states a micro-batch carries across a stage boundary (Megatron's ``tensor_shape``:
    the sequence split over TP under sequence parallelism)."""
    seq = micro.shape[1]
    if trainer.tconfig.sequence_parallel:
        seq //= trainer.cfg.tensor_parallel
    return seq, micro.shape[0], trainer.tconfig.hidden_size


def _receive(trainer, micro: list[torch.Tensor]) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_prev_rank()
    dtype = trainer.tconfig.pipeline_dtype or trainer.tconfig.params_dtype
    out = []
    for tok in micro:  # in the order the previous stage sends them
        buf = torch.empty(_boundary_shape(trainer, tok), dtype=dtype, device=trainer.device)
        torch.distributed.recv(buf, src=src, group=group)
        out.append(buf)
    return out


def _send(hidden: list[torch.Tensor]) -> None:
    from megatron.core import parallel_state as ps

    group, dst = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_next_rank()
    for j in range(len(hidden)):
        h, hidden[j] = hidden[j], None  # each micro-batch's hidden states leave once sent
        torch.distributed.send(h.contiguous(), dst=dst, group=group)


@torch.no_grad()
def logprobs(trainer, streamer, tokens: torch.Tensor) -> torch.Tensor | None:
    """log p(tokens[:, 1:]) [b, s-1] (on the CPU) of ``trainer``'s model, whose weights ``streamer`` holds, on the
    last pipeline stage (None on the others); ``tokens`` [b, s] is split into micro-batches as
    ``MegatronTrainer.logprobs`` splits it. Collective over the pipeline group (and the TP group, as any forward)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.utils import make_viewless_tensor

    from asyncflow.models.device import CPU

    module, device = trainer.module, trainer.device
    micro = [mb["tokens"].to(device) for mb in trainer._split({"tokens": tokens})]
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=device).unsqueeze(0)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    with streamer.held():
        received = [None] * len(micro) if first else _receive(trainer, micro)
        # A tensor left by Megatron's schedule (set_input_tensor) would set the rotary length instead of ours.
        module.set_input_tensor(None)
        hidden, extra = [], []
        for j, tok in enumerate(micro):
            pre = module._preprocess(input_ids=tok, position_ids=positions.expand(tok.shape[0], -1),
                                     decoder_input=received[j])
            received[j] = None
            hidden.append(make_viewless_tensor(inp=pre[0], requires_grad=True, keep_graph=True))
            extra.append({"rotary_pos_emb": pre[1], "rotary_pos_cos": pre[2], "rotary_pos_sin": pre[3],
                          "sequence_len_offset": pre[4], "padding_mask": pre[5]})
        forked = trainer.tconfig.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            for i, layer in enumerate(module.decoder.layers):
                with streamer.layer(i):
                    for j in range(len(micro)):
                        hidden[j], _ = layer(hidden_states=hidden[j], attention_mask=None, context=None,
                                             context_mask=None, attention_bias=None, inference_context=None,
                                             packed_seq_params=None, **extra[j])
        if not last:
            _send(hidden)
            return None
        weight = module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights else None
        out = []
        for j, tok in enumerate(micro):
            h, hidden[j] = hidden[j], None  # each micro-batch's hidden states leave once its logits are made
            if module.decoder.final_layernorm is not None:
                h = module.decoder.final_layernorm(h)
            logits, _ = module.output_layer(h, weight=weight, runtime_gather_output=None)
            logits = logits.transpose(0, 1)  # [s, b, V/tp] -> [b, s, V/tp], as GPTModel returns them
            out.append(token_logprobs(logits[:, :-1], tok[:, 1:], trainer.arch.vocab_size))
    return torch.cat(out, dim=0).to(CPU)  # one device -> host copy, after the last micro-batch
