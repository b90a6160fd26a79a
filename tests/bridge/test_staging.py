"""Staged versions (``bridge/staging.py``) between reference Megatron shards and simulated vLLM readers.

No vLLM here: what each reader hands to ``apply`` is checked box by box against the Hugging Face tensors the
shards came from. Tests with the real engines live in ``test_sync_vllm.py`` and ``tests/workflow``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from asyncflow.bridge.buckets import SyncPlan
from asyncflow.bridge.shards import ParallelLayout, index
from asyncflow.bridge.staging import StagingReader, StagingWriter, StaleStagingError, source_key
from asyncflow.bridge.vllm_layout import vllm_boxes
from tests.bridge.archs import ARCHS, random_hf_state
from tests.bridge.test_shard_plans import _reference_megatron

CASES = [
    ("qwen2_gqa", ParallelLayout(2, 2, layers_per_stage=(1, 2)), 2),
    ("qwen2_gqa", ParallelLayout(2, 1), 1),
    ("llama_mqa_tied", ParallelLayout(4, 1), 4),
    ("qwen3_moe", ParallelLayout(1, 1, 2), 2),
    ("qwen2_moe_shared", ParallelLayout(2, 1, 2), 1),
]


def _writers(arch, layout, hf_state, bucket_bytes):
    plan = SyncPlan(arch, layout, bucket_bytes)
    shards = _reference_megatron(arch, layout, hf_state)
    tag = uuid.uuid4().hex[:8]
    writers = {}
    for rank in layout.ranks():
        if any(rank in b.sources for b in plan.buckets):
            segment = f"afq-{os.getpid()}-wtest{tag}-{source_key(rank)}"
            writers[source_key(rank)] = StagingWriter(plan, rank, shards[rank], segment)
    return plan, shards, writers


def _needed(arch, tp, rank):
    out = {}
    for _, segments in vllm_boxes(arch, tp, rank).values():
        for seg in segments:
            out.setdefault(seg.hf, []).append(seg.hf_box)
    return out


@pytest.mark.parametrize("arch_id,layout,vllm_tp", CASES, ids=[f"{a}-{lay}-v{t}" for a, lay, t in CASES])
@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["one-group-per-bucket", "one-bucket"])
def test_each_reader_gets_exactly_its_boxes(arch_id, layout, vllm_tp, bucket_bytes):
    arch = ARCHS[arch_id]
    hf_state = random_hf_state(arch)
    plan, _, writers = _writers(arch, layout, hf_state, bucket_bytes)
    segments = {k: w.segment for k, w in writers.items()}
    try:
        for w in writers.values():
            w.stage(1)
        full_bytes = 0
        for rank in range(vllm_tp):
            seen, buckets = {}, []
            reader = StagingReader(plan, segments, vllm_tp, rank)
            stats = reader.read(1, lambda bucket, seen=seen, buckets=buckets: (seen.update(bucket),
                                                                               buckets.append(len(bucket))))
            reader.close()
            assert sorted(seen) == sorted(hf_state)  # every tensor, in full shape, for vLLM's loaders
            assert len(buckets) == len(plan.buckets) == stats.buckets
            # Bytes by source (how the rollout side counts shm vs relay bytes): they add up, only staged sources.
            assert sum(stats.bytes_by_source.values()) == stats.bytes and set(stats.bytes_by_source) <= set(segments)
            if vllm_tp == 1:  # one reader takes every source's pieces whole
                assert stats.bytes_by_source == {k: w.nbytes for k, w in writers.items() if w.nbytes}
            for name, boxes in _needed(arch, vllm_tp, rank).items():
                for box in boxes:
                    torch.testing.assert_close(seen[name][index(box)], hf_state[name][index(box)], rtol=0, atol=0)
            if vllm_tp == 1:
                full_bytes = stats.bytes
                assert stats.bytes == plan.total_bytes()
            else:
                assert stats.bytes < plan.total_bytes()
        if full_bytes:
            assert full_bytes == plan.total_bytes()
    finally:
        for w in writers.values():
            w.close()


def test_reader_bytes_shrink_with_vllm_tp():
    arch = ARCHS["qwen3_mha"]
    plan, _, writers = _writers(arch, ParallelLayout(2, 1), random_hf_state(arch), 1 << 30)
    segments = {k: w.segment for k, w in writers.items()}
    try:
        for w in writers.values():
            w.stage(0)
        per_tp = {}
        for tp in (1, 2, 4):
            reader = StagingReader(plan, segments, tp, 0)
            per_tp[tp] = reader.read(0, lambda bucket: None).bytes
            reader.close()
        replicated = sum(t.numel() * 4 for n, t in random_hf_state(arch).items() if "norm" in n)
        assert per_tp[2] - replicated / 2 == pytest.approx((per_tp[1] - replicated / 2) / 2, rel=0.05)
        assert per_tp[4] < per_tp[2] < per_tp[1]
    finally:
        for w in writers.values():
            w.close()


def test_overwritten_version_is_detected_before_the_torn_bucket_is_applied():
    arch = ARCHS["qwen2_gqa"]
    hf_state = random_hf_state(arch)
    plan, shards, writers = _writers(arch, ParallelLayout(2, 1), hf_state, 1)
    segments = {k: w.segment for k, w in writers.items()}
    reader = StagingReader(plan, segments, 1, 0)
    try:
        for w in writers.values():
            w.stage(1)
        applied = []

        def apply(bucket):
            applied.append(bucket)
            if len(applied) == 1:  # the trainer runs two versions ahead while this reader is busy
                for rank_shards in shards.values():
                    for t in rank_shards.values():
                        t.add_(1.0)
                for w in writers.values():
                    w.stage(3)

        with pytest.raises(StaleStagingError, match="version 3"):
            reader.read(1, apply)
        assert len(applied) == 1  # bucket 2 was torn and never applied
        # Starting over with the newest version gives its values throughout.
        seen = {}
        reader.read(3, seen.update)
        for name, t in hf_state.items():
            torch.testing.assert_close(seen[name], t + 1.0, rtol=0, atol=0)
        with pytest.raises(StaleStagingError, match="holds version 3"):
            reader.read(5, seen.update)  # not staged yet
    finally:
        reader.close()
        for w in writers.values():
            w.close()


def test_writer_rejects_a_state_without_the_planned_parameters():
    arch = ARCHS["qwen2_gqa"]
    layout = ParallelLayout(1, 1)
    plan = SyncPlan(arch, layout, 1 << 20)
    with pytest.raises(KeyError, match="lacks parameters"):
        StagingWriter(plan, layout.ranks()[0], {}, f"afq-{os.getpid()}-wbad")
    assert not os.path.exists(f"/dev/shm/afq-{os.getpid()}-wbad")


def test_prefetched_reads_the_same_buckets_and_forwards_a_torn_read():
    arch = ARCHS["qwen3_moe"]
    hf_state = random_hf_state(arch)
    plan, shards, writers = _writers(arch, ParallelLayout(1, 1, 2), hf_state, 1)
    segments = {k: w.segment for k, w in writers.items()}
    reader = StagingReader(plan, segments, 1, 0)
    try:
        for w in writers.values():
            w.stage(1)
        direct = [[(n, t.clone()) for n, t in b] for b in reader.buckets(1)]
        ahead = list(reader.prefetched(1))
        assert [[n for n, _ in b] for b in ahead] == [[n for n, _ in b] for b in direct]
        for a, d in zip(ahead, direct):
            for (_, x), (_, y) in zip(a, d):
                assert torch.equal(x, y)
        got = []
        with pytest.raises(StaleStagingError):
            for bucket in reader.prefetched(1):
                got.append(bucket)
                if len(got) == 1:
                    for w in writers.values():
                        w.stage(3)  # overwrites slot 1 while the next bucket is (or will be) read
        assert len(got) < len(plan.buckets)
        assert len(list(reader.prefetched(3))) == len(plan.buckets)
    finally:
        reader.close()
        for w in writers.values():
            w.close()
