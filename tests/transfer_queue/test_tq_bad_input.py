"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import pytest
import torch

from asyncflow.transfer_queue import BadRequestError, Packed, UnknownPartitionError


def snapshot(client):
    status = client.status()
    return status["partitions"], {k: v["used_bytes"] for k, v in status["units"].items()}


@pytest.fixture
def filled(client):
    client.create_partition("p", fields=["ids", "logp", "resp", "rewards"])
    client.put("p", {"ids": torch.zeros(4, 8, dtype=torch.int64), "logp": torch.zeros(4, 8),
                     "resp": [torch.zeros(i + 1, 2) for i in range(4)]})
    client.put("p", {"rewards": torch.ones(2)}, indexes=[0, 1])
    return client


BAD_PUTS = [
    ("unknown field", dict(data={"nope": torch.zeros(2)}), "unknown field 'nope'"),
    ("wrong dtype", dict(data={"ids": torch.zeros(2, 8, dtype=torch.int32)}), "int64"),
    ("wrong shape", dict(data={"logp": torch.zeros(2, 9)}), r"float32\[8\]"),
    ("ragged trailing dims", dict(data={"resp": [torch.zeros(3, 5)]}), "ragged"),
    ("dense into ragged, wrong dims", dict(data={"resp": torch.zeros(2, 3, 4)}), "ragged"),
    ("write twice", dict(data={"rewards": torch.ones(1)}, indexes=[1]), "already written"),
    ("twice in one request", dict(data={"rewards": torch.ones(2)}, indexes=[2, 2]), "duplicate"),
    ("row out of range", dict(data={"rewards": torch.ones(1)}, indexes=[99]), "out of range"),
    ("row count mismatch",
     dict(data={"ids": torch.zeros(2, 8, dtype=torch.int64), "logp": torch.zeros(3, 8)}),
     "same number of rows"),
    ("empty put", dict(data={}), "non-empty"),
    ("zero rows", dict(data={"logp": torch.zeros(0, 8)}), "at least one row"),
    ("unsupported value", dict(data={"ids": {"a": 1}}), "unsupported value type"),
    ("non-serialisable object", dict(data={"ids": [object()]}), "msgpack"),
    ("bad packed offsets",
     dict(data={"resp": Packed(torch.zeros(4, 2), torch.tensor([0, 3, 2]))}), "offsets"),
    ("metadata length", dict(data={"logp": torch.zeros(2, 8)}, versions=[1]), "versions"),
]


@pytest.mark.parametrize("case", BAD_PUTS, ids=[c[0] for c in BAD_PUTS])
def test_bad_put_is_refused_and_changes_nothing(filled, case):
    _, kwargs, message = case
    before = snapshot(filled)
    with pytest.raises(BadRequestError, match=message):
        filled.put("p", **kwargs)
    assert snapshot(filled) == before


def test_unknown_partition_everywhere(filled):
    before = snapshot(filled)
    calls = [
        lambda: filled.put("q", {"ids": torch.zeros(1)}),
        lambda: filled.get("q", "t", ["ids"], 1),
        lambda: filled.get_meta("q", "t", ["ids"], 1, block=False),
        lambda: filled.seal("q"),
        lambda: filled.clear("q"),
        lambda: filled.release("q", "t"),
        lambda: filled.status("q"),
    ]
    for call in calls:
        with pytest.raises(UnknownPartitionError, match="unknown partition 'q'; existing partitions: p"):
            call()
    assert snapshot(filled) == before


@pytest.mark.parametrize("kwargs,message", [
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(batch_size=-3), "batch_size"),
    (dict(batch_size=2, fields=["nope"]), "unknown field 'nope'"),
    (dict(batch_size=2, fields=[]), "non-empty list of fields"),
    (dict(batch_size=2, dp_rank=2, dp_size=2), "dp_rank < dp_size"),
    (dict(batch_size=2, mp_size=0), "mp_size"),
    (dict(batch_size=2, sampler="group", sampler_args={"group_size": 0}), "group_size"),
    (dict(batch_size=2, sampler="version", sampler_args={"current_version": -1}), "current_version"),
])
def test_bad_get_is_refused_and_changes_nothing(filled, kwargs, message):
    fields = kwargs.pop("fields", ["ids"])
    batch_size = kwargs.pop("batch_size")
    before = snapshot(filled)
    with pytest.raises(BadRequestError, match=message):
        filled.get("p", "t", fields, batch_size, **kwargs)
    assert snapshot(filled) == before


def test_bad_read_and_lifecycle_requests(filled):
    meta = filled.get_meta("p", "t", ["ids"], 2)
    with pytest.raises(BadRequestError, match="unknown field"):
        filled.get_data(meta, ["logp"])
    with pytest.raises(BadRequestError, match="ragged must be"):
        filled.get_data(meta, ragged="nested")
    with pytest.raises(BadRequestError, match="already exists"):
        filled.create_partition("p")
    assert filled.create_partition("p", exist_ok=True) is False
    with pytest.raises(BadRequestError, match="no rows"):
        filled.release("p", "never-asked")
    with pytest.raises(BadRequestError, match="out of range"):
        filled.clear("p", [1000])
    with pytest.raises(BadRequestError, match="auto_clear needs"):
        filled.create_partition("r", auto_clear=True)
