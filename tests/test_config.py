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
