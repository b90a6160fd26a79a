"""A user's mistake is one ``asyncflow: error:`` line that names the file or key and the fix, exit code 2, and no
traceback: a YAML syntax error (once a PyYAML traceback naming ``<unicode string>`` instead of the file), a missing
model path, a missing dataset file, a reward or engine that does not load (once a traceback from inside an actor,
after Ray had started). Each runs the real command line in a subprocess, so that a traceback would show. The run's
final line (``final_line``) is checked on the run of ``tests/test_api.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes/tiny_cpu/grpo_async.yaml"


def _cli(*argv: str, cwd: Path) -> tuple[int, list[str], str]:
    """``asyncflow ARGV`` in a subprocess: exit code, the lines of stderr, and stdout."""
    proc = subprocess.run([sys.executable, "-m", "asyncflow.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines(), proc.stdout


def _one_error(*argv: str, cwd: Path) -> str:
    """The single ``asyncflow: error:`` line a refused command prints (exit code 2, nothing else on stderr)."""
    code, err, out = _cli(*argv, cwd=cwd)
    assert not any("Traceback" in line for line in err), "\n".join(err)
    assert code == 2 and len(err) == 1 and err[0].startswith("asyncflow: error: "), (code, err, out)
    return err[0].removeprefix("asyncflow: error: ")


BROKEN = {
    "unclosed-list": ("workflow:\n  steps: 3\n  task: [add1\n",
                      "4:1: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at 3:9)"),
    "bad-indent": ("workflow:\n  steps: 3\n   task: add1\n", "3:8: mapping values are not allowed here"),
    "tab": ("workflow:\n\tsteps: 3\n", "2:1: found character '\\t' that cannot start any token"),
}


@pytest.mark.parametrize("command", [["config", "show"], ["train"]], ids=["config-show", "train"])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, command, name):
    text, expected = BROKEN[name]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    line = _one_error(*command, str(recipe), f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert line.startswith(f"{recipe}:{expected}"), line
    assert not (tmp_path / "run").exists()


def test_a_missing_model_path_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "Qwen2.5-7B-Instuct"
    line = _one_error("train", str(TINY), f"model.path={missing}", "model.make_tiny_if_missing=false",
                      f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert line.startswith(f"model.path {missing} does not exist"), line
    assert "model.make_tiny_if_missing=true" in line
    assert not missing.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("task", ["jsonl", "parquet"])
def test_a_missing_dataset_file_is_refused_before_the_run_starts(tmp_path, task):
    missing = tmp_path / f"gsm8k/train.{task}"
    model = tmp_path / "model"
    line = _one_error("train", str(TINY), f"model.path={model}", f"workflow.task={task}", f"data.path={missing}",
                      "data.max_prompt_len=16", f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert line == f"{missing}: no such file or directory (data.path); workflow.task={task} reads its prompts from " \
                   "data.path"
    # Refused before the tiny model is made, so before Ray and the engines too.
    assert not model.exists() and not (tmp_path / "run").exists()


def test_a_file_task_without_data_path_says_which_key_to_set(tmp_path):
    line = _one_error("train", str(TINY), f"model.path={tmp_path / 'model'}", "workflow.task=jsonl",
                      "data.max_prompt_len=16", f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert line == "workflow.task=jsonl needs data.path (a .jsonl file or a directory of them); set data.path=FILE"


@pytest.mark.parametrize("override,expected", [
    ("algorithm.reward=mathh", "algorithm.reward=mathh: unknown reward function; valid: add1, calc, classifier, math, "
                               "remote, or a dotted path (package.module:attribute) to your own"),
    ("rollout.engine=vlm", "rollout.engine=vlm: unknown rollout engine; valid: fake, vllm, or a dotted path"),
    ("algorithm.reward=my_rewards.gsm8k:compute_score", "algorithm.reward=my_rewards.gsm8k:compute_score: cannot "
                                                        "import 'my_rewards.gsm8k'"),
], ids=["unknown-name", "unknown-engine", "dotted-path-not-importable"])
def test_a_plugin_that_cannot_load_is_refused_before_ray_starts(tmp_path, override, expected):
    model = tmp_path / "model"
    line = _one_error("train", str(TINY), f"model.path={model}", override,
                      f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert line.startswith(expected), line
    assert not model.exists() and not (tmp_path / "run").exists()


def test_simulate_names_a_missing_cost_file_and_how_to_make_one(tmp_path):
    costs = tmp_path / "costs.json"
    line = _one_error("simulate", str(TINY), "--costs", str(costs), "--out", str(tmp_path / "sim"), cwd=tmp_path)
    assert line == f"--costs {costs} does not exist; write one with `asyncflow profile --out {costs}`"
    costs.write_text("{}")  # refused before the cost file is read
    metrics = tmp_path / "run/metrics.jsonl"
    line = _one_error("simulate", str(TINY), "--costs", str(costs), "--lengths", f"replay:{metrics}", "--out",
                      str(tmp_path / "sim"), cwd=tmp_path)
    assert line.startswith(f"--lengths replay:{metrics}: no such file"), line


def test_train_given_a_recipe_folder_names_its_config_file(tmp_path):
    recipe = REPO / "recipes/qwen2.5-7b"
    code, err, _ = _cli("train", str(recipe), cwd=tmp_path)
    assert code == 2 and err == [f"asyncflow: config error: {recipe} is a recipe folder; give its config file: "
                                 f"{recipe / 'config.yaml'}"], err


@pytest.mark.parametrize("error", ["trainer", "service", "storage"])
def test_a_run_lost_error_prints_its_own_message(monkeypatch, capsys, error):
    # A run-restart error's kind ("trainer", ...) is not a Ray task's wrapped ``cause``: the line is its message
    # (once "asyncflow: error: trainer").
    import argparse

    from asyncflow import cli
    from asyncflow.workflow.errors import ServiceLostError, StorageLostError, TrainerDiedError

    kind = {"trainer": TrainerDiedError, "service": ServiceLostError, "storage": StorageLostError}[error]

    def fails(args):
        raise kind("reward worker 0 died (its process exited)", "reward", 0)

    monkeypatch.setattr(cli, "build_parser", lambda: argparse.Namespace(parse_args=lambda argv: argparse.Namespace(
        func=fails)))
    assert cli.main([]) == 1
    assert capsys.readouterr().err == "asyncflow: error: reward worker 0 died (its process exited)\n"


def test_a_cluster_address_where_nothing_answers_is_one_line_not_a_wait(tmp_path, tiny_model_dir):
    # Once a driver given a dead cluster's address waited in ``ray.init`` for over 8 minutes (Ray's client waits for
    # the head's GCS without a bound): now it is refused at once, naming the address.
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, err, out = _cli("train", str(TINY), f"model.path={tiny_model_dir}", f"ray.address=127.0.0.1:{port}",
                          f"observability.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert not any("Traceback" in line for line in err), "\n".join(err)
    assert code == 1 and len(err) == 1 and err[0].startswith(
        f"asyncflow: error: no Ray cluster answers at ray.address=127.0.0.1:{port} (Connection refused)"), (code, err)
    assert "start the cluster" in err[0]
