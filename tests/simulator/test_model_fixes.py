"""The at-scale model's corrections (issue 42, the independent review of the simulator): each test fails on the
model as it was (attention FLOPs about 3x in training and used as a forward cost, MoE decode charged for every
expert at any batch, a rollout rank's weight bytes taken from a trainer rank, pipeline-parallel and reference
micro-batches padded instead of packed)."""

from pathlib import Path

import pytest

from asyncflow.recipes_check import load_recipe
from asyncflow.simulator import published as pub
from asyncflow.simulator.costs import CostModel, RolloutCosts, TrainCosts, WeightSyncCosts
from asyncflow.simulator.sim import Pipe, simulate
from asyncflow.simulator.workload import Workload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def arch7b():
    return load_recipe(REPO / "recipes/qwen2.5-7b")[0].arch


@pytest.fixture(scope="module")
def moe():
    return load_recipe(REPO / "recipes/qwen3-30b-a3b")[0].arch


def test_training_attention_is_6_L_h_d_per_token_pair_and_the_forward_a_third_of_it(arch7b):
    costs = pub.gpu_costs(arch7b, trainer_devices_per_replica=2, gpu=pub.H100).variant("device-tp1").train
    replica = 2 * pub.H100.bf16_flops * pub.TRAIN_MFU
    attn = arch7b.num_layers * arch7b.num_attention_heads * arch7b.head_dim
    seq = 4096  # one packed row: tokens x its own length
    attention = costs.micro_s(seq, seq) - costs.per_micro_s - costs.per_token_s * seq
    assert attention == pytest.approx(6 * attn * seq * seq / replica)
    forward = costs.reference_s(seq, seq) - costs.ref_per_call_s - costs.ref_per_token_s * seq
    assert forward == pytest.approx(attention / 3)
    assert costs.ref_per_token_s == pytest.approx(costs.per_token_s / 3)


def test_moe_decode_reads_only_the_experts_its_batch_touches(moe):
    r = pub.gpu_costs(moe, 2).variant("device-tp2").rollout
    assert r.expert_read_s > 3 * r.step_s  # the routed experts are most of Qwen3-30B-A3B's bytes
    one = r.fixed_s(1) - r.step_s
    assert one == pytest.approx(r.expert_read_s * 8 / 128)  # top-8 of 128 experts
    assert r.fixed_s(256) - r.step_s == pytest.approx(r.expert_read_s, rel=1e-3)  # a large batch touches all
    assert r.decode_step(1, 0) < r.decode_step(64, 0) / 3
    dense = pub.gpu_costs(load_recipe(REPO / "recipes/qwen2.5-7b")[0].arch, 2).variant("device-tp1").rollout
    assert dense.fixed_s(1) == dense.fixed_s(256) == dense.step_s


def test_a_rollout_rank_reads_its_tp_shard_of_the_whole_model(arch7b):
    costs = pub.gpu_costs(arch7b, trainer_devices_per_replica=4)
    one, four = costs.variant("device-tp1"), costs.variant("device-tp4")
    assert one.apply_bytes == pytest.approx(4 * one.weight_bytes)  # TP1 reads the whole model, not a 1/4 shard
    assert four.apply_bytes == pytest.approx(one.apply_bytes / 4)
    # ... and the simulator charges it: the load_weights span is apply_per_byte_s x apply_bytes.
    w = Workload(mode="sync", max_staleness=0, steps=3, prompts_per_step=1, samples_per_prompt=2, rollout_chunk=2,
                 micro_batch_size=2, reference=False, lengths="constant:4", placement="devices", warmup_steps=1)
    model = CostModel(rollout=RolloutCosts(step_s=0.01), train=TrainCosts(per_token_s=1e-3),
                      weight_sync=WeightSyncCosts(apply_per_byte_s=0.01), weight_bytes=1.0, rollout_weight_bytes=100)
    loads = [e for e in simulate(w, model).timeline.to_chrome_trace()["traceEvents"]
             if e.get("name") == "load_weights"]
    assert loads and all(e["dur"] / 1e6 == pytest.approx(1.0) for e in loads)


def test_packed_micro_batches_cost_their_rows_own_tokens_under_pipeline_parallelism():
    w = Workload(steps=1, prompts_per_step=1, samples_per_prompt=4, prompt_len=100, max_new_tokens=9116,
                 fixed_shape=True, pipeline_parallel=2, lengths="constant:1", placement="devices")
    lengths = [[1000, 200, 3000, 50]]
    padded = Pipe(w, CostModel(), lengths).padded(0, [0, 1, 2, 3])
    assert padded == 4 * 9216  # today's PP path: every row padded to 9,216 tokens
    packed = Pipe(Workload(**{**w.__dict__, "packing": True}), CostModel(), lengths)
    real = sum(100 + n for n in lengths[0])
    assert packed.padded(0, [0, 1, 2, 3]) == real
    # Each row attends within itself: sum(len^2), not tokens x the longest row.
    assert packed.attended(0, [0, 1, 2, 3], real) * real == pytest.approx(sum((100 + n) ** 2 for n in lengths[0]))


def test_a_packed_reference_chunk_is_not_padded_to_its_longest_row():
    w = Workload(mode="sync", max_staleness=0, steps=2, prompts_per_step=1, samples_per_prompt=4, rollout_chunk=4,
                 score_chunk=4, micro_batch_size=4, ppo_epochs=1, reference=True, prompt_len=4, max_new_tokens=64,
                 lengths="constant:4", placement="devices", warmup_steps=1)
    lengths = [[60, 4, 4, 4]] * 2
    costs = CostModel(rollout=RolloutCosts(step_s=1e-3), train=TrainCosts(ref_per_token_s=1e-3))

    def ref_engine_s(workload):
        spans = [e for e in simulate(workload, costs, lengths).timeline.to_chrome_trace()["traceEvents"]
                 if e.get("name") == "ref_logprobs"]
        return spans[0]["args"]["engine_s"]

    real = sum(4 + n for n in lengths[0])
    assert ref_engine_s(Workload(**{**w.__dict__, "packing": True})) == pytest.approx(1e-3 * real)
    assert ref_engine_s(w) > 2 * 1e-3 * real  # padded: 4 rows x the longest


def test_a_hybrid_sharded_trainer_gathers_within_its_node_and_all_reduces_a_shard_across(arch7b):
    """verl's fully-async scripts shard FSDP over 8 GPUs (``fsdp_size``) and replicate across nodes: the gathers
    and the reduce-scatter cross NVLink, only 1/8 of the gradients crosses the inter-node link."""
    full = pub.gpu_costs(arch7b, 4, pub.H20, sharded=True).variant("device-tp4").train
    hybrid = pub.gpu_costs(arch7b, 4, pub.H20, sharded=True, shard_devices=8).variant("device-tp4").train
    n = pub.active_params(arch7b)  # dense: every parameter
    # Per optimizer step: two bf16 weight all-gathers and a bf16 gradient reduce-scatter within the node, a ring
    # all-reduce of the GPU's eighth of the gradients across (grad_allreduce_s holds half: allreduce_s doubles it).
    within = 3 * (2 * n) * 7 / 8 / pub.H20.nvlink_bytes_s
    across = 2 * (2 * n / 8) / pub.LINK_BYTES_S
    assert hybrid.grad_allreduce_s == pytest.approx((within + across) / 2)
    assert full.grad_allreduce_s == pytest.approx(3 * (2 * n) / 2 / pub.LINK_BYTES_S)
    assert hybrid.allreduce_s(16) < full.allreduce_s(16) / 5
    assert hybrid.per_token_s == full.per_token_s  # only the traffic changes


def test_verl_fsdp_reduces_fp32_gradients_and_a_colocated_step_offloads_its_shard_group(arch7b):
    """verl's colocated scripts shard over 2 GPUs and offload the actor inside update_actor; its FSDP workers
    reduce gradients in fp32: each GPU offloads half the trainer's state (not 1 / every GPU), and twice the
    bf16 bytes of gradients cross the nodes."""
    bf16 = pub.gpu_costs(arch7b, 4, pub.H20, sharded=True, shard_devices=2, rollout_tps=(4,)).variant("device-tp4")
    fp32 = pub.gpu_costs(arch7b, 4, pub.H20, sharded=True, shard_devices=2, rollout_tps=(4,),
                         grad_bytes=4).variant("device-tp4")
    n = pub.active_params(arch7b)
    assert fp32.train.grad_allreduce_s - bf16.train.grad_allreduce_s == pytest.approx(
        (2 * n * 1 / 2 / pub.H20.nvlink_bytes_s + 2 * (2 * n / 2) / pub.LINK_BYTES_S) / 2)
    switch = fp32.switch
    assert switch.state_shards == 2
    assert switch.offload_step_s(128) == pytest.approx(switch.offload_s / 2)
    assert switch.step_s(128) == pytest.approx(switch.offload_s / 2 + switch.sleep_wake_s + switch.reload_s)
    # Megatron's recipes (not sharded) keep the state spread over every trainer device.
    megatron = pub.gpu_costs(arch7b, 4, pub.H20, rollout_tps=(4,)).variant("device-tp4").switch
    assert megatron.state_shards == 0 and megatron.offload_step_s(128) == pytest.approx(megatron.offload_s / 128)


def test_verl_runs_read_the_published_step_as_512_prompts_and_their_columns():
    """A published fully-async step is one weight sync: 4 local updates of 4 x 32 prompts, the colocated step's 512
    prompts x 16; its columns and its total-time columns are the README's."""
    from asyncflow.simulator.published_runs import VERL

    assert {(r.prompts, r.samples, r.mini_batches) for r in VERL} == {(512, 16, 16)}
    assert all(r.old_logprob == (r.rollout_gpus == 0) and r.grad_bytes == 4 for r in VERL)
    # fsdp_size: 2 in the colocated scripts, 8 in the fully-async ones.
    assert {(r.rollout_gpus == 0, r.shard_devices) for r in VERL} == {(True, 2), (False, 8)}
    async16 = next(r for r in VERL if r.name.endswith("16:16"))
    assert async16.published_columns == (21.26, 0.0, 313.81)
    # 7h 58m, 16h 21m, 1d 0h 53m, 1d 9h 26m: 287, 302, 307, 308 s a step.
    assert [round(x) for x in async16.hundreds_s()] == [287, 302, 307, 308]
