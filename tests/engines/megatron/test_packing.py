"""Sequence packing (``micro_batch_tokens``) gives the per-row logprobs of today's padded path at TP2, PP2 and EP2.

Each layout runs twice on gloo, from the same Hugging Face weights: today's path (every row padded to the run's
fixed length, ``micro_batch_size`` rows per micro-batch, fixed pipeline shapes) and the packed one (rows grouped
by a token budget, each micro-batch padded to its own longest row, one Megatron schedule over micro-batches of
different shapes: the pipeline stages exchange them through Megatron's variable sequence lengths). The dense
layouts also take one optimizer step on a token-mean loss and compare the logprobs after it, so the gradients of
both groupings agree as well. The MoE layout compares the forward only: its router's load-balancing loss counts
the padding tokens, so the padded path's gradient is not the packed one's.

Packing also lets the data-parallel size not divide a step's rows: two replicas take shares of 6 and 5 rows (the
TransferQueue's ``token_balanced`` split) through ``MegatronActor.train_step``, and the weights after the step are
those of one replica that trained all 11.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow.models.parallel import free_port
from tests.forkserver import start_method

pytestmark = pytest.mark.slow
SEQ = 48  # the fixed length of the padded path (max prompt + max response)
BUDGET = 64  # packed tokens per micro-batch
TOL = 1e-5
TOL_AFTER = 1e-4  # after an Adam step (see test_parallel_equivalence: last-bit gradient differences)


def rows(vocab: int = 19) -> tuple[list[list[int]], list[list[int]]]:
    """Twelve rows of long-tailed lengths (responses 1 to 40 tokens), the same in every process."""
    gen = torch.Generator().manual_seed(3)
    response_lens = [1, 2, 3, 3, 4, 5, 6, 8, 9, 12, 20, 40]
    prompts = [torch.randint(4, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(3, 7, (12,),
                                                                                                   generator=gen)]
    responses = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in response_lens]
    return prompts, responses


def _micro_batches(prompts, responses, packed: bool) -> tuple[list[list[int]], list[dict]]:
    from asyncflow.workflow.batching import fit_seq_len, pack_tokens, plan_micro_batches, row_tokens

    plan = plan_micro_batches(row_tokens(prompts, responses), BUDGET, SEQ) if packed else \
        [list(range(i, i + 2)) for i in range(0, len(prompts), 2)]
    micro = []
    for group in plan:
        p, r = [prompts[i] for i in group], [responses[i] for i in group]
        tokens, mask = pack_tokens(p, r, fit_seq_len(p, r, SEQ) if packed else SEQ, 0)
        micro.append({"tokens": tokens, "mask": mask})
    return plan, micro


def _response_logprobs(trainer, prompts, responses, packed: bool) -> list[list[float]] | None:
    from asyncflow.workflow.batching import response_slices

    plan, micro = _micro_batches(prompts, responses, packed)
    outputs = trainer.forward_backward(micro, len(micro), lambda lp, mb: (lp.sum() * 0, {"lp": lp.detach()}),
                                       forward_only=True)
    if not outputs:
        return None
    found: list = [None] * len(prompts)
    for group, out in zip(plan, outputs):
        pieces = response_slices(out["lp"], [prompts[i] for i in group], [responses[i] for i in group])
        for i, piece in zip(group, pieces):
            found[i] = piece.tolist()
    return found


def _train_step(trainer, prompts, responses, packed: bool) -> None:
    """One optimizer step on the token-mean negative log-likelihood of the responses."""
    _, micro = _micro_batches(prompts, responses, packed)
    total = float(sum(len(r) for r in responses))
    trainer.zero_grad()
    trainer.forward_backward(micro, len(micro), lambda lp, mb: (-(lp * mb["mask"]).sum() / total, {}))
    trainer.optimizer_step()


def _worker(rank, world, port, tp, pp, ep, model_dir, packed, train, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.parallel import destroy_megatron
    from asyncflow.workflow.batching import fit_seq_len

    cfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, micro_batch_size=2,
                         micro_batch_tokens=BUDGET if packed else 0, lr=1e-2)
    trainer = MegatronTrainer(cfg, model_dir)
    trainer.load_hf(model_dir)
    prompts, responses = rows()
    before = _response_logprobs(trainer, prompts, responses, packed)
    after = None
    if train:
        _train_step(trainer, prompts, responses, packed)
        after = _response_logprobs(trainer, prompts, responses, packed=False)
    if before is not None:
        _, micro = _micro_batches(prompts, responses, packed)
        real = sum(len(p) + len(r) for p, r in zip(prompts, responses))
        assert max(fit_seq_len([p], [r], SEQ) for p, r in zip(prompts, responses)) <= SEQ
        result = {"before": before, "after": after, "moved": sum(mb["tokens"].numel() for mb in micro),
                  "real": real, "variable": trainer.tconfig.variable_seq_lengths}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_megatron()


def run(world, tp, pp, ep, model_dir, out_dir, packed: bool, train: bool) -> list[dict]:
    """Every last-stage rank's results."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = (world, free_port(), tp, pp, ep, str(model_dir), packed, train, str(out_dir))
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method=start_method())
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from asyncflow.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_moe") / "qwen3_moe", family="qwen3_moe", seed=0)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2"])
def test_packed_logprobs_match_the_padded_path(layout, tiny_model_dir, moe_model_dir, tmp_path):
    tp, pp, ep = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}[layout]
    model_dir, train = (moe_model_dir, False) if layout == "ep2" else (tiny_model_dir, True)
    padded = run(2, tp, pp, ep, model_dir, tmp_path / "padded", packed=False, train=train)
    packed = run(2, tp, pp, ep, model_dir, tmp_path / "packed", packed=True, train=train)
    assert len(padded) == len(packed) == (2 if layout != "pp2" else 1)  # last-stage ranks report
    for ref, res in zip(padded, packed):
        assert res["variable"] == (layout == "pp2") and not ref["variable"]
        for key, tol in (("before", TOL), ("after", TOL_AFTER)) if train else (("before", TOL),):
            diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(ref[key], res[key]))
            assert diff <= tol, f"{key}: max |diff| {diff}"
        # Packing moves about the real tokens; the fixed padded path moves every row at SEQ.
        assert ref["moved"] == 12 * SEQ
        assert res["moved"] <= 1.35 * res["real"] < ref["moved"]  # rows this short lose most to rounding to 8
    if train:  # the step changed the model (the comparison is not between two no-ops)
        before, after = padded[0]["before"], padded[0]["after"]
        assert max(abs(x - y) for a, b in zip(before, after) for x, y in zip(a, b)) > 100 * TOL_AFTER


def _dp_worker(rank, world, port, model_dir, count, out_dir):
    """One optimizer step of ``MegatronActor`` at DP ``world`` on the first ``count`` rows, each replica on the
    share the TransferQueue's ``token_balanced`` sampler deals it, packed as the actor packs it; then the
    logprobs of every row."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import numpy as np

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron
    from asyncflow.transfer_queue.samplers import TokenBalancedSampler
    from asyncflow.workflow.batching import fit_seq_len, pack_tokens, plan_micro_batches, row_tokens, split_to_count

    actor = MegatronActor(MegatronConfig(data_parallel=world, micro_batch_size=2, micro_batch_tokens=BUDGET, lr=1e-2),
                          model_dir)
    prompts, responses = (part[:count] for part in rows())
    share = TokenBalancedSampler().split(list(range(count)), np.array(row_tokens(prompts, responses)), world)[rank]
    p, r = [prompts[i] for i in share], [responses[i] for i in share]
    plan = plan_micro_batches(row_tokens(p, r), BUDGET, SEQ)
    plan = split_to_count(plan, max(actor.gather_data_parallel([len(plan)])))
    micro = []
    for group in plan:
        mp_, mr = [p[i] for i in group], [r[i] for i in group]
        tokens, mask = pack_tokens(mp_, mr, fit_seq_len(mp_, mr, SEQ), 0)
        micro.append({"tokens": tokens, "mask": mask})
    # Numerators and a normalizer, as the RL objective returns them: the engine divides by the count over replicas.
    actor.train_step(iter(micro), len(micro),
                     lambda lp, mb: (-(lp * mb["mask"]).sum(), {"normalizer": mb["mask"].sum()}))
    after = _response_logprobs(actor.trainer, prompts, responses, packed=True)
    result = {"share": len(share), "after": after}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_megatron()


def test_uneven_data_parallel_shares_train_as_one_replica(tiny_model_dir, tmp_path):
    # 11 rows over two replicas: 6 and 5, with different token counts. The step's gradient is the token mean over
    # all 11 rows, so the weights after it are those of one replica training all 11.
    results = {}
    for world in (1, 2):
        out = tmp_path / f"dp{world}"
        out.mkdir()
        args = (world, free_port(), str(tiny_model_dir), 11, str(out))
        mp.start_processes(_dp_worker, args=args, nprocs=world, join=True, start_method=start_method())
        results[world] = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert [r["share"] for r in results[2]] == [6, 5] and results[1][0]["share"] == 11
    one = results[1][0]["after"]
    for res in results[2]:
        diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(one, res["after"]))
        assert diff <= TOL_AFTER, f"max |diff| {diff}"
