"""Every process group of a Megatron worker group times out at the run's ``workflow.step_timeout_s``, not at
torch's 10 minutes: a recipe step may keep a rank away from its group's next collective for an hour."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

READ = """
import os
for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
    os.environ.pop(key, None)
import torch
from megatron.core import parallel_state as ps
from asyncflow.models.parallel import init_megatron
init_megatron(1, 1, 0, timeout_s=4321.0)
def seconds(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
groups = {"world": torch.distributed.group.WORLD, "tp": ps.get_tensor_model_parallel_group(),
          "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
          "dp gloo": ps.get_data_parallel_group_gloo(), "ep": ps.get_expert_model_parallel_group()}
print("timeouts", {name: seconds(g) for name, g in groups.items()})
"""

FIRE = """
import os, sys, time
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import torch
from asyncflow.models.parallel import init_megatron
init_megatron(1, 1, 0, timeout_s=5.0)
if rank == 1:  # joins the group, then never takes part in the collective
    time.sleep(120)
    os._exit(0)
try:
    torch.distributed.all_reduce(torch.ones(4))
except Exception as exc:
    print("raised", type(exc).__name__, str(exc)[:200], flush=True)
    # Not sys.exit: tearing down a gloo group whose collective timed out can abort the interpreter at exit
    # ("terminate called without an active exception", SIGABRT), after the result this test checks.
    os._exit(0)
print("completed", flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_every_group_is_created_with_the_configured_timeout():
    out = subprocess.run([sys.executable, "-c", READ], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("timeouts"))
    timeouts = eval(line.split(" ", 1)[1])  # noqa: S307 - a dict this test's own child printed
    assert timeouts and set(timeouts.values()) == {4321.0}, timeouts


@pytest.mark.slow
def test_a_collective_with_a_missing_peer_fails_at_the_configured_timeout():
    """A real gloo all-reduce whose peer never arrives raises after the short timeout given (with torch's
    default the child would hang for 10 minutes and this test would hit its own limit)."""
    from asyncflow.models.parallel import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", FIRE, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=240)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 0 and out.splitlines()[-1].startswith("raised"), out[-2000:] + err[-3000:]
