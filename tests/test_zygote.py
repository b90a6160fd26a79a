"""The shared Ray's fork server (``tests.zygote``): its workers are forked children of the server that run Ray's
own worker with their own environment, and each dies with the process the raylet started for it (the client), or
alone, as a worker started the normal way would."""

import os
import signal
import time

import psutil
import pytest

from tests.zygote import enabled

pytestmark = pytest.mark.skipif(not enabled(), reason="ASYNCFLOW_TEST_ZYGOTE=0 turns the fork server off")


def _probe(shared_ray, **options):
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def facts(self):
            import sys

            return {"pid": os.getpid(), "ppid": os.getppid(), "argv0": sys.argv[0], "x": os.environ.get("X"),
                    "client": int(os.environ["ASYNCFLOW_TEST_ZYGOTE_CLIENT"]), "torch": "torch" in sys.modules}

    actor = Probe.options(**options).remote()
    return actor, ray.get(actor.facts.remote(), timeout=60)


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_worker_is_a_forked_ray_worker_with_its_own_environment(shared_ray):
    import ray

    actor, facts = _probe(shared_ray, runtime_env={"env_vars": {"X": "from the actor's runtime_env"}})
    assert facts["ppid"] == shared_ray.forks.proc.pid  # forked by the server, not started by the raylet
    assert facts["argv0"].endswith(os.path.join("ray", "_private", "workers", "default_worker.py"))
    assert facts["x"] == "from the actor's runtime_env"
    assert facts["torch"]  # imported before the fork
    assert facts["client"] != facts["pid"] and psutil.Process(facts["client"]).is_running()
    ray.kill(actor)
    assert _gone(facts["pid"]) and _gone(facts["client"])


def test_a_worker_killed_by_its_pid_is_dead_to_ray_and_its_client_exits(shared_ray):
    import ray

    actor, facts = _probe(shared_ray)
    os.kill(facts["pid"], signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.facts.remote(), timeout=60)
    assert _gone(facts["client"])


def test_a_worker_whose_client_is_killed_exits(shared_ray):
    import ray

    actor, facts = _probe(shared_ray)
    os.kill(facts["client"], signal.SIGKILL)  # what the raylet does to a worker process it kills
    assert _gone(facts["pid"])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.facts.remote(), timeout=60)


PRELOAD_PROBE = """
import json, sys
from tests.zygote.server import _preload
_preload(real=True)
print(json.dumps({"modules": sorted(sys.modules)}))
"""


@pytest.mark.slow  # imports vLLM twice (once in the child that finds its modules)
def test_the_real_stack_server_imports_megatron_and_vllm_but_not_ray():
    # Ray imported before the fork would crash every worker (its core reads the worker's environment when it loads);
    # vLLM imports it deep inside `from vllm import LLM`, so the server stops short of that import.
    import json
    import subprocess
    import sys

    from tests.zygote import REPO

    proc = subprocess.run([sys.executable, "-c", PRELOAD_PROBE], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = set(json.loads(proc.stdout.strip().splitlines()[-1])["modules"])
    assert not {m for m in modules if m == "ray" or m.startswith("ray.")}
    assert {"megatron.core", "asyncflow.engines.megatron.actor", "asyncflow.engines.vllm.rollout"} <= modules
    assert len({m for m in modules if m.startswith("vllm.")}) > 100  # most of what `from vllm import LLM` loads


def _spawned_facts(conn, code: int) -> None:
    """The target of a process spawned inside a worker: report through the spawn's pipe, exit with ``code``."""
    import sys

    conn.send({"pid": os.getpid(), "ppid": os.getppid(), "torch": "torch" in sys.modules,
               "client": os.environ.get("ASYNCFLOW_TEST_ZYGOTE_CLIENT")})
    conn.close()
    sys.exit(code)


def test_a_process_a_worker_spawns_is_forked_by_the_server_and_ends_as_a_spawned_one(shared_ray):
    """A ``multiprocessing`` spawn inside a worker (as vLLM starts its tensor-parallel workers) goes through
    ``client.py --python``: the child is the server's, already has torch, gets the spawn's pipe at the number the
    spawn passed, and its exit code reaches the parent's ``Process``."""
    import ray

    @ray.remote(num_cpus=0)
    class Spawner:
        def spawn(self, code: int):
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_spawned_facts, args=(child, code))
            proc.start()
            child.close()
            facts = parent.recv()
            proc.join(60)
            return {**facts, "exitcode": proc.exitcode, "process_pid": proc.pid, "me": os.getpid(),
                    "server": os.getppid()}

    actor = Spawner.remote()
    try:
        for code in (0, 3):
            facts = ray.get(actor.spawn.remote(code), timeout=120)
            assert facts["exitcode"] == code
            assert facts["ppid"] == facts["server"] == shared_ray.forks.proc.pid  # a sibling of the worker
            assert facts["torch"]
            assert int(facts["client"]) == facts["process_pid"] != facts["pid"]  # the Process is the client
    finally:
        ray.kill(actor)
