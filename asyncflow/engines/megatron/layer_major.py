"""Log-probabilities of a streamed reference model, layer-major: each decoder layer visits the device once a call.

A ``LayerStreamer`` (``trainer.reference_placement: offload``) keeps the reference's weights in host memory and
loads a decoder layer whenever a forward pass runs it. Megatron's schedule runs the whole model once per
micro-batch, so a call of N micro-batches copies every layer N times host -> device (the recipes use micro-batches
of one row: at 7B-32B that is terabytes a step). Here the loops are swapped:

1. embed every micro-batch (``GPTModel._preprocess``: the embedding and rotary embedding ``GPTModel.forward``
   computes, nothing else);
2. for each decoder layer: load it once, run it over every micro-batch's hidden states, drop it;
3. per micro-batch: final norm, output layer and the vocab-parallel ``token_logprobs`` of the normal path.

Each micro-batch meets the same layer calls with the same arguments as in ``TransformerBlock.forward`` (attention
mask None: causal; the rng tracker forked under sequence parallelism), so the results equal the resident model's.
Tensor parallelism changes nothing: a layer's weights are this rank's shard and its collectives run inside it, in
the same order on every rank of the group (expert parallelism too: every rank runs the same loop).

Memory: the hidden states of every micro-batch of the call stay on the device between layers, about
``rows x seq x hidden x bytes`` (divided by TP under sequence parallelism; rows = the call's rows, at most
``workflow.score_chunk`` in the loop; ``planner.memory.reference_terms`` counts it). Per micro-batch, the
transient activations of one layer and the logits are those of the normal path.

Only for one pipeline stage (``pipeline_parallel: 1``) without context parallelism: with PP > 1 the stages
exchange activations per micro-batch through Megatron's schedule, which interleaves the stages' work; a stage
cannot run layer-major without holding the whole call's activations of every stage boundary and giving up that
overlap. Those layouts keep the per-micro-batch path (``supported`` is False there, nothing is raised).
Multi-token prediction and fp8/fp4 contexts are not reproduced here either (no recipe uses them).
"""

from __future__ import annotations

import contextlib

import torch

from asyncflow.engines.megatron.logprobs import token_logprobs


def supported(trainer) -> bool:
    """Whether ``logprobs`` reproduces this trainer's forward: one pipeline stage, no context parallelism, the
    language-model head, no multi-token prediction, no fp8/fp4."""
    cfg, config, module = trainer.cfg, trainer.tconfig, trainer.module
    return (cfg.pipeline_parallel == 1 and cfg.context_parallel == 1 and trainer.head == "lm"
            and not getattr(module, "mtp_process", False) and not config.fp8 and not getattr(config, "fp4", None))


@torch.no_grad()
def logprobs(trainer, streamer, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, 1:]) [b, s-1] (on the CPU) of ``trainer``'s model, whose weights ``streamer`` holds;
    ``tokens`` [b, s] is split into micro-batches as ``MegatronTrainer.logprobs`` splits it."""
    from megatron.core import tensor_parallel
    from megatron.core.utils import make_viewless_tensor

    from asyncflow.models.device import CPU

    module, device = trainer.module, trainer.device
    micro = [mb["tokens"].to(device) for mb in trainer._split({"tokens": tokens})]
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=device).unsqueeze(0)
    with streamer.held():
        hidden, extra = [], []
        for tok in micro:
            pre = module._preprocess(input_ids=tok, position_ids=positions.expand(tok.shape[0], -1))
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
