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


def test_micro_batch_widths_round_to_what_the_kernels_need():
    assert features.seq_multiple(MegatronConfig(tensor_parallel=2), cuda=False) == 1  # CPU: the longest row alone
    assert features.seq_multiple(MegatronConfig(tensor_parallel=2), cuda=True) == 8
    # Sequence parallelism splits the width over the tensor-parallel ranks: 8 alone would not divide by 16.
    assert features.seq_multiple(MegatronConfig(tensor_parallel=16, sequence_parallel=True), cuda=True) == 16
    assert features.seq_multiple(MegatronConfig(tensor_parallel=4, sequence_parallel=True), cuda=True) == 8



def test_a_fitted_micro_batch_is_its_longest_row_rounded_to_the_multiple():
    from asyncflow.workflow.batching import fit_seq_len, pack_tokens

    prompts, responses = [[1] * 6] * 3, [[2] * 23, [2] * 27, [2] * 24]  # rows of 29, 33 and 30 tokens
    for multiple, width in ((1, 33), (8, 40)):
        tokens, mask = pack_tokens(prompts, responses, fit_seq_len(prompts, responses, 256, multiple), 0)
        assert tokens.shape == (3, width) and mask.sum() == 23 + 27 + 24
