"""tools/make_tiny_model.py and its library: real Hugging Face checkpoints with a local tokenizer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from asyncflow.models.megatron import GPTArch
from asyncflow.tiny_model import build_tokenizer, make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family,qkv_bias,qk_norm", [("qwen2", True, False), ("llama", False, False),
                                                     ("qwen3", False, True)])
def test_families_load_in_transformers(tmp_path, family, qkv_bias, qk_norm):
    out = make_tiny_model(tmp_path / family, family=family, num_heads=2, num_kv_heads=1, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    names = set(model.state_dict())
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == qk_norm
    arch = GPTArch.from_pretrained(out)
    assert (arch.qkv_bias, arch.qk_layernorm, arch.head_dim, arch.vocab_size) == (qkv_bias, qk_norm, 32, 19)
    logits = model(torch.tensor([[2, 5, 6]])).logits
    assert logits.shape == (1, 3, 19) and torch.isfinite(logits).all()


def test_tied_embeddings_and_seed_determinism(tmp_path):
    a = make_tiny_model(tmp_path / "a", tie_word_embeddings=True, seed=5)
    b = make_tiny_model(tmp_path / "b", tie_word_embeddings=True, seed=5)
    assert GPTArch.from_pretrained(a).tie_word_embeddings
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_tokenizer_round_trip():
    tok = build_tokenizer("add1")
    assert len(tok) == 19
    ids = tok("3648>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "3648>"
    ascii_tok = build_tokenizer("ascii")
    assert ascii_tok.decode(ascii_tok("Hi, there!")["input_ids"]) == "Hi, there!"


@pytest.mark.parametrize("kwargs,match", [
    ({"hidden_size": 64, "num_heads": 4}, "head_dim"),
    ({"family": "gpt2"}, "unknown family"),
    ({"charset": "emoji"}, "unknown charset"),
    ({"num_heads": 2, "num_kv_heads": 3}, "multiple"),
])
def test_bad_arguments_are_clear_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_tiny_model(tmp_path / "m", **kwargs)


def test_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "tools/make_tiny_model.py"), str(tmp_path / "cli"), "--family", "llama",
         "--layers", "3", "--hidden", "128", "--heads", "4", "--kv-heads", "2"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "cli/config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == ("llama", 3, 2)
    bad = subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), str(tmp_path / "x"),
                          "--hidden", "64", "--heads", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "head_dim" in bad.stderr and "Traceback" not in bad.stderr
