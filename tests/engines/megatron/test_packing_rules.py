"""What sequence packing (``micro_batch_tokens``) cannot be combined with, named by key before anything starts, and
the Megatron arguments it turns on (``engines/megatron/features.py``)."""

from asyncflow.config import MegatronConfig
from asyncflow.engines.megatron import features


def _packing_problems(**kw):
    cfg = MegatronConfig(micro_batch_tokens=4096, **kw)
    return [p for p in features.problems(cfg, cuda=True, te=True) if p.startswith("trainer.micro_batch_tokens")]


def test_packing_is_refused_where_shapes_must_agree():
    assert _packing_problems() == []
    assert _packing_problems(pipeline_parallel=2) == []  # dense: variable sequence lengths between stages
    assert "context-parallel" in _packing_problems(context_parallel=2)[0]
    moe_pp = features.problems(MegatronConfig(micro_batch_tokens=1, pipeline_parallel=2), is_moe=True, cuda=True,
                               te=True)
    assert any("allgather" in p for p in moe_pp)
    assert not any("allgather" in p for p in features.problems(
        MegatronConfig(micro_batch_tokens=1, pipeline_parallel=2, moe_token_dispatcher="alltoall"), is_moe=True,
        cuda=True, te=True))
    moe_dp = features.problems(MegatronConfig(micro_batch_tokens=1, expert_parallel=2, data_parallel=2), is_moe=True,
                               cuda=True, te=True)
    assert any("expert-parallel ranks in different data-parallel replicas" in p for p in moe_dp)


def test_variable_sequence_lengths_only_for_packing_under_pipeline_parallelism():
    def kwargs(**kw):
        return features.transformer_kwargs(MegatronConfig(**kw), is_moe=False)

    assert kwargs(pipeline_parallel=2)["variable_seq_lengths"] is False
    assert kwargs(micro_batch_tokens=64)["variable_seq_lengths"] is False
    packed_pp = kwargs(micro_batch_tokens=64, pipeline_parallel=2)
    # Megatron refuses variable lengths with its default MoE dispatcher even in a dense model.
    assert packed_pp["variable_seq_lengths"] is True and packed_pp["moe_token_dispatcher_type"] == "alltoall"
