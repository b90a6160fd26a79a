"""A local Ray cluster starts actors (placed with a placement group) and shuts down cleanly."""

import os
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=0.5)
class Counter:
    def __init__(self, start: int):
        self.value = start

    def add(self, x: int) -> int:
        self.value += x
        return self.value

    def pid(self) -> int:
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_local_cluster_actors_and_clean_shutdown():
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="asyncflow-test", log_to_driver=False)
    try:
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        strategy = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
                    for i in range(2)]
        actors = [Counter.options(scheduling_strategy=s).remote(10 * i) for i, s in enumerate(strategy)]
        assert ray.get([a.add.remote(1) for a in actors]) == [1, 11]
        assert ray.get(actors[1].add.remote(5)) == 16  # state is kept per actor
        pids = ray.get([a.pid.remote() for a in actors])
        assert len(set(pids)) == 2 and os.getpid() not in pids
        remove_placement_group(pg)
    finally:
        ray.shutdown()
    assert not ray.is_initialized()
    deadline = time.time() + 20
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "actor processes outlived ray.shutdown()"


@pytest.mark.slow
def test_a_run_joins_a_running_cluster_even_where_the_recipe_sets_num_cpus():
    """``ray.address`` joins the cluster as it is: Ray refuses ``num_cpus`` when connecting, and the tiny recipes
    set it for the local cluster they would otherwise start."""
    import subprocess
    import sys

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        address = ray.get_runtime_context().gcs_address
        code = ("import ray\nfrom asyncflow.config import load_config\n"
                "from asyncflow.workflow.pipeline import connect_ray\n"
                f"connect_ray(load_config(None, ['ray.address={address}', 'ray.num_cpus=7']))\n"
                "print('CPU', ray.cluster_resources()['CPU'])\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "CPU 1.0" in proc.stdout  # the running cluster's CPUs, not the recipe's 7
    finally:
        ray.shutdown()
