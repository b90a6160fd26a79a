"""Config loading: defaults, YAML, dotted overrides, and errors that name the key and the valid ones."""

import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.config import AsyncFlowConfig, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_come_from_dataclasses():
    cfg = load_config()
    assert cfg == AsyncFlowConfig()
    assert cfg.trainer.tensor_parallel == 1 and cfg.rollout.dtype == "float32"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.5\n  tensor_parallel: 2\nrollout:\n  temperature: 0.7\n")
    cfg = load_config(path, ["trainer.lr=1e-6", "rollout.enforce_eager=false", "ray.address=auto"])
    assert cfg.trainer.lr == pytest.approx(1e-6)  # the override wins over the file
    assert cfg.trainer.tensor_parallel == 2  # the file wins over the default
    assert cfg.rollout.temperature == pytest.approx(0.7)
    assert cfg.rollout.enforce_eager is False
    assert cfg.ray.address == "auto"
    assert cfg.ray.num_cpus is None  # untouched default


def test_int_accepted_for_float_and_none_for_optional():
    cfg = load_config(None, ["trainer.lr=1", "ray.num_cpus=null"])
    assert isinstance(cfg.trainer.lr, float) and cfg.trainer.lr == 1.0
    assert cfg.ray.num_cpus is None


def test_unknown_key_names_it_and_lists_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.learning_rate=1e-6"])
    msg = str(err.value)
    assert "trainer.learning_rate" in msg
    for valid in ("lr", "tensor_parallel", "pipeline_parallel"):
        assert valid in msg


def test_unknown_section_lists_sections():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optim.lr=1"])
    assert "'optim'" in str(err.value) and "trainer" in str(err.value) and "rollout" in str(err.value)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.tensor_parallel=two", "trainer.tensor_parallel: expected int"),
        ("trainer.tensor_parallel=1.5", "expected int"),
        ("rollout.enforce_eager=1", "expected bool"),
        ("rollout.dtype=float64", "expected one of"),
        ("trainer=3", "expected a mapping"),
        ("trainer.lr=fast", "expected float"),
    ],
)
def test_wrong_types_are_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_every_recipe_yaml_loads():
    recipes = sorted(REPO.glob("recipes/**/*.yaml"))
    assert recipes, "no recipe YAML found"
    for path in recipes:
        load_config(path)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_config_show_prints_resolved_yaml():
    out = _cli("config", "show", "recipes/tiny_cpu/demo.yaml", "trainer.lr=0.125")
    assert out.returncode == 0, out.stderr
    import yaml

    shown = yaml.safe_load(out.stdout)
    assert shown["trainer"]["lr"] == 0.125
    assert shown["demo"]["train_steps"] == 30  # from the recipe
    assert shown["rollout"]["kv_cache_gib"] == 1  # from the defaults


def test_config_show_error_exit_code():
    out = _cli("config", "show", "trainer.nope=1")
    assert out.returncode == 2
    assert "unknown config key 'trainer.nope'" in out.stderr


# ---- cross-field rules (asyncflow.config_rules), checked once by load_config ---------------------------------

ROWS_32 = ["workflow.prompts_per_step=4", "workflow.samples_per_prompt=8"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.data_parallel=0"], "trainer.data_parallel=0 must be at least 1"),
    (["critic.micro_batch_size=0"], "critic.micro_batch_size=0 must be at least 1"),
    (["trainer.recompute_num_layers=0"], "trainer.recompute_num_layers=0 must be at least 1"),
    (["workflow.rollout_instances=0"], "workflow.rollout_instances=0 must be at least 1"),
    ([*ROWS_32, "trainer.micro_batch_size=64"],
     "32 rows per step must be a multiple of trainer.micro_batch_size x trainer.data_parallel = 64 x 1"),
    ([*ROWS_32, "trainer.micro_batch_size=8", "trainer.data_parallel=8"], "trainer.micro_batch_size x "
     "trainer.data_parallel = 8 x 8"),
    ([*ROWS_32, "algorithm.advantage=gae", "trainer.micro_batch_size=8", "critic.micro_batch_size=3"],
     "critic.micro_batch_size x critic.data_parallel = 3 x 1"),
    (["trainer.context_parallel=2", "algorithm.loss_agg=seq-mean-token-mean"],
     "trainer.context_parallel=2 needs algorithm.loss_agg=token-mean"),
    (["algorithm.dynamic_sampling=true", "algorithm.advantage=reinforce_pp"], "needs a group estimator"),
    (["algorithm.dynamic_sampling=true", "algorithm.advantage=gae"], "'gae' is critic-scoped"),
    (["algorithm.dynamic_sampling=true", "algorithm.kl_mode=reward"], "with algorithm.kl_mode=reward"),
    (["trainer.overlap_param_gather=true"], "trainer.overlap_param_gather=true: needs use_distributed_optimizer"),
    (["algorithm.advantage=gae", "critic.overlap_param_gather=true"], "critic.overlap_param_gather=true"),
    (["trainer.sequence_parallel=true"], "trainer.sequence_parallel=true: needs tensor_parallel > 1"),
    (["rollout.max_new_tokens=64"], "rollout.max_new_tokens=64 leaves no room for the prompt"),
    (["workflow.task=jsonl", "data.max_prompt_len=61"],
     r"data.max_prompt_len \+ rollout.max_new_tokens = 61 \+ 4 = 65 > rollout.max_model_len=64"),
    (["rollout.partial=true", "rollout.partial_kv=keep"], "partial_kv=keep needs rollout.enable_prefix_caching=false"),
    (["workflow.mode=sync", "ray.accelerator=GPU", "workflow.rollout_instances=2"],
     "workflow.rollout_instances x rollout.tensor_parallel = 2 must equal the trainer's TP x PP x CP x DP = 1"),
    (["ray.device_fraction=0"], r"ray.device_fraction=0.0 must be in \(0, 1\]"),
    (["ray.device_fraction=0.5", "rollout.tensor_parallel=2"], "below 1 needs rollout.tensor_parallel=1"),
    (["ray.death_info_wait_ms=-1"], "ray.death_info_wait_ms=-1 must be at least 0"),
    (["workflow.max_restarts=-1"], "workflow.max_restarts=-1 must be at least 0"),
    (["workflow.rollout_instances=2", 'ray.rollout_label_selector=[{"ray.io/node-id": "a"}]'],
     "ray.rollout_label_selector has 1 entries but workflow.rollout_instances=2"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_load_rejects_keys_that_do_not_fit_together_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_settings_that_fit_together_load():
    for overrides in (
        [*ROWS_32, "trainer.micro_batch_size=8", "trainer.data_parallel=2"],
        ["algorithm.dynamic_sampling=true", "algorithm.kl_coef=0", "algorithm.clip_high=0.28"],
        ["algorithm.dynamic_sampling=true", "algorithm.kl_mode=reward", "algorithm.kl_coef=0"],
        ["algorithm.advantage=gae", "algorithm.whiten_advantages=true"],
        ["critic.micro_batch_size=3", "critic.overlap_param_gather=true"],  # no critic without gae
        ["trainer.context_parallel=2"],
        ["trainer.sequence_parallel=true", "trainer.tensor_parallel=2"],
        ["trainer.overlap_param_gather=true", "trainer.use_distributed_optimizer=true"],
        ["rollout.partial=true", "rollout.partial_kv=keep", "rollout.enable_prefix_caching=false"],
        ["workflow.mode=sync", "workflow.rollout_instances=2"],  # the CPU layout: no devices to share
        ["workflow.rollout_instances=2", 'ray.rollout_label_selector=[{"ray.io/node-id": "a"}, {}]'],
        ["workflow.mode=sync", "ray.accelerator=GPU", "workflow.rollout_instances=2", "trainer.data_parallel=2"],
        ["ray.device_fraction=0.5"],
    ):
        load_config(None, overrides)


def test_every_problem_is_reported_at_once_and_sizes_first():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.overlap_param_gather=true", "rollout.max_new_tokens=64"])
    assert "overlap_param_gather" in str(err.value) and "max_new_tokens" in str(err.value)
    # a size below 1 stops the rules that divide by it
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.micro_batch_size=0", "rollout.max_new_tokens=64"])
    assert str(err.value) == "trainer.micro_batch_size=0 must be at least 1"


def test_a_step_that_splits_into_no_whole_micro_batches_stops_at_load_from_the_command_line(tmp_path, capsys):
    from asyncflow.cli import main

    model = tmp_path / "model"
    assert main(["train", *ROWS_32, "trainer.micro_batch_size=64", f"model.path={model}"]) == 2
    assert "rows per step must be a multiple of trainer.micro_batch_size" in capsys.readouterr().err
    assert not model.exists()


# ---- the critic's own section --------------------------------------------------------------------------------

def test_the_critic_has_its_own_keys():
    from asyncflow.config import CriticConfig, MegatronConfig

    cfg = load_config(REPO / "recipes/tiny_cpu/ppo_async.yaml")
    assert isinstance(cfg.critic, CriticConfig) and not isinstance(cfg.critic, MegatronConfig)
    assert cfg.critic.lr == 0.002 and cfg.critic.micro_batch_size == 64  # from the recipe
    for key, value in (("sequence_parallel", "false"), ("reference_placement", "own")):
        with pytest.raises(ConfigError, match=f"unknown config key 'critic.{key}'"):
            load_config(None, [f"critic.{key}={value}"])
        load_config(None, [f"trainer.{key}={value}"])


# ---- asyncflow config keys ---------------------------------------------------------------------------------

def test_config_keys_lists_every_key_with_type_default_and_docstring():
    import dataclasses

    from asyncflow.config_keys import keys

    listed = {k.name: k for k in keys()}
    defaults = dataclasses.asdict(AsyncFlowConfig())
    every = {f"{section}.{key}" for section, values in defaults.items() for key in values}
    assert set(listed) == every
    assert all(k.doc for k in listed.values()), [k.name for k in listed.values() if not k.doc]
    lr = listed["trainer.lr"]
    assert (lr.type, lr.default, lr.doc) == ("float", "0.001", "Adam learning rate.")
    assert listed["rollout.dtype"].type == "'float32' | 'bfloat16' | 'float16' | 'auto'"
    assert listed["ray.address"].type == "str | None" and listed["ray.address"].default == "null"
    # a subclass's docstring of an inherited field wins: the critic's engine is a critic engine
    assert "CRITIC_ENGINES" in listed["critic.engine"].doc and "TRAIN_ENGINES" in listed["trainer.engine"].doc
    assert "critic.sequence_parallel" not in listed and "trainer.sequence_parallel" in listed


def test_config_keys_command_prints_one_section():
    out = _cli("config", "keys", "critic")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "# critic (CriticConfig)"
    at = lines.index("critic.micro_batch_size: int = 4")
    assert lines[at + 1] == "    Sequences per micro-batch in the pipeline schedule."
    assert not any(line.startswith(("trainer.", "rollout.")) for line in lines)
    bad = _cli("config", "keys", "critics")
    assert bad.returncode == 2 and "unknown config section 'critics'" in bad.stderr and "critic," in bad.stderr
