"""recipes/slurm/asyncflow.sbatch: its directives, and its control flow with stand-ins for Slurm and Ray.

Slurm and a GPU cluster are absent here, so `srun`, `scontrol`, `ray`, `apptainer` and `asyncflow` are stub
scripts on PATH that record their arguments (srun and apptainer then run the command they wrap, as the real
ones do). Everything else is real: the template, recipes/<model>/launch.sh, recipes/common/ray_cluster.sh and
the recipe check. The Ray wait (a Python script that connects to the cluster) is the one step answered by the
python stub.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "recipes/slurm/asyncflow.sbatch"
RECIPE = ROOT / "recipes/qwen2.5-7b"
JOB = "4242"

_STUBS = {
    # `scontrol show hostnames` lists this machine (the first node runs the head) and node2.
    "scontrol": """if [ "$1 $2" = "show hostnames" ]; then hostname; echo node2; exit 0; fi
echo "scontrol $*" >> "$MARKER"
""",
    # Options first (-w takes a value), then the command, which runs.
    "srun": """echo "srun $*" >> "$MARKER"
while [ $# -gt 0 ]; do case "$1" in -w) shift 2 ;; -*) shift ;; *) break ;; esac; done
exec "$@"
""",
    "apptainer": """echo "apptainer $*" >> "$MARKER"
shift  # exec
while [ $# -gt 0 ]; do case "$1" in --bind) shift 2 ;; -*) shift ;; *) break ;; esac; done
shift  # the image
exec "$@"
""",
    # STUB_HEAD=block: the head runs until SIGTERM, as `ray start --block` does.
    "ray": """echo "ray $*" >> "$MARKER"
case "$STUB_HEAD $*" in
    "block "*--head*) trap 'echo "head got SIGTERM" >> "$MARKER"; exit 0' TERM
                      while :; do sleep 0.2; done ;;
esac
""",
    # The driver: STUB_TRAIN=exit:N exits N at once; term:N waits for SIGTERM, then exits N.
    "asyncflow": """ifs="NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"
echo "asyncflow $* $ifs" >> "$MARKER"
code=${STUB_TRAIN#*:}
case "$STUB_TRAIN" in
    term:*) trap 'echo "driver got SIGTERM" >> "$MARKER"; exit $code' TERM
            echo "driver waiting" >> "$MARKER"
            while :; do sleep 0.2; done ;;
    *) exit "$code" ;;
esac
""",
    # Real Python, except the launcher's wait for the Ray cluster (stdin script; $5 nodes, $7 the file it writes),
    # which waits, as the real one does, until every node's `ray start` has run.
    "python3": f"""case "$7" in */ray_nodes.txt)
    i=0
    while n=$(grep -c '^ray start' "$MARKER" 2>/dev/null); [ "${{n:-0}}" -lt "$5" ] && [ $i -lt 1200 ]; do
        sleep 0.1; i=$((i + 1))
    done
    echo "wait for ray $2 $4" >> "$MARKER"; : > "$7"; exit 0 ;;
esac
exec {sys.executable} "$@"
""",
}


def _job_env(tmp_path: Path, train: str, **extra: str) -> tuple[dict, Path]:
    """The environment of a batch job on node[1-2] whose tools are the stubs above."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir(exist_ok=True)
    for name, body in _STUBS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    shutil.copy(RECIPE / "model_arch.json", model_dir / "config.json")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp_path), "MARKER": str(marker),
           "PYTHON": str(bin_dir / "python3"), "SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURMD_NODENAME": "node1", "SLURM_SUBMIT_DIR": str(ROOT), "ASYNCFLOW_HOME": str(tmp_path),
           "RECIPE": str(RECIPE), "MODEL_DIR": str(model_dir), "LAUNCH_DIR": str(tmp_path / "launch"),
           "RAY_TMPDIR": str(tmp_path / "ray"), "RAY_PORT": "21000", "HEAD_IP": "10.0.0.1",
           "TRAIN_STOP_GRACE_S": "20", "OMP_NUM_THREADS": "1", "STUB_TRAIN": train, **extra}
    return env, marker


def _submit(env: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TEMPLATE), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def _calls(marker: Path, prefix: str) -> list[str]:
    return [line for line in marker.read_text().splitlines() if line.startswith(prefix)]


def test_template_is_valid_bash_with_the_directives_slurm_needs():
    result = subprocess.run(["bash", "-n", str(TEMPLATE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", TEMPLATE.read_text(), re.M))
    assert directives["ntasks-per-node"] == "1"
    assert directives["signal"] == "B:TERM@120"  # the batch shell gets SIGTERM 120 s before the limit
    assert "requeue" in directives
    assert "%j" in directives["output"] and "%j" in directives["error"]
    for key in ("job-name", "nodes", "gpus-per-node", "cpus-per-task", "time"):
        assert directives[key], key
    assert re.fullmatch(r"\d+:\d\d:\d\d", directives["time"])


def test_requeue_code_is_the_drivers():
    """The template requeues on the code the driver exits with after a checkpoint on SIGTERM."""
    from asyncflow.workflow.signals import EX_TEMPFAIL

    default = re.search(r"REQUEUE_EXIT_CODE=\$\{REQUEUE_EXIT_CODE:-(\d+)\}", TEMPLATE.read_text())
    assert default and int(default.group(1)) == EX_TEMPFAIL == 75


def test_starts_head_and_workers_then_trains_with_resume(tmp_path):
    env, marker = _job_env(tmp_path, "exit:0")
    result = _submit(env, tmp_path, "data.path=/shared/train.parquet")
    assert result.returncode == 0, result.stderr
    head, = [c for c in _calls(marker, "ray start") if "--head" in c]
    assert "--node-ip-address=10.0.0.1" in head.split() and "--port=21000" in head.split()
    worker, = _calls(marker, "srun")
    assert "-w node2" in worker and "ray start --block" in worker and "--address=10.0.0.1:21000" in worker
    assert "--export=ALL" in worker.split()
    train, = _calls(marker, "asyncflow")
    words = train.split()
    assert words[:3] == ["asyncflow", "train", str(RECIPE / "config.yaml")]
    assert "ray.address=10.0.0.1:21000" in words and f"model.path={env['MODEL_DIR']}" in words
    assert "data.path=/shared/train.parquet" in words and "--resume" in words
    # The driver's wait for a step boundary fits the template's 120 s; the user's overrides come after it.
    assert words.index("checkpoint.signal_grace_s=60") < words.index("data.path=/shared/train.parquet")
    assert not _calls(marker, "scontrol")


def test_single_node_quickstart_starts_only_the_head(tmp_path):
    recipe = ROOT / "recipes/qwen2.5-1.5b-8gpu"
    env, marker = _job_env(tmp_path, "exit:0", RECIPE=str(recipe), SLURM_JOB_NODELIST="node1")
    shutil.copy(recipe / "model_arch.json", Path(env["MODEL_DIR"]) / "config.json")
    result = _submit(env, tmp_path, "data.path=/shared/gsm8k/train.parquet")
    assert result.returncode == 0, result.stderr
    assert not _calls(marker, "srun")  # NODES=1: nothing to start elsewhere
    head, = _calls(marker, "ray start")
    assert "--head" in head and "--num-gpus=8" in head.split()
    train, = _calls(marker, "asyncflow")
    assert train.split()[:3] == ["asyncflow", "train", str(recipe / "config.yaml")] and "--resume" in train.split()


@pytest.mark.parametrize("code,requeued,status", [(75, True, 0), (1, False, 1)])
def test_requeues_only_after_a_checkpointed_stop(tmp_path, code, requeued, status):
    env, marker = _job_env(tmp_path, f"exit:{code}")
    result = _submit(env, tmp_path)
    assert result.returncode == status, result.stderr
    assert (_calls(marker, "scontrol") == [f"scontrol requeue {JOB}"]) == requeued, marker.read_text()


def test_sigterm_reaches_the_driver_and_its_75_requeues(tmp_path):
    env, marker = _job_env(tmp_path, "term:75")
    job = subprocess.Popen(["bash", str(TEMPLATE)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until the driver runs
            if marker.exists() and "driver waiting" in marker.read_text():
                break
            assert job.poll() is None, job.communicate()
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 and a preemption do
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    calls = marker.read_text().splitlines()
    assert "driver got SIGTERM" in calls
    assert calls[-1] == f"scontrol requeue {JOB}", calls
    assert "SIGTERM: asking the driver to checkpoint" in err and "the training driver exited with code 75" in err


def test_a_signal_to_the_whole_job_stops_ray_only_after_the_driver(tmp_path):
    """scancel and preemptions signal every process of the batch step at once: the Ray head must outlive the
    driver's checkpoint, and the driver's 75 must still reach the template."""
    env, marker = _job_env(tmp_path, "term:75", STUB_HEAD="block")
    job = subprocess.Popen(["bash", str(TEMPLATE)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(600):
            if marker.exists() and "driver waiting" in marker.read_text():
                break
            assert job.poll() is None, job.communicate()
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, err
    calls = marker.read_text().splitlines()
    assert calls.index("driver got SIGTERM") < calls.index("head got SIGTERM"), calls
    assert calls[-1] == f"scontrol requeue {JOB}", calls


def test_network_interface_and_apptainer(tmp_path):
    env, marker = _job_env(tmp_path, "exit:0", NET_IF="lo", CONTAINER="apptainer",
                           CONTAINER_IMAGE="/images/asyncflow.sif", CONTAINER_MOUNTS="/shared")
    del env["HEAD_IP"]  # from NET_IF
    result = _submit(env, tmp_path)
    assert result.returncode == 0, result.stderr
    prefix = "apptainer exec --nv --bind /shared /images/asyncflow.sif"
    head, = [c for c in _calls(marker, "apptainer") if "--head" in c]
    assert head.startswith(f"{prefix} ray start") and "--node-ip-address=127.0.0.1" in head
    worker, = _calls(marker, "srun")
    # On the worker, the host's bash finds the interface's address, then the container starts Ray.
    assert f" lo {prefix} ray start --block" in worker and "--address=127.0.0.1:" in worker
    assert any(c.startswith(f"{prefix} asyncflow train") for c in _calls(marker, "apptainer"))
    train, = _calls(marker, "asyncflow")
    assert train.endswith("NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo")


def test_node_address_snippet_appends_the_interfaces_address():
    """The snippet each worker node runs for NET_IF, run here on the loopback interface."""
    lib = ROOT / "recipes/common/ray_cluster.sh"
    out = subprocess.run(["bash", "-c", f'source {lib}; bash -c "$RC_NODE_IP_SH" lo echo ray start'],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ray start --node-ip-address=127.0.0.1", out.stderr
    bad = subprocess.run(["bash", "-c", f'source {lib}; bash -c "$RC_NODE_IP_SH" no-such-if0 echo x'],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "no IPv4 address on network interface no-such-if0" in bad.stderr


def test_pyxis_runs_every_command_in_the_jobs_container(tmp_path):
    env, marker = _job_env(tmp_path, "exit:0", CONTAINER="pyxis", CONTAINER_IMAGE="nvcr.io#asyncflow:1")
    result = _submit(env, tmp_path)
    assert result.returncode == 0, result.stderr
    container = f"--container-image=nvcr.io#asyncflow:1 --container-name=asyncflow-{JOB}"
    steps = _calls(marker, "srun")
    assert steps and all(container in s for s in steps), steps
    local = [s for s in steps if "--overlap" in s and "-w node1" in s]
    assert any("ray start --block" in s and "--head" in s for s in local)
    assert any(" train " in s for s in local)
    assert any("-w node2" in s and "ray start --block" in s for s in steps)


def test_missing_settings_are_one_line(tmp_path):
    env, marker = _job_env(tmp_path, "exit:0", CONTAINER="apptainer")
    result = _submit(env, tmp_path)
    assert result.returncode == 2 and "CONTAINER=apptainer needs CONTAINER_IMAGE" in result.stderr
    del env["MODEL_DIR"]
    result = _submit(env, tmp_path)
    assert result.returncode != 0 and "set MODEL_DIR" in result.stderr
    assert not marker.exists()
