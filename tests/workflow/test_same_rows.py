"""Model-parallel ranks of one replica must compute on identical batches; a mismatch raises on every rank."""

import torch
import torch.multiprocessing as mp

from asyncflow.engines.megatron.groups import check_same_batches
from asyncflow.models.parallel import free_port
from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.train_services import batch_fingerprint


def _batch(indexes, responses):
    data = {"prompt_ids": [torch.tensor([2, 5, 6])] * len(indexes),
            "response_ids": [torch.tensor(r) for r in responses]}
    return Batch(BatchMeta("p", "actor", list(indexes)), data)


def test_fingerprint_sees_rows_and_tokens():
    base = batch_fingerprint(_batch([0, 1], [[4, 7], [9]]))
    assert torch.equal(base, batch_fingerprint(_batch([0, 1], [[4, 7], [9]])))
    assert not torch.equal(base, batch_fingerprint(_batch([0, 2], [[4, 7], [9]])))  # other row
    assert not torch.equal(base, batch_fingerprint(_batch([0, 1], [[4, 8], [9]])))  # one token differs
    assert not torch.equal(base, batch_fingerprint(_batch([0, 1], [[9], [4, 7]])))  # rows swapped


def _worker(rank, port, out):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    results = []
    for differ in (False, True):  # one pair of processes for both cases: each start costs seconds
        tokens = [[4, 7], [9]] if rank == 0 or not differ else [[4, 7], [11]]
        try:
            check_same_batches([batch_fingerprint(_batch([0, 1], tokens))], None, "step 3 of actor")
            results.append("ok")
        except RuntimeError as e:
            results.append(str(e))
    torch.distributed.destroy_process_group()
    with open(f"{out}/rank{rank}", "w") as f:
        f.write("\n".join(results))


def test_identical_batches_pass_and_a_differing_rank_fails_everywhere(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    same, differing = zip(*((tmp_path / f"rank{r}").read_text().split("\n", 1) for r in range(2)))
    assert same == ("ok", "ok")
    assert all(r.startswith("step 3 of actor: the model-parallel ranks of one replica read different rows")
               for r in differing), differing
