"""A rollout instance whose process dies while it applies a weight version stops the run with an error that
names the instance and the version, and leaves nothing of the run in the Ray it joined.

In this process, on the shared Ray, with the fake engines; the rollout is ``tests.fakes.faulty.DiesApplying2``
(its process SIGKILLs itself when it starts applying version 2), so the death lands inside the apply every
time, with the whole pipeline around it real. A failed apply that the engine survives is ``test_failure``'s.
"""

import pytest

from asyncflow.workflow.errors import WorkerDiedError
from tests.recipe_runs import SMALL, ray_leftovers, run_fake

pytestmark = pytest.mark.faults


def test_rollout_killed_while_applying_stops_the_run_naming_it(tmp_path, tiny_model_dir, shared_ray):
    with pytest.raises(Exception) as failed:
        run_fake(tmp_path, tiny_model_dir, "run", "workflow.mode=sync", "workflow.max_staleness=0", *SMALL,
                 "algorithm.kl_coef=0", "rollout.engine=tests.fakes.faulty.DiesApplying2")
    error = failed.value  # checkpoints are off: not restarted (a ``ServiceLostError``), stops with this line
    assert isinstance(error, WorkerDiedError), repr(failed.value)
    assert str(error).startswith("rollout instance 0 died while applying weight version 2"), str(error)
    actors, groups, servers = ray_leftovers()
    assert not (actors or groups or servers), (actors, groups, servers)
