"""A Megatron-LM user's model provider: a ``GPTModel`` from the ``TransformerConfig`` and a layer spec.

AsyncFlow calls it once per model chunk with the ``TransformerConfig`` it derived from the checkpoint's
``config.json`` (and from ``trainer.*``: parallel sizes, precision, recompute) and a ``ModelContext``
(``asyncflow.models.provider``) holding what the provider would otherwise hard-code: the padded vocabulary,
the rope base, the longest position and the parallel state. Dense Llama / Qwen models; swap in your own spec,
modules or model class here.
"""

from __future__ import annotations

import importlib.util


def model_provider(config, pre_process: bool = True, post_process: bool = True, context=None):
    """This pipeline stage's ``GPTModel``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if importlib.util.find_spec("transformer_engine") is not None:  # GPU clusters
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:  # Megatron's own modules (CPU)
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=context.padded_vocab_size,
        max_sequence_length=context.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=context.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=int(context.rotary_base),
    )
