"""``asyncflow.train``: config from a file, Megatron-LM arguments, overrides and user hooks; a run on the fakes, whose
summary also feeds the CLI's final line (once "mean of the last 10 steps" after 4 steps)."""

import argparse

import pytest

import asyncflow
from asyncflow.config import ConfigError
from tests.recipe_runs import FAKE, REPO, SMALL

RECIPE = REPO / "recipes/tiny_cpu/grpo_async.yaml"
NO_REFERENCE = "algorithm.kl_coef=0"  # no reference model: one process fewer to start, and nothing here reads it


def quarter_reward(tokenizer):
    """A reward factory of the user's: every response scores 0.25 (the run's summary shows it)."""
    return lambda prompt_ids, response_ids: 0.25


def my_prompts(tokenizer, seed, data_cfg):
    """A prompt-source factory of the user's (the add-one prompts under another name)."""
    from asyncflow.data.sources import Add1Prompts

    return Add1Prompts(tokenizer, seed)


def test_build_config_layers_file_megatron_args_overrides_and_hooks():
    args = argparse.Namespace(tensor_model_parallel_size=2, micro_batch_size=2, lr=1e-6, seq_length=128,
                              global_batch_size=64, bf16=False, log_interval=1)
    cfg = asyncflow.build_config(str(RECIPE), megatron_args=args, overrides=["trainer.lr=3e-6"],
                                 reward=quarter_reward, prompts="add1")
    assert cfg.trainer.tensor_parallel == 2 and cfg.trainer.micro_batch_size == 2
    assert cfg.trainer.lr == 3e-6  # the override wins over --lr
    assert cfg.rollout.max_model_len == 128
    assert cfg.workflow.prompts_per_step * cfg.workflow.samples_per_prompt == 64
    assert cfg.algorithm.reward == "tests.test_api:quarter_reward"
    assert cfg.workflow.task == "add1"


def test_hooks_that_workers_cannot_import_are_refused():
    with pytest.raises(ConfigError, match="trainer.model_provider: .*cannot be imported by the Ray workers"):
        asyncflow.build_config(model_provider=lambda config, pre_process, post_process: None)

    def local(tokenizer):
        return None

    with pytest.raises(ConfigError, match="algorithm.reward: .*define it at the top level of a module"):
        asyncflow.build_config(reward=local)


def test_megatron_args_it_cannot_honour_stop_before_anything_starts():
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage=2"):
        asyncflow.build_config(str(RECIPE), megatron_args={"num_layers_per_virtual_pipeline_stage": 2})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, shared_ray):
    """One ``asyncflow.train`` run on the fakes (5 small steps) with the user's prompts and reward: its summary,
    with ``_out``. Read by the hook check and by the CLI's final-line check, which need the same run."""
    out = tmp_path_factory.mktemp("api") / "run"
    summary = asyncflow.train(RECIPE, overrides=[f"model.path={tiny_model_dir}", f"observability.output_dir={out}",
                                                 *FAKE, *SMALL, NO_REFERENCE], prompts=my_prompts,
                             reward=quarter_reward)
    return {**summary, "_out": out}


def test_train_runs_user_hooks_and_returns_the_summary(trained):
    assert trained["steps"] == 5
    assert (trained["_out"] / "summary.json").is_file()
    assert trained["rewards"] == [pytest.approx(0.25)] * 5  # every step scored by the user's reward


def test_the_final_line_says_over_how_many_steps_the_reward_was_averaged(trained):
    # The CLI's last line once said "mean of the last 10 steps" after 4 steps: a run shorter than 10 steps
    # averages (and says it averages) over all of its steps.
    from asyncflow.cli import final_line

    assert trained["steps"] == 5 and trained["reward_tail_steps"] == 5
    line = final_line(trained)
    assert f"-> {trained['reward_last10_mean']:.3f} (mean of the last 5 steps)" in line, line
    assert "last 10" not in line
    long_run = dict(trained, steps=120, reward_tail_steps=10)
    assert "(mean of the last 10 steps)" in final_line(long_run)
    assert "(mean of the last 1 step)" in final_line(dict(trained, steps=1, reward_tail_steps=1))
