"""Multi-process stress: 8 producers and 8 consumer tasks (some with several DP/MP ranks) over two
storage units; every row carries a checksum. Nothing lost, nothing delivered twice to one task, every
field intact, and the rank rules hold (MP ranks of one replica see the same rows)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import zlib
from collections import Counter

import pytest

PRODUCERS, PUTS, ROWS_PER_PUT = 8, 40, 10
TOTAL = PRODUCERS * PUTS * ROWS_PER_PUT
PART = "stress"


def _checksum(tokens, logp) -> int:
    return zlib.crc32(tokens.numpy().tobytes() + logp.numpy().tobytes())


def producer(address: str, config, pid: int) -> None:
    import torch

    from asyncflow.transfer_queue import TransferQueueClient

    gen = torch.Generator().manual_seed(pid)
    with TransferQueueClient(address, config) as client:
        for put in range(PUTS):
            lengths = torch.randint(1, 96, (ROWS_PER_PUT,), generator=gen).tolist()
            tokens = [torch.randint(0, 50000, (n,), generator=gen) for n in lengths]
            logp = torch.randn(ROWS_PER_PUT, 8, generator=gen)
            meta = [{"p": pid, "s": put * ROWS_PER_PUT + i, "crc": _checksum(tokens[i], logp[i])}
                    for i in range(ROWS_PER_PUT)]
            client.put(PART, {"tokens": tokens, "logp": logp, "meta": meta},
                       group_ids=[pid * 1000 + put] * ROWS_PER_PUT, versions=[put % 4] * ROWS_PER_PUT)


def _verify(batch, errors: list) -> list[tuple[int, int]]:
    keys = []
    for i, m in enumerate(batch["meta"]):
        keys.append((m["p"], m["s"]))
        if "logp" in batch.keys() and _checksum(batch["tokens"][i], batch["logp"][i]) != m["crc"]:
            errors.append(f"checksum mismatch for {keys[-1]}")
        if "reward" in batch.keys() and float(batch["reward"][i]) != float(m["crc"] % 1000):
            errors.append(f"wrong reward for {keys[-1]}")
        if batch.meta.lengths[i] != len(batch["tokens"][i]):
            errors.append(f"length metadata wrong for {keys[-1]}")
    return keys


def consumer(address: str, config, task: str, results) -> None:
    import torch

    from asyncflow.transfer_queue import TransferQueueClient

    fields = ["tokens", "logp", "meta"]
    ranks = [(0, 1, 0, 1)]
    kwargs: dict = {}
    if task == "reward":
        fields = ["tokens", "meta"]
    elif task == "train":
        fields, ranks = ["tokens", "meta", "reward"], [(d, 2, m, 2) for d in range(2) for m in range(2)]
        kwargs = {"sampler": "token_balanced"}
    elif task == "group":
        kwargs = {"sampler": "group", "sampler_args": {"group_size": ROWS_PER_PUT}}
    elif task == "dp3":
        ranks = [(d, 3, 0, 1) for d in range(3)]
    out: dict = {}
    errors: list = []

    def run(dp_rank, dp_size, mp_rank, mp_size):
        seq = []
        with TransferQueueClient(address, config) as client:
            for batch in client.iter_batches(PART, task, fields, 20, timeout=120, dp_rank=dp_rank,
                                             dp_size=dp_size, mp_rank=mp_rank, mp_size=mp_size,
                                             ragged="list", **kwargs):
                keys = _verify(batch, errors)
                if task == "group" and len(set(batch.meta.group_ids)) * ROWS_PER_PUT != len(batch):
                    errors.append("group sampler split a group")
                if task == "reward":
                    rewards = torch.tensor([float(m["crc"] % 1000) for m in batch["meta"]])
                    client.put(PART, {"reward": rewards}, indexes=batch.indexes)
                seq.append(keys)
        out[(dp_rank, mp_rank)] = seq

    threads = [threading.Thread(target=run, args=r) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((task, {f"{k[0]},{k[1]}": v for k, v in out.items()}, errors))


@pytest.mark.slow
def test_many_producers_and_consumers(make_tq):
    tq = make_tq(deployment="processes", num_storage_units=2, storage_unit_capacity_bytes=128 << 20,
                 heartbeat_timeout_s=30.0)
    config = tq.config
    with tq.client() as client:
        client.create_partition(PART, expected_rows=TOTAL)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "asyncflow.transfer_queue.client"])
    results = ctx.Queue()
    tasks = ["c0", "c1", "c2", "c3", "reward", "train", "group", "dp3"]
    procs = [ctx.Process(target=consumer, args=(tq.address, config, t, results)) for t in tasks]
    procs += [ctx.Process(target=producer, args=(tq.address, config, p)) for p in range(PRODUCERS)]
    try:
        for p in procs:
            p.start()
        collected = {}
        for _ in tasks:
            task, per_rank, errors = results.get(timeout=600)
            assert not errors, (task, errors[:5])
            collected[task] = per_rank
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    everything = {(p, s) for p in range(PRODUCERS) for s in range(PUTS * ROWS_PER_PUT)}
    for task, per_rank in collected.items():
        replicas: dict[str, list] = {}
        for rank, seq in per_rank.items():
            dp, mp_rank = rank.split(",")
            replicas.setdefault(dp, []).append(seq)
        received = Counter()
        for seqs in replicas.values():
            assert all(s == seqs[0] for s in seqs), f"{task}: MP ranks of one replica got different rows"
            received.update(key for batch in seqs[0] for key in batch)
        assert set(received) == everything, f"{task}: {len(everything - set(received))} rows missing"
        assert max(received.values()) == 1, f"{task}: a row was delivered twice"
    with tq.client() as client:
        status = client.status(PART)["partitions"][PART]
        assert status["rows"] == TOTAL and status["sealed"]
        assert all(t["read"] == TOTAL and t["in_flight"] == 0 for t in status["tasks"].values())
