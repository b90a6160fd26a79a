"""The built-in model applies a checkpoint's Llama-3 rope scaling as Hugging Face does (so as vLLM does)."""

import json
import multiprocessing as mp

import pytest

from tests.forkserver import start_method

pytestmark = pytest.mark.slow

LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _child(scaled_dir: str, plain_dir: str) -> dict:
    import torch
    import transformers

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.parallel import destroy_megatron

    torch.set_num_threads(1)
    tokens = torch.randint(4, 19, (2, 200), generator=torch.Generator().manual_seed(5))  # long: low frequencies turn

    def hf_logprobs(model_dir):
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            return torch.log_softmax(hf(tokens).logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]

    trainer = MegatronTrainer(MegatronConfig(micro_batch_size=2), scaled_dir)
    trainer.load_hf(scaled_dir)
    ours = trainer.logprobs(tokens)
    scaled, plain = hf_logprobs(scaled_dir), hf_logprobs(plain_dir)
    destroy_megatron()
    return {"vs_hf": float((ours - scaled).abs().max()), "scaling_effect": float((scaled - plain).abs().max())}


def test_llama3_rope_scaling_matches_huggingface(tmp_path):
    from asyncflow.tiny_model import make_tiny_model

    plain = make_tiny_model(tmp_path / "plain", family="llama", seed=1)
    config = json.loads((plain / "config.json").read_text())
    config.pop("rope_scaling", None)
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in plain.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    (scaled / "config.json").write_text(json.dumps({**config, "rope_parameters": LLAMA3}))
    (plain / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 1e6}}))
    with mp.get_context(start_method()).Pool(1) as pool:
        result = pool.apply(_child, (str(scaled), str(plain)))
    assert result["scaling_effect"] > 5e-5, result  # the scaling changes Hugging Face's log-probabilities
    assert result["vs_hf"] <= 1e-5, result
