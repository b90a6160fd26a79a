"""Context parallelism's split and gather on a real gloo CP group of two ranks (Megatron's parallel state).

Each rank cuts a micro-batch with ``context_parallel.split`` (Megatron's ``get_batch_on_this_cp_rank``
underneath), computes a per-position stand-in for the log-probs from its *local* tokens, labels and positions
only, and ``reduce_metrics`` must give back, on both ranks, exactly what the full sequence gives without CP.
The model's attention over CP ranks is Transformer Engine's and cannot run here.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow.models.parallel import free_port
from tests.forkserver import start_method

pytestmark = pytest.mark.slow  # every test reads a module fixture of spawned Megatron ranks

SEQ, ROWS, CP = 11, 3, 2  # 11 tokens: padded to 12 = 3 x (2 x CP) chunks of 3


def _full_batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 19, (ROWS, SEQ), generator=gen)
    mask = torch.zeros(ROWS, SEQ - 1)
    mask[:, 4:] = 1.0
    return {"tokens": tokens, "mask": mask, "advantages": torch.rand(ROWS, SEQ - 1, generator=gen) * mask,
            "lag": torch.tensor([0, 1, 0])}


def _stand_in(tokens, labels, positions):
    """A per-position value that depends on the token, its label and its global position."""
    return labels.float() * 1000 + tokens.float() * 10 + positions.float() / 100


def _worker(rank, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(CP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from asyncflow.engines.megatron import context_parallel
    from asyncflow.models.parallel import destroy_megatron, init_megatron

    init_megatron(1, 1, context_parallel=CP)
    mb = _full_batch()
    local, positions, labels = context_parallel.split(mb, SEQ, CP)
    values = _stand_in(local["tokens"], labels, positions)
    mask = local["mask"]
    metrics = {"old_logprobs": values, "tokens": mask.sum(), "adv_sum": (local["advantages"] * mask).sum(),
               "gap_max": (values * mask).max(), "fresh_max": torch.tensor(float("nan")),
               "one_max": (values * mask).max() if rank == 1 else torch.tensor(float("nan"))}
    reduced = context_parallel.reduce_metrics(metrics, SEQ, CP, ps.get_context_parallel_group())
    result = {"cp_rank": ps.get_context_parallel_rank(), "local_len": local["tokens"].shape[1],
              "positions": positions[0].tolist(), "lag_kept": torch.equal(local["lag"], mb["lag"]),
              **{k: v.tolist() for k, v in reduced.items()}}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_megatron()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=CP, join=True, start_method=start_method())
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(CP)]


def test_each_rank_holds_two_balanced_chunks(ranks):
    assert [r["local_len"] for r in ranks] == [6, 6]
    # Rank 0: chunks 0 and 3 of 4 (positions 0-2, 9-11); rank 1: chunks 1 and 2.
    assert ranks[0]["positions"] == [0, 1, 2, 9, 10, 11] and ranks[1]["positions"] == [3, 4, 5, 6, 7, 8]
    assert all(r["lag_kept"] for r in ranks)  # per-row fields are not cut


def test_gathered_outputs_equal_the_whole_sequence_on_every_rank(ranks):
    mb = _full_batch()
    tokens = mb["tokens"]
    full = _stand_in(tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ - 1).expand(ROWS, -1))
    for r in ranks:
        assert torch.equal(torch.tensor(r["old_logprobs"]), full)  # labels shifted before the split
        assert r["tokens"] == mb["mask"].sum().item()
        assert r["adv_sum"] == pytest.approx((mb["advantages"] * mb["mask"]).sum().item(), rel=1e-6)
        assert r["gap_max"] == pytest.approx((full * mb["mask"]).max().item())  # a max, not a sum
        assert r["fresh_max"] != r["fresh_max"]  # NaN on every rank stays NaN (no fresh samples)
    assert ranks[0]["one_max"] == ranks[1]["one_max"]  # one rank's value: NaN elsewhere is ignored
