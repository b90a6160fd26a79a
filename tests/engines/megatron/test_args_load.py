"""Where initial weights come from (trainer.load_dir / load_format) and how a provider is called (unit tests)."""

import pytest

from asyncflow.config import ConfigError
from asyncflow.engines.megatron.initial_weights import HF, MEGATRON_DIST, resolve
from asyncflow.models.arch import GPTArch
from asyncflow.models.provider import ParallelContext, call_provider, model_context, takes_context


def _folders(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "metadata.json").write_text("{}")
    save = tmp_path / "save"  # Megatron-LM's --save layout
    (save / "iter_0000200").mkdir(parents=True)
    (save / "iter_0000200" / "metadata.json").write_text("{}")
    (save / "latest_checkpointed_iteration.txt").write_text("200\n")
    return hf, dist, save


def test_auto_tells_the_formats_apart(tmp_path):
    hf, dist, save = _folders(tmp_path)
    assert resolve(None, "auto", hf) == (HF, hf)
    assert resolve(str(hf), "auto", "unused") == (HF, hf)
    assert resolve(str(dist), "auto", hf) == (MEGATRON_DIST, dist)
    assert resolve(str(save), "megatron_dist", hf) == (MEGATRON_DIST, save / "iter_0000200")


def test_wrong_folders_are_one_line_errors_naming_the_key(tmp_path):
    hf, dist, save = _folders(tmp_path)
    with pytest.raises(ConfigError, match="hf: not a Megatron distributed checkpoint.*load_format=hf"):
        resolve(str(hf), "megatron_dist", hf)
    with pytest.raises(ConfigError, match="no \\*.safetensors files for trainer.load_format=hf"):
        resolve(str(dist), "hf", hf)
    with pytest.raises(ConfigError, match="no such folder"):
        resolve(str(tmp_path / "missing"), "auto", hf)
    with pytest.raises(ConfigError, match="needs trainer.load_dir"):
        resolve(None, "megatron_dist", hf)
    (save / "latest_checkpointed_iteration.txt").write_text("300")
    with pytest.raises(ConfigError, match="names iter_0000300, which is not a Megatron distributed checkpoint"):
        resolve(str(save), "auto", hf)


def test_a_provider_gets_the_context_only_when_it_takes_one():
    arch = GPTArch(model_type="llama", vocab_size=1000, hidden_size=64, num_layers=4, num_attention_heads=4,
                   num_query_groups=4, head_dim=16, ffn_hidden_size=128, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, rope_theta=5e5, qkv_bias=False, qk_layernorm=False, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0})
    parallel = ParallelContext(tensor_parallel=2, pipeline_parallel=2, expert_parallel=1, context_parallel=1,
                               data_parallel=1, tensor_rank=1, pipeline_rank=1, expert_rank=0, context_rank=0,
                               data_rank=0)
    ctx = model_context(arch, 128, parallel)
    assert (ctx.padded_vocab_size, ctx.rotary_base, ctx.max_position_embeddings) == (1024, 5e5, 8192)
    assert ctx.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert (ctx.pre_process, ctx.post_process) == (False, True)  # the last of two stages

    def megatron_lm_shape(config, pre_process, post_process):
        return ("old", config, pre_process, post_process)

    def with_context(config, pre_process=True, post_process=True, context=None):
        return ("new", context.padded_vocab_size)

    assert not takes_context(megatron_lm_shape) and takes_context(with_context)
    assert call_provider(megatron_lm_shape, "cfg", ctx) == ("old", "cfg", False, True)
    assert call_provider(with_context, "cfg", ctx) == ("new", 1024)


def test_asyncflow_train_refuses_a_wrong_load_dir_before_starting(tmp_path, capsys):
    from asyncflow.cli import main

    recipe = "recipes/tiny_cpu/grpo_async.yaml"
    assert main(["train", recipe, f"trainer.load_dir={tmp_path}", "trainer.load_format=megatron_dist"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflow: ") and err.count("\n") == 0, err
    assert f"trainer.load_dir={tmp_path}: not a Megatron distributed checkpoint" in err


def test_built_in_model_applies_llama3_rope_scaling_and_refuses_others():
    from dataclasses import replace

    from asyncflow.models.megatron import rope_scaling_kwargs

    arch = GPTArch(model_type="llama", vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=4,
                   num_query_groups=4, head_dim=16, ffn_hidden_size=128, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=5e5, qkv_bias=False, qk_layernorm=False, tie_word_embeddings=True)
    assert rope_scaling_kwargs(arch) == {}
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert rope_scaling_kwargs(replace(arch, rope_scaling=llama31)) == {"rope_scaling": True,
                                                                         "rope_scaling_factor": 8.0}
    for other in ({**llama31, "factor": 32.0, "original_max_position_embeddings": 4096},
                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}):
        with pytest.raises(ValueError, match="not supported by the built-in model.*trainer.model_provider"):
            rope_scaling_kwargs(replace(arch, rope_scaling=other))
