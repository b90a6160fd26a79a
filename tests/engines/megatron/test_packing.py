"""Sequence packing (``micro_batch_tokens``) gives the per-row logprobs of today's padded path at TP2, PP2 and EP2.

Each layout runs twice on gloo, from the same Hugging Face weights: today's path (every row padded to the run's
fixed length, ``micro_batch_size`` rows per micro-batch, fixed pipeline shapes) and the packed one (rows grouped
by a token budget, each micro-batch padded to its own longest row, one Megatron schedule over micro-batches of
different shapes: the pipeline stages exchange them through Megatron's variable sequence lengths). The dense
layouts also take one optimizer step on a token-mean loss and compare the logprobs after it, so the gradients of
both groupings agree as well. The MoE layout compares the forward only: its router's load-balancing loss counts
the padding tokens, so the padded path's gradient is not the packed one's.
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
