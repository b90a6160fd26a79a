"""What consumers and producers observe: samplers, consumption, fields, formats, waiting, lifecycle."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from asyncflow.transfer_queue import (
    SAMPLERS,
    BackPressureError,
    BadRequestError,
    Packed,
    TransferQueueTimeoutError,
)


def put_rows(client, partition, n, start=0, **kwargs):
    ids = torch.arange(start, start + n)
    return client.put(partition, {"ids": ids[:, None].repeat(1, 4)}, **kwargs)


# ----------------------------------------------------------------------------- round trips
def test_dense_round_trip_and_dtypes(client):
    client.create_partition("p")
    data = {
        "f32": torch.randn(6, 3, 2),
        "bf16": torch.randn(6, 5).to(torch.bfloat16),
        "i64": torch.randint(-(1 << 40), 1 << 40, (6,)),
        "mask": torch.rand(6, 7) > 0.5,
        "u8": torch.randint(0, 255, (6, 9), dtype=torch.uint8),
    }
    rows = client.put("p", data)
    assert rows == list(range(6))
    batch = client.get("p", "t", list(data), 6)
    for name, value in data.items():
        assert batch[name].dtype == value.dtype and batch[name].shape == value.shape
        assert torch.equal(batch[name], value), name


def test_ragged_list_and_packed(client):
    client.create_partition("p")
    rows = [torch.randn(n, 3) for n in (1, 5, 0, 7, 2)]
    client.put("p", {"resp": rows})
    as_list = client.get("p", "a", ["resp"], 5)["resp"]
    assert isinstance(as_list, list) and all(torch.equal(a, b) for a, b in zip(as_list, rows))
    packed = client.get("p", "b", ["resp"], 5, ragged="packed")["resp"]
    assert isinstance(packed, Packed)
    assert packed.offsets.tolist() == [0, 1, 6, 6, 13, 15]
    assert torch.equal(packed.values, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(packed.to_list(), rows))


def test_packed_input_and_lengths_metadata(client):
    client.create_partition("p")
    values, offsets = torch.arange(10), torch.tensor([0, 3, 3, 10])
    client.put("p", {"tok": Packed(values, offsets)}, versions=[4, 4, 5], group_ids=[0, 0, 1])
    batch = client.get("p", "t", ["tok"], 3)
    assert [t.tolist() for t in batch["tok"]] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8, 9]]
    assert batch.meta.lengths == [3, 0, 7]
    assert batch.meta.versions == [4, 4, 5] and batch.meta.group_ids == [0, 0, 1]


def test_object_fields(client):
    client.create_partition("p")
    values = ["what is 2+2?", {"answer": 4, "tags": ["math"]}, b"\x00raw", 3.5]
    client.put("p", {"prompt": values})
    assert client.get("p", "t", ["prompt"], 4)["prompt"] == values


def test_equal_length_tensor_into_ragged_field(client):
    client.create_partition("p")
    client.put("p", {"tok": [torch.arange(3), torch.arange(5)]})
    client.put("p", {"tok": torch.ones(2, 4, dtype=torch.int64)})  # two rows of length 4
    out = client.get("p", "t", ["tok"], 4)["tok"]
    assert [len(t) for t in out] == [3, 5, 4, 4]


# ----------------------------------------------------------------------------- consumption
def test_no_row_twice_per_task_and_tasks_independent(client):
    client.create_partition("p")
    put_rows(client, "p", 20)
    seen = []
    for _ in range(4):
        seen += client.get("p", "a", ["ids"], 5).indexes
    assert sorted(seen) == list(range(20))
    assert client.poll("p", "a", ["ids"], 1) is None
    assert client.get("p", "b", ["ids"], 20).indexes == list(range(20))  # another task sees all


def test_add_fields_to_existing_rows(client):
    client.create_partition("p")
    put_rows(client, "p", 8)
    batch = client.get("p", "reward", ["ids"], 4)
    client.put("p", {"rewards": batch["ids"][:, 0].float() * 2}, indexes=batch.indexes)
    # The trainer needs both fields: only the 4 rewarded rows are ready.
    assert client.poll("p", "train", ["ids", "rewards"], 5) is None
    out = client.get("p", "train", ["ids", "rewards"], 4)
    assert out.indexes == batch.indexes
    assert torch.equal(out["rewards"], out["ids"][:, 0].float() * 2)


def test_release_hands_unread_rows_out_again(client):
    client.create_partition("p")
    put_rows(client, "p", 6)
    meta = client.get_meta("p", "t", ["ids"], 4)  # handed out, never read (consumer "died")
    assert client.status("p")["partitions"]["p"]["tasks"]["t"]["in_flight"] == 4
    assert client.get("p", "t", ["ids"], 2).indexes == [4, 5]
    assert client.release("p", "t") == 4
    again = client.get("p", "t", ["ids"], 4)
    assert sorted(again.indexes) == sorted(meta.indexes)
    assert client.release("p", "t") == 0  # read rows are not released


# ----------------------------------------------------------------------------- samplers
def test_sampler_registry_lists_valid_names(client):
    client.create_partition("p")
    put_rows(client, "p", 2)
    with pytest.raises(BadRequestError) as err:
        client.get("p", "t", ["ids"], 1, sampler="nope")
    for name in ("sequential", "group", "version", "token_balanced"):
        assert name in SAMPLERS and name in str(err.value)
    with pytest.raises(BadRequestError, match="takes"):
        client.get("p", "t", ["ids"], 1, sampler="sequential", sampler_args={"x": 1})


def test_group_sampler_hands_out_whole_groups_only(client):
    client.create_partition("p")
    # Groups of 4; group 1 is incomplete (3 of 4 rows).
    gids = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    put_rows(client, "p", len(gids), group_ids=gids)
    args = {"sampler": "group", "sampler_args": {"group_size": 4}}
    first = client.get("p", "t", ["ids"], 8, **args)
    assert first.meta.group_ids == [0, 0, 0, 0, 2, 2, 2, 2]
    assert client.poll("p", "t", ["ids"], 4, **args) is None
    put_rows(client, "p", 1, group_ids=[1])
    assert client.get("p", "t", ["ids"], 4, **args).meta.group_ids == [1] * 4
    with pytest.raises(BadRequestError, match="smaller than group_size"):
        client.get("p", "t", ["ids"], 3, **args)


def test_version_sampler_oldest_first_within_staleness(client):
    client.create_partition("p")
    put_rows(client, "p", 6, versions=[3, 1, 2, 0, 3, 2])
    args = {"sampler": "version", "sampler_args": {"current_version": 3, "max_staleness": 1}}
    batch = client.get("p", "t", ["ids"], 3, **args)
    assert batch.meta.versions == [2, 2, 3]
    client.seal("p")
    rest = client.get("p", "t", ["ids"], 3, **args)
    assert rest.meta.versions == [3]  # versions 0 and 1 are beyond the bound: never handed out
    assert client.get("p", "t", ["ids"], 3, **args).done


def test_dp_mp_ranks_of_one_replica_get_the_same_rows(client):
    client.create_partition("p")
    put_rows(client, "p", 16)
    got = {}
    for step in range(2):
        for dp in range(2):
            for mp in range(3):
                b = client.get("p", "train", ["ids"], 4, dp_rank=dp, dp_size=2, mp_rank=mp, mp_size=3)
                got.setdefault((step, dp), []).append(b.indexes)
    for ranks in got.values():
        assert ranks[0] == ranks[1] == ranks[2] and len(ranks[0]) == 4
    all_rows = sorted(r for ranks in got.values() for r in ranks[0])
    assert all_rows == list(range(16))  # replicas never share rows
    with pytest.raises(BadRequestError, match="same requests"):
        client.get("p", "x", ["ids"], 1, mp_rank=0, mp_size=2)
        client.get("p", "x", ["ids"], 2, mp_rank=1, mp_size=2)


def test_token_balanced_split_across_dp(client):
    client.create_partition("p")
    lengths = [100, 1, 1, 1, 50, 50, 2, 2]
    client.put("p", {"tok": [torch.zeros(n) for n in lengths]})
    parts = [client.get("p", "train", ["tok"], 4, sampler="token_balanced", dp_rank=r, dp_size=2)
             for r in range(2)]
    assert sorted(parts[0].indexes + parts[1].indexes) == list(range(8))
    sums = [sum(p.meta.lengths) for p in parts]
    assert all(len(p) == 4 for p in parts)
    assert abs(sums[0] - sums[1]) <= 2, sums  # 104 vs 103 is the best split


def test_shortest_sampler_batches_rows_of_like_length(client):
    """All rows ready at once: each batch takes the shortest left (ties in ready order), so batches are
    padded to about their own length; the lengths a later put sets (a response) are the ones used."""
    client.create_partition("p")
    client.put("p", {"prompt": [torch.zeros(2) for _ in range(8)]})  # prompt lengths: all 2
    response = [9, 3, 7, 3, 1, 12, 5, 8]
    client.put("p", {"resp": [torch.zeros(n) for n in response]}, indexes=list(range(8)),
               lengths=[2 + n for n in response])
    batches = [client.get("p", "train", ["resp"], 3, sampler="shortest", allow_partial=True) for _ in range(3)]
    assert [b.indexes for b in batches] == [[4, 1, 3], [6, 2, 7], [0, 5]]
    assert [b.meta.lengths for b in batches] == [[3, 5, 5], [7, 9, 10], [11, 14]]
    sequential = client.get("p", "other", ["resp"], 3, sampler="sequential")
    assert sequential.indexes == [0, 1, 2]  # the other task still sees ready order


def test_shortest_sampler_deals_to_dp_replicas_in_turn(client):
    client.create_partition("p")
    lengths = [100, 1, 7, 3, 50, 40, 2, 20]
    client.put("p", {"tok": [torch.zeros(n) for n in lengths]})
    parts = [client.get("p", "train", ["tok"], 2, sampler="shortest", dp_rank=r, dp_size=2) for r in range(2)]
    # The 4 shortest (1, 2, 3, 7), dealt shortest first: each replica one of the two shortest.
    assert [p.meta.lengths for p in parts] == [[1, 3], [2, 7]]
    rest = [client.get("p", "train", ["tok"], 2, sampler="shortest", dp_rank=r, dp_size=2) for r in range(2)]
    assert [p.meta.lengths for p in rest] == [[20, 50], [40, 100]]


# ----------------------------------------------------------------------------- waiting
def test_blocking_get_waits_for_producer(client, tq):
    client.create_partition("p")
    result = {}

    def consume():
        with tq.client() as c:
            result["batch"] = c.get("p", "t", ["ids"], 4, timeout=20)

    thread = threading.Thread(target=consume)
    thread.start()
    put_rows(client, "p", 2)
    put_rows(client, "p", 2, start=2)
    thread.join(30)
    assert result["batch"].indexes == [0, 1, 2, 3]


def test_timeout_error_names_task_fields_and_ready_count(client):
    client.create_partition("p")
    rows = put_rows(client, "p", 3)
    client.put("p", {"rewards": torch.ones(1)}, indexes=rows[:1])
    with pytest.raises(TransferQueueTimeoutError) as err:
        client.get("p", "trainer", ["ids", "rewards"], 2, timeout=0.3)
    msg = str(err.value)
    assert "'trainer'" in msg and "rewards (missing in 2 rows)" in msg and "1 rows ready" in msg
    assert "'p'" in msg


def test_poll_returns_none_then_batch(client):
    client.create_partition("p")
    assert client.poll("p", "t", ["ids"], 2) is None
    meta = client.get_meta("p", "t", ["ids"], 2, block=False)
    assert meta.indexes == [] and meta.ready == 0 and not meta.done
    put_rows(client, "p", 2)
    assert client.poll("p", "t", ["ids"], 2).indexes == [0, 1]


def test_streaming_iterator_until_sealed(client, tq):
    client.create_partition("p")

    def produce():
        with tq.client() as c:
            for i in range(5):
                put_rows(c, "p", 3, start=3 * i)
            c.seal("p")

    thread = threading.Thread(target=produce)
    thread.start()
    batches = list(client.iter_batches("p", "t", ["ids"], 4, timeout=20))
    thread.join()
    assert [len(b) for b in batches] == [4, 4, 4, 3]  # final partial batch, then done
    assert sorted(i for b in batches for i in b.indexes) == list(range(15))


def test_expected_rows_seals_automatically(client):
    client.create_partition("p", expected_rows=5)
    put_rows(client, "p", 5)
    assert [len(b) for b in client.iter_batches("p", "t", ["ids"], 2)] == [2, 2, 1]
    with pytest.raises(BadRequestError, match="sealed"):
        put_rows(client, "p", 1)


def test_allow_partial(client):
    client.create_partition("p")
    put_rows(client, "p", 3)
    assert len(client.get("p", "t", ["ids"], 10, allow_partial=True)) == 3


# ----------------------------------------------------------------------------- lifecycle
def test_clear_requires_consumers_unless_forced(client):
    client.create_partition("p", consumers=["reward", "train"])
    rows = put_rows(client, "p", 4)
    client.get("p", "reward", ["ids"], 4)
    with pytest.raises(BadRequestError, match="train"):
        client.clear("p")
    client.get_meta("p", "train", ["ids"], 2)
    with pytest.raises(BadRequestError, match="handed out but not read"):
        client.clear("p", rows[:2])
    client.release("p", "train")
    client.get("p", "train", ["ids"], 4)
    assert client.clear("p", rows[:2]) == 2
    status = client.status("p")["partitions"]["p"]
    assert status["live_rows"] == 2 and status["cleared_rows"] == 2
    assert client.clear("p") == 2
    assert "p" not in client.status()["partitions"]
    client.create_partition("q")
    put_rows(client, "q", 2)
    assert client.clear("q", force=True) == 2


def test_clear_frees_storage_and_status_reports(client):
    client.create_partition("p")
    client.put("p", {"x": torch.zeros(64, 1024)})
    used = sum(u["used_bytes"] for u in client.status()["units"].values())
    assert used >= 64 * 1024 * 4
    client.clear("p", force=True)
    assert sum(u["used_bytes"] for u in client.status()["units"].values()) == 0


def test_auto_clear_after_all_consumers_read(client):
    client.create_partition("p", consumers=["a", "b"], auto_clear=True)
    put_rows(client, "p", 4)
    client.get("p", "a", ["ids"], 4)
    client.get("p", "b", ["ids"], 2)
    assert client.status("p")["partitions"]["p"]["live_rows"] == 2
    client.get("p", "b", ["ids"], 2)
    assert client.status("p")["partitions"]["p"]["live_rows"] == 0


def test_auto_clear_waits_for_every_model_parallel_rank(client):
    # Both TP ranks of a replica read the same rows. The first rank's ack must not free them: the storage
    # would be reused by the next put while the second rank still reads it (it then trained on another
    # step's tokens, a silent corruption seen as a vLLM/Megatron logprob gap at TP=2).
    client.create_partition("p", consumers=["train"], auto_clear=True)
    put_rows(client, "p", 8)
    first = client.get("p", "train", ["ids"], 4, mp_rank=0, mp_size=2)
    assert client.status("p")["partitions"]["p"]["live_rows"] == 8
    client.create_partition("q")
    put_rows(client, "q", 64, start=1000)  # would land in freed storage
    second = client.get("p", "train", ["ids"], 4, mp_rank=1, mp_size=2)
    assert second.indexes == first.indexes
    assert torch.equal(second["ids"], first["ids"]) and torch.equal(first["ids"][:, 0], torch.arange(4))
    assert client.status("p")["partitions"]["p"]["live_rows"] == 4


def test_rows_spread_over_storage_units(client):
    client.create_partition("p")
    data = torch.randn(64, 8192)
    client.put("p", {"x": data, "tok": [torch.arange(i * 100) for i in range(64)]})  # 2 MiB+: split
    assert all(u["used_bytes"] > 0 for u in client.status()["units"].values())
    batch = client.get("p", "t", ["x", "tok"], 64)
    assert set(batch.meta.locations["x"][1]) == {0, 1}  # really read from both units
    assert torch.equal(batch["x"], data)
    assert all(torch.equal(t, torch.arange(i * 100)) for i, t in enumerate(batch["tok"]))


# ----------------------------------------------------------------------------- back-pressure
def test_backpressure_on_bytes_waits_then_times_out(make_tq):
    tq = make_tq(storage_unit_capacity_bytes=1 << 20, num_storage_units=1)
    with tq.client() as client:
        client.create_partition("p")
        first = client.put("p", {"x": torch.zeros(3, 64 << 10)})  # 768 KiB of 1 MiB
        with pytest.raises(BackPressureError, match="capacity"):
            client.put("p", {"x": torch.zeros(2, 64 << 10)}, timeout=0.3)
        assert client.status("p")["partitions"]["p"]["live_rows"] == 3  # failed put left nothing
        with pytest.raises(BadRequestError, match="never fit"):
            client.put("p", {"x": torch.zeros(5, 64 << 10)})

        done = threading.Event()

        def blocked_put():
            with tq.client() as c:
                c.put("p", {"x": torch.ones(2, 64 << 10)}, timeout=20)
            done.set()

        thread = threading.Thread(target=blocked_put)
        thread.start()
        assert not done.wait(0.3)  # waiting for space
        client.clear("p", first, force=True)  # space frees: the parked put goes through
        thread.join(20)
        assert done.is_set()


def test_backpressure_on_rows(make_tq):
    with make_tq(max_rows=4).client() as client:
        client.create_partition("p", consumers=["t"], auto_clear=True)
        put_rows(client, "p", 4)
        with pytest.raises(BackPressureError, match="4/4 rows"):
            put_rows(client, "p", 1, timeout=0.2)
        client.get("p", "t", ["ids"], 2)  # auto-clear frees two rows
        put_rows(client, "p", 2, timeout=5)


# ----------------------------------------------------------------------------- asyncio client
def test_async_client_same_operations(tq):
    async def main():
        async with tq.async_client() as c:
            await c.create_partition("p", expected_rows=12)

            async def consume():
                return [b.indexes async for b in c.iter_batches("p", "t", ["x", "tok"], 5, ragged="packed")]

            consumer = asyncio.ensure_future(consume())
            for i in range(3):
                await c.put("p", {"x": torch.full((4, 2), i), "tok": [torch.arange(k) for k in range(4)]})
            batches = await consumer
            assert [len(b) for b in batches] == [5, 5, 2]
            assert len(await c.poll("p", "w", ["x"], 20)) == 12  # sealed: the final partial batch
            assert (await c.poll("p", "w", ["x"], 20)).done
            meta = await c.get_meta("p", "u", ["x"], 2)
            assert await c.release("p", "u") == 2
            batch = await c.get("p", "u", ["x"], 2)
            assert batch.indexes == meta.indexes
            status = await c.status("p")
            assert status["partitions"]["p"]["tasks"]["t"]["read"] == 12
            with pytest.raises(TransferQueueTimeoutError):
                await c.get("p", "v", ["missing"], 1, timeout=0.2)
            assert await c.clear("p", force=True) == 12

    asyncio.run(main())


def test_process_mode_round_trip(tq_procs):
    with tq_procs.client() as client:
        client.create_partition("p")
        data = torch.randn(32, 1000)
        client.put("p", {"x": data, "tok": [torch.arange(i) for i in range(32)]})
        batch = client.get("p", "t", ["x", "tok"], 32)
        assert torch.equal(batch["x"], data)
        assert all(u.arena is not None for u in client._units.values())  # same host: shared memory


def test_user_sampler_module_is_loaded_by_the_controller(make_tq, tmp_path, monkeypatch):
    (tmp_path / "tq_user_sampler.py").write_text(
        "from asyncflow.transfer_queue.samplers import Sampler, register_sampler\n\n"
        "@register_sampler('newest_first')\n"
        "class NewestFirst(Sampler):\n"
        "    def select(self, view, n):\n"
        "        return list(reversed(list(view.ready)))[:n]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    tq = make_tq(deployment="processes", sampler_modules=["tq_user_sampler"])
    with tq.client() as client:
        client.create_partition("p")
        put_rows(client, "p", 5)
        assert client.get("p", "t", ["ids"], 2, sampler="newest_first").indexes == [4, 3]
