"""tools/convert_checkpoint.py and its library: HF -> Megatron (TP2, PP2, EP2) -> HF is bit-exact, a
Megatron TP2 x PP2 model loaded from the converted checkpoint reproduces the Hugging Face logits, and bad
inputs fail with one clear line and no output left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncflow.bridge.checkpoint import ConversionError, hf_to_mcore, mcore_to_hf
from asyncflow.bridge.shards import ParallelLayout
from asyncflow.models.parallel import free_port
from asyncflow.tiny_model import make_tiny_model
from tests.forkserver import start_method
from tests.zygote import spawned_from_server

ROOT = Path(__file__).resolve().parents[2]


def _load_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _assert_bit_exact(a_dir: Path, b_dir: Path) -> None:
    a, b = _load_hf(a_dir), _load_hf(b_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def ranks_forked():
    """Within: the converter's spawned ranks fork from the tests' real-stack server (Megatron-core imported once).
    Only for the slow tests: a fast one would start the server for nothing."""
    with spawned_from_server():
        yield


@pytest.fixture(scope="module")
def dense_tp2pp2(tiny_model_dir, tmp_path_factory, ranks_forked):
    out = tmp_path_factory.mktemp("conv") / "qwen2_tp2pp2"
    hf_to_mcore(tiny_model_dir, out, ParallelLayout(2, 2), progress=None)
    return out


@pytest.mark.slow
def test_round_trip_dense_tp2_pp2(dense_tp2pp2, tiny_model_dir, tmp_path):
    meta = json.loads((dense_tp2pp2 / "asyncflow_bridge.json").read_text())
    assert (meta["tp"], meta["pp"]) == (2, 2)
    back = mcore_to_hf(dense_tp2pp2, tmp_path / "hf", max_shard_bytes=64 * 1024, progress=None)
    assert (back / "model.safetensors.index.json").is_file()  # sharded files with an index
    _assert_bit_exact(tiny_model_dir, back)


@pytest.mark.slow
def test_export_with_hf_config_keeps_the_trained_weights(dense_tp2pp2, tiny_model_dir, tmp_path):
    """``mcore-to-hf --hf-config BASE`` takes config and tokenizer from BASE, never its weights: once, every
    file of BASE was copied over the converted ones, so an exported trained model was the base model."""
    import shutil

    from safetensors.torch import save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    perturbed = {k: v + 1.0 for k, v in _load_hf(tiny_model_dir).items()}  # the base differs from "trained"
    save_file(perturbed, str(base / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in perturbed}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({}, base / "pytorch_model.bin")
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "mcore-to-hf",
         "--mcore", str(dense_tp2pp2), "--out", str(out), "--hf-config", str(base)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _assert_bit_exact(tiny_model_dir, out)  # the checkpoint's weights, not the base's
    names = {f.name for f in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "pytorch_model.bin" not in names and "model.safetensors.index.json" not in names


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [
        ("qwen3_moe", ParallelLayout(1, 1, 2)),
        ("qwen2_moe", ParallelLayout(1, 2, 2)),
        ("llama", ParallelLayout(1, 2, layers_per_stage=(1, 2))),
    ],
    ids=["qwen3moe-ep2", "qwen2moe-shared-pp2ep2", "llama-tied-uneven-pp2"],
)
def test_round_trip_other_families(tmp_path, family, layout, ranks_forked):
    hf = make_tiny_model(
        tmp_path / "hf",
        family=family,
        num_layers=3 if family == "llama" else 2,
        tie_word_embeddings=family == "llama",
        seed=3,
    )
    mcore = hf_to_mcore(hf, tmp_path / "mcore", layout, progress=None)
    _assert_bit_exact(hf, mcore_to_hf(mcore, tmp_path / "back", progress=None))


def _logits_rank(rank, world, port, ckpt, model_dir, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests.bridge.logits_worker import megatron_logits

    megatron_logits(ckpt, model_dir, out, tp=2, pp=2)


@pytest.mark.slow
def test_megatron_tp2pp2_from_converted_checkpoint_matches_hf_logits(dense_tp2pp2, tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp
    import transformers

    from tests.bridge.harness import fixed_tokens

    mp.start_processes(
        _logits_rank,
        args=(4, free_port(), str(dense_tp2pp2), str(tiny_model_dir), str(tmp_path)),
        nprocs=4,
        join=True,
        start_method=start_method(),
    )
    ours = torch.load(tmp_path / "logits.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(fixed_tokens()).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-5


def test_bad_inputs_fail_cleanly(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="not a Hugging Face checkpoint"):
        hf_to_mcore(tmp_path, out, ParallelLayout(1, 1), progress=None)
    with pytest.raises(ConversionError, match="must divide the attention heads"):
        hf_to_mcore(tiny_model_dir, out, ParallelLayout(4, 1), progress=None)
    with pytest.raises(ConversionError, match="not a Megatron distributed checkpoint"):
        mcore_to_hf(tiny_model_dir, out, progress=None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConversionError, match="unsupported architecture"):
        hf_to_mcore(bad, out, ParallelLayout(1, 1), progress=None)
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_cli_prints_one_error_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_checkpoint.py"),
            "mcore-to-hf",
            "--mcore",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error")]) == 1
    assert not (tmp_path / "o").exists()
