"""Cluster recipes: every recipes/<model>/ is consistent with its model and cluster; bad ones are named.

The launchers cannot start a real multi-node cluster here; they are syntax-checked, and run far enough to
show that without MODEL_DIR (or with a recipe that fails the check) they stop before touching Ray.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncflow.cli import main as cli_main
from asyncflow.config import ConfigError, load_config
from asyncflow.planner.plan import plan_recipe, render
from asyncflow.recipes_check import check_recipe, main, read_cluster_env

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.parent for p in (ROOT / "recipes").glob("*/model_arch.json"))
LAUNCHERS = sorted((ROOT / "recipes").glob("*/launch.sh"))


def test_cluster_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen2.5-1.5b-8gpu"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_is_consistent(recipe):
    assert check_recipe(recipe) == []


def _copy(tmp_path: Path, name: str, config: dict | None = None, env: dict | None = None,
          arch: dict | None = None) -> Path:
    """A copy of recipes/<name> with some config keys, cluster.env variables or model facts changed."""
    dst = tmp_path / "recipes" / name
    shutil.copytree(ROOT / "recipes" / name, dst)
    if config:
        data = yaml.safe_load((dst / "config.yaml").read_text())
        for dotted, value in config.items():
            section, key = dotted.split(".")
            data.setdefault(section, {})[key] = value
        (dst / "config.yaml").write_text(yaml.safe_dump(data))
    if env:
        values = {**read_cluster_env(dst / "cluster.env"), **env}
        (dst / "cluster.env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    if arch:
        facts = json.loads((dst / "model_arch.json").read_text())
        (dst / "model_arch.json").write_text(json.dumps({**facts, **arch}))
    return dst


def _one_problem_with(problems: list[str], *fragments: str) -> None:
    assert any(all(f in p for f in fragments) for p in problems), problems


def test_tp_must_divide_heads(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"trainer.tensor_parallel": 8, "trainer.data_parallel": 1})
    problems = check_recipe(recipe)
    _one_problem_with(problems, "qwen2.5-7b", "trainer.tensor_parallel=8", "num_attention_heads=28")
    assert not any("TRAINER_DEVICES" in p for p in problems), problems  # 8 x 1 x 1 still matches


def test_rollout_tp_must_divide_heads(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-32b", config={"rollout.tensor_parallel": 16, "workflow.rollout_instances": 2},
                   env={"DEVICES_PER_NODE": 16, "NODES": 4})
    _one_problem_with(check_recipe(recipe), "rollout.tensor_parallel=16", "num_attention_heads=40")


def test_kv_heads_and_tp_must_nest(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", arch={"num_key_value_heads": 3, "num_attention_heads": 30,
                                                   "intermediate_size": 18960})
    _one_problem_with(check_recipe(recipe), "trainer.tensor_parallel=2", "num_key_value_heads=3", "GQA")


def test_pp_must_divide_layers(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"trainer.pipeline_parallel": 3, "trainer.data_parallel": 1},
                   env={"TRAINER_DEVICES": 6})
    problems = check_recipe(recipe)
    assert problems == ["qwen2.5-7b: trainer.pipeline_parallel=3 does not divide num_hidden_layers=28"]


def test_ep_must_divide_experts(tmp_path):
    recipe = _copy(tmp_path, "qwen3-30b-a3b", config={"trainer.expert_parallel": 6})
    _one_problem_with(check_recipe(recipe), "qwen3-30b-a3b", "trainer.expert_parallel=6", "num_experts=128")


def test_expert_grid_must_divide_trainer_world(tmp_path):
    # EP 16 divides 128 experts, but ETP (= TP 2) x EP 16 x PP 1 = 32 ranks > the trainer's 16
    recipe = _copy(tmp_path, "qwen3-30b-a3b", config={"trainer.expert_parallel": 16})
    assert check_recipe(recipe) == [
        "qwen3-30b-a3b: expert grid ETP x EP x PP = 2 x 16 x 1 = 32 does not divide the trainer's world "
        "TP x PP x DP = 16 (Megatron initialize_model_parallel)"
    ]


def test_expert_parallel_on_a_dense_model(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"trainer.expert_parallel": 2})
    _one_problem_with(check_recipe(recipe), "trainer.expert_parallel=2", "dense model")


def test_too_many_devices(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", env={"NODES": 1})
    assert check_recipe(recipe) == [
        "qwen2.5-7b: too many devices: trainer + rollout = 16 > NODES x DEVICES_PER_NODE = 1 x 8 = 8"
    ]


def test_sync_mode_still_gives_rollout_and_trainer_their_own_devices(tmp_path):
    # Colocating vLLM and Megatron on the same devices (vLLM sleep mode) is not implemented: the placement
    # group asks for trainer + rollout devices in both modes, and the check says so.
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"workflow.mode": "sync"}, env={"NODES": 1})
    assert check_recipe(recipe) == [
        "qwen2.5-7b: too many devices: trainer + rollout = 16 > NODES x DEVICES_PER_NODE = 1 x 8 = 8"
    ]


def test_accelerator_must_match_the_cluster_resource(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", env={"DEVICE_RESOURCE": "NPU"})
    _one_problem_with(check_recipe(recipe), "ray.accelerator='GPU'", "DEVICE_RESOURCE=NPU")


def test_a_critic_of_another_shape_needs_devices_of_its_own(tmp_path):
    same = _copy(tmp_path / "a", "qwen2.5-7b", config={"algorithm.advantage": "gae", "critic.tensor_parallel": 2,
                                                       "critic.data_parallel": 4})
    assert check_recipe(same) == []  # shares the actor's 8 devices
    other = _copy(tmp_path / "b", "qwen2.5-7b", config={"algorithm.advantage": "gae", "critic.tensor_parallel": 2,
                                                        "critic.data_parallel": 2})
    _one_problem_with(check_recipe(other), "trainer + rollout + critic = 20")


def test_device_counts_must_match_parallel_sizes(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"workflow.rollout_instances": 4, "rollout.tensor_parallel": 1},
                   env={"TRAINER_DEVICES": 4})
    problems = check_recipe(recipe)
    _one_problem_with(problems, "TRAINER_DEVICES=4", "2 x 1 x 4 = 8")
    _one_problem_with(problems, "ROLLOUT_DEVICES=8", "4 x 1 = 4")


def test_warm_spares_count_in_the_rollout_devices(tmp_path):
    # qwen2.5-7b: 8 rollout devices, 4 instances of TP 2. A spare holds TP devices of its own, of the rollout's.
    spares = _copy(tmp_path / "a", "qwen2.5-7b", config={"workflow.rollout_spares": 2})
    _one_problem_with(check_recipe(spares), "ROLLOUT_DEVICES=8",
                      "(workflow.rollout_instances + workflow.rollout_spares)", "(4 + 2) x 2 = 12")
    fits = _copy(tmp_path / "b", "qwen2.5-7b", config={"workflow.rollout_spares": 1, "workflow.rollout_instances": 3})
    assert check_recipe(fits) == []


def test_batch_must_split_over_replicas(tmp_path):
    rows = {"workflow.prompts_per_step": 3, "workflow.samples_per_prompt": 3}
    recipe = _copy(tmp_path / "padded", "qwen2.5-7b", config={**rows, "trainer.micro_batch_tokens": 0})
    _one_problem_with(check_recipe(recipe), "config.yaml", "9 rows", "micro_batch_size x trainer.data_parallel = 1 x 4")
    # Packing: the four replicas take 3, 2, 2 and 2 rows; fewer rows than replicas leave one with none.
    assert check_recipe(_copy(tmp_path / "packed", "qwen2.5-7b", config=rows)) == []
    few = _copy(tmp_path / "few", "qwen2.5-7b", config={**rows, "workflow.prompts_per_step": 1})
    _one_problem_with(check_recipe(few), "config.yaml", "3 rows per step must be at least trainer.data_parallel = 4")


def test_overrides_are_checked_too():
    problems = check_recipe(ROOT / "recipes/qwen2.5-32b", overrides=["trainer.pipeline_parallel=3"])
    _one_problem_with(problems, "trainer.pipeline_parallel=3", "num_hidden_layers=64")


def test_longest_prompt_and_response_must_fit():
    problems = check_recipe(ROOT / "recipes/qwen2.5-7b", overrides=["data.max_prompt_len=2048"])
    assert problems == ["qwen2.5-7b: config.yaml: data.max_prompt_len + rollout.max_new_tokens = 2048 + 4096 = 6144 > "
                        "rollout.max_model_len=5120"]


def test_sizes_below_one_are_named():
    assert check_recipe(ROOT / "recipes/qwen2.5-7b", overrides=["trainer.data_parallel=0"]) == [
        "qwen2.5-7b: config.yaml: trainer.data_parallel=0 must be at least 1"
    ]


def test_unknown_config_key_is_named(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", config={"trainer.tensor_paralel": 2})
    _one_problem_with(check_recipe(recipe), "config.yaml", "unknown config key 'trainer.tensor_paralel'")


def test_cluster_env_rejects_shell_expansion(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b")
    with open(recipe / "cluster.env", "a") as f:
        f.write("NODES=$SLURM_NNODES\n")
    _one_problem_with(check_recipe(recipe), "cluster.env:", "without shell expansion", "$SLURM_NNODES")


def test_missing_files_are_named(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b")
    (recipe / "model_arch.json").unlink()
    assert check_recipe(recipe) == ["qwen2.5-7b: model_arch.json is missing"]


def test_checkpoint_must_be_the_recipes_model(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    facts = json.loads((ROOT / "recipes/qwen2.5-32b/model_arch.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(facts))
    assert check_recipe(ROOT / "recipes/qwen2.5-32b", model_dir) == []
    problems = check_recipe(ROOT / "recipes/qwen2.5-7b", model_dir)
    _one_problem_with(problems, "num_hidden_layers=64", "model_arch.json says 28", "recipe's model")


def test_command_line_exit_status(tmp_path, capsys):
    assert main([str(ROOT / "recipes/qwen2.5-7b")]) == 0
    bad = _copy(tmp_path, "qwen2.5-7b", env={"NODES": 1})
    assert main([str(bad)]) == 1
    assert "recipe check: qwen2.5-7b: too many devices" in capsys.readouterr().err
    assert main([str(ROOT / "recipes/qwen2.5-7b"), "rollout.tensor_parallel=3"]) == 1
    assert "rollout.tensor_parallel=3 does not divide num_attention_heads=28" in capsys.readouterr().err


def test_moe_at_tp2_needs_sequence_parallel():
    problems = check_recipe(ROOT / "recipes/qwen3-30b-a3b", overrides=["trainer.sequence_parallel=false"])
    _one_problem_with(problems, "trainer.sequence_parallel=false", "MoE model at tensor_parallel=2")


def test_cluster_env_device_memory_must_be_a_positive_number(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b", env={"DEVICE_MEMORY_GB": "lots"})
    _one_problem_with(check_recipe(recipe), "DEVICE_MEMORY_GB='lots' must be a positive number")


# ---- memory plan ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_fits_its_devices(recipe):
    plan = plan_recipe(recipe)
    assert plan.fits, render(plan)
    assert {t.task for t in plan.tasks} >= {"trainer rank", "rollout device"}


def test_quickstart_fits_one_node_with_room():
    """The single-node quickstart keeps a quarter of every device free: room for what the estimate leaves out."""
    recipe = ROOT / "recipes/qwen2.5-1.5b-8gpu"
    env = read_cluster_env(recipe / "cluster.env")
    assert (env["NODES"], env["DEVICES_PER_NODE"], env["DEVICE_MEMORY_GB"]) == ("1", "8", "80")
    plan = plan_recipe(recipe)
    assert plan.fits and all(task.total <= 0.75 * task.budget for task in plan.tasks), render(plan)


def test_plan_command_line_prints_a_table_per_task(capsys):
    assert cli_main(["plan", str(ROOT / "recipes/qwen2.5-32b")]) == 0
    out = capsys.readouterr().out
    for needle in ("trainer rank", "rollout device", "TP8 PP2 DP2", "optimizer states", "KV cache", "verdict"):
        assert needle in out, out


def test_plan_names_the_smallest_change_that_fits(capsys):
    # Without the distributed optimizer the 7B trainer rank holds 18 bytes per parameter and does not fit.
    recipe = str(ROOT / "recipes/qwen2.5-7b")
    assert cli_main(["plan", recipe, "trainer.use_distributed_optimizer=false"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    fix = next(line for line in out.splitlines() if line.startswith("trainer rank: smallest change"))
    assert "trainer.use_distributed_optimizer=true" in fix
    changes = fix.split(": ")[-1].split()
    assert plan_recipe(recipe, ["trainer.use_distributed_optimizer=false", *changes]).fits


def test_plan_shrinks_the_kv_cache_to_what_fits():
    # One engine per GPU (TP1): its KV cache has room for 192 sequences of max_model_len.
    plan = plan_recipe(ROOT / "recipes/qwen2.5-7b", ["rollout.tensor_parallel=1", "workflow.rollout_instances=8",
                                                     "rollout.max_num_seqs=512"])
    rollout = next(t for t in plan.tasks if t.task == "rollout device")
    assert not rollout.fits and "512 x 5120 tokens wanted, room for 192 sequences" in rollout.notes[0]
    changes, fixed = plan.fixes["rollout device"]
    assert fixed.fits and changes == ["rollout.max_num_seqs=192"], changes


def test_plan_counts_the_colocated_reference_model():
    with_ref = plan_recipe(ROOT / "recipes/qwen2.5-7b", ["trainer.reference_placement=colocated"]).tasks[0]
    without = plan_recipe(ROOT / "recipes/qwen2.5-7b", ["algorithm.kl_coef=0"]).tasks[0]
    assert "reference weights" in with_ref.terms and "reference weights" not in without.terms
    assert with_ref.terms["reference weights"] == with_ref.terms["weights"]  # the same shards, forward only


@pytest.mark.parametrize("placement,tasks", [("own", 3), ("offload", 2)])
def test_plan_follows_the_reference_placement(placement, tasks):
    colocated = plan_recipe(ROOT / "recipes/qwen2.5-7b", ["trainer.reference_placement=colocated"]).tasks[0]
    planned = plan_recipe(ROOT / "recipes/qwen2.5-7b", [f"trainer.reference_placement={placement}"]).tasks
    assert len(planned) == tasks
    assert planned[0].terms.get("reference weights", 0) < colocated.terms["reference weights"]
    if placement == "own":
        assert planned[2].task == "reference rank" and planned[2].terms["reference weights"] > 0
    else:  # the embedding and output layer plus two of the 28 layers
        assert planned[0].terms["reference weights"] < 0.3 * colocated.terms["reference weights"]


def test_cluster_recipes_stream_the_reference_from_host_memory():
    # The multi-node recipes; the single-node quickstart (1.5B) keeps its 3 GB reference on the trainer's GPUs.
    multi_node = [r for r in RECIPES if int(read_cluster_env(r / "cluster.env")["NODES"]) > 1]
    assert {r.name for r in multi_node} >= {"qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b"}
    for recipe in multi_node:
        assert plan_recipe(recipe).tasks[0].terms["reference weights"] < 0.3 * plan_recipe(
            recipe, ["trainer.reference_placement=colocated"]).tasks[0].terms["reference weights"]


def test_plan_needs_the_device_memory(tmp_path):
    recipe = _copy(tmp_path, "qwen2.5-7b")
    env = read_cluster_env(recipe / "cluster.env")
    del env["DEVICE_MEMORY_GB"]
    (recipe / "cluster.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    with pytest.raises(ConfigError, match="DEVICE_MEMORY_GB"):
        plan_recipe(recipe)


# ---- launchers ---------------------------------------------------------------------------------------------

def test_launchers_are_valid_bash():
    assert {p.parent.name for p in LAUNCHERS} >= {p.name for p in RECIPES}
    for script in [*LAUNCHERS, ROOT / "recipes/common/ray_cluster.sh"]:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def _fake_tools(tmp_path: Path) -> tuple[dict, Path]:
    """A clean environment whose ray / srun / ssh / scontrol / asyncflow only leave a mark if they are run."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    for tool in ("ray", "srun", "ssh", "scontrol", "asyncflow"):
        path = bin_dir / tool
        path.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {marker}\n")
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "HOSTS": "localhost localhost",
           "SLURM_JOB_NODELIST": "node[1-2]", "PYTHON": sys.executable}
    return env, marker


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_without_model_dir_prints_usage_and_starts_nothing(launcher, tmp_path):
    env, marker = _fake_tools(tmp_path)
    result = subprocess.run(["bash", str(launcher)], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert "usage: MODEL_DIR=" in result.stderr
    assert "MODEL_DIR is not set" in result.stderr
    assert not marker.exists(), marker.read_text()


def test_launcher_help_exits_zero(tmp_path):
    env, marker = _fake_tools(tmp_path)
    result = subprocess.run(["bash", str(ROOT / "recipes/qwen3-30b-a3b/launch.sh"), "--help"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "4 node(s) x 8 GPU" in result.stderr
    assert not marker.exists()


def _launcher_env(tmp_path):
    """Fake cluster tools, a 7B-shaped model folder as MODEL_DIR, and no Slurm allocation (the ssh path)."""
    env, marker = _fake_tools(tmp_path)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(ROOT / "recipes/qwen2.5-7b/model_arch.json", model_dir / "config.json")
    env.update(MODEL_DIR=str(model_dir), OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_NODELIST")
    return env, marker


def test_launcher_stops_before_ray_when_the_recipe_check_fails(tmp_path):
    env, marker = _launcher_env(tmp_path)
    # The launcher checks the config with the overrides it will train with: TP 8 does not divide 28 heads.
    result = subprocess.run(["bash", str(ROOT / "recipes/qwen2.5-7b/launch.sh"), "trainer.tensor_parallel=8"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "trainer.tensor_parallel=8 does not divide num_attention_heads=28" in result.stderr
    assert "recipe check failed" in result.stderr and "nothing was started" in result.stderr
    assert not marker.exists(), marker.read_text()
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_cluster_recipes_checkpoint_by_default(recipe):
    cfg = load_config(recipe / "config.yaml")
    assert cfg.checkpoint.interval > 0 and cfg.checkpoint.keep_last >= 1
    assert cfg.checkpoint.interval <= cfg.workflow.steps // 4  # several checkpoints in a run


def _source_launcher(script: str, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in bash after sourcing the shared launcher (its functions, no cluster)."""
    lib = ROOT / "recipes/common/ray_cluster.sh"
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {lib}; {script}"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_launcher_passes_the_run_environment_to_every_node(tmp_path):
    env, marker = _fake_tools(tmp_path)
    (tmp_path / "bin/ssh").write_text(f"#!/bin/sh\necho ssh \"$@\" >> {marker}\necho 4242\n")  # the remote pid
    env.update(NCCL_SOCKET_IFNAME="eth9", GLOO_SOCKET_IFNAME="eth9", HF_HOME="/shared/hf cache",
               LD_LIBRARY_PATH="/opt/lib", PYTHONPATH="/shared/code", CUDA_DEVICE_MAX_CONNECTIONS="1",
               NOT_FOR_NODES="x", RC_NAME="t", LAUNCH_DIR=str(tmp_path), RAY_BIN="ray", RAY_TMPDIR="/tmp/af_t",
               RAY_PORT="20000", DEVICE_RESOURCE="GPU", DEVICES_PER_NODE="8", RAY_AUTH_MODE="disabled",
               SSH_OPTS="", SRUN_EXTRA_ARGS="")
    result = _source_launcher("RC_MODE=ssh rc_start_ray node2 1 --address=h:1; "
                              "RC_MODE=slurm rc_start_ray node3 2 --address=h:1; wait", env, tmp_path)
    assert result.returncode == 0, result.stderr
    ssh = next(line for line in marker.read_text().splitlines() if line.startswith("ssh"))
    for word in ("NCCL_SOCKET_IFNAME=eth9", "GLOO_SOCKET_IFNAME=eth9", r"HF_HOME=/shared/hf\ cache",
                 "LD_LIBRARY_PATH=/opt/lib", "PYTHONPATH=/shared/code", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert f" {word} " in ssh, (word, ssh)
    assert "NOT_FOR_NODES" not in ssh
    srun = next(line for line in marker.read_text().splitlines() if line.startswith("srun"))
    assert "--export=ALL" in srun.split()  # srun hands the whole environment over


def test_launcher_forwards_resume_and_absolute_roots(tmp_path):
    env, marker = _launcher_env(tmp_path)
    # No cluster can start here: the cluster start and the wait for devices are skipped, the rest is the launcher's.
    recipe = ROOT / "recipes/qwen2.5-7b"
    script = (f"rc_start_cluster() {{ RC_ADDRESS=head:1; }}; rc_wait_for_devices() {{ :; }}; "
              f"rc_main {recipe} --resume checkpoint.dir=ckpt trainer.lr=1e-6")
    proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail; source {ROOT / 'recipes/common/ray_cluster.sh'}; "
                             f"{script}"], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    # The default Ray temp dir it made (named by the job id: outside Slurm, the launcher's pid) is removed at the
    # end, as Ray left nothing in it.
    assert not Path(f"/tmp/af_ray_{proc.pid}").exists()
    train = next(line for line in marker.read_text().splitlines() if line.startswith("asyncflow"))
    words = train.split()
    assert words[:3] == ["asyncflow", "train", str(recipe / "config.yaml")]
    assert "trainer.lr=1e-6" in words and words[-1] == "--resume"
    assert f"observability.output_dir={tmp_path / 'outputs/qwen2.5-7b'}" in words
    assert [w for w in words if w.startswith("checkpoint.dir=")][-1] == f"checkpoint.dir={tmp_path / 'ckpt'}"
