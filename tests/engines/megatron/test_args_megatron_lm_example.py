"""examples/megatron_lm: a Megatron-LM argument list and a provider of the user's own, run through asyncflow.train.

The provider's model gives the built-in model's log-probabilities on the same weights, read from the Hugging Face
folder or from a Megatron-LM dist-checkpoint folder (``--save`` layout: tracker file + ``iter_NNNNNNN``).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch.multiprocessing as mp
import yaml

from tests.forkserver import start_method
from tests.recipe_runs import REPO

PROVIDER = "examples.megatron_lm.provider:model_provider"


def test_pretrain_script_arguments_become_the_run_config(tiny_model_dir, tmp_path):
    env = dict(os.environ, DRY_RUN="1", MODEL=str(tiny_model_dir), OUT=str(tmp_path),
               PYTHON=str(REPO / ".venv/bin/python"))
    proc = subprocess.run(["bash", str(REPO / "examples/megatron_lm/pretrain_gpt.sh")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["trainer"]["model_provider"] == "provider:model_provider"
    trainer = cfg["trainer"]
    assert (trainer["micro_batch_size"], trainer["lr"], trainer["weight_decay"]) == (64, 0.002, 0.0)
    assert (cfg["workflow"]["steps"], cfg["workflow"]["prompts_per_step"]) == (20, 32)  # --global-batch-size 256 / 8
    assert cfg["rollout"]["max_model_len"] == 32
    assert (cfg["checkpoint"]["dir"], cfg["checkpoint"]["interval"]) == (f"{tmp_path}/checkpoints", 10)


def _compare(rank, model_dir, root, out):
    import torch

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.parallel import destroy_megatron

    tokens = torch.tensor([[2, 5, 6, 7, 8, 18, 3, 4]] * 4)
    builtin = MegatronTrainer(MegatronConfig(), model_dir)
    builtin.load_hf(model_dir)
    reference = {"hf": builtin.logprobs(tokens)}
    builtin.train_step(tokens, torch.ones(4, 7))  # weights that differ from the Hugging Face folder's
    reference["dist"] = builtin.logprobs(tokens)
    # A Megatron-LM --save folder: the tracker file names the iteration folder holding the dist checkpoint.
    builtin.save_dist_checkpoint(root / "iter_0000010")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    gaps, rows = {}, {}
    for name, cfg in {"hf": MegatronConfig(model_provider=PROVIDER),
                      "dist": MegatronConfig(model_provider=PROVIDER, load_dir=str(root))}.items():
        trainer = MegatronTrainer(cfg, model_dir)
        trainer.load_initial_weights(model_dir)
        gaps[name] = float((trainer.logprobs(tokens) - reference[name]).abs().max())
        rows[name] = trainer.module.embedding.word_embeddings.weight.shape[0]
    gaps["trained"] = float((reference["dist"] - reference["hf"]).abs().max())
    destroy_megatron()
    Path(out).write_text(json.dumps({"gaps": gaps, "rows": rows, "vocab": builtin.arch.vocab_size}))


@pytest.mark.slow
def test_example_provider_matches_the_built_in_model(tiny_model_dir, tmp_path):
    # A process of its own, not a pool's daemon: Megatron's checkpoint loader starts processes.
    out = tmp_path / "result.json"
    mp.start_processes(_compare, args=(str(tiny_model_dir), tmp_path / "megatron_lm_save", str(out)), nprocs=1,
                       join=True, start_method=start_method())
    result = json.loads(out.read_text())
    gaps, rows, vocab = result["gaps"], result["rows"], result["vocab"]
    assert gaps["hf"] <= 1e-5 and gaps["dist"] <= 1e-5, gaps
    assert gaps["trained"] > 1e-3, gaps  # so the dist-checkpoint trainer did read the trained weights
    assert rows == {"hf": 128, "dist": 128} and vocab == 19  # the provider sized its embedding from the context
