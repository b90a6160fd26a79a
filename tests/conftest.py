"""Shared fixtures: a tiny Hugging Face model, one spawned vLLM process and the demo recipe's run, each made once per
session; and how the suite is split over pytest-xdist's workers (``make test`` runs two)."""

import multiprocessing as mp
import os

import pytest

# The test files that use a session fixture costly enough to make only once: under pytest-xdist each of these groups
# runs on one worker (a session fixture is made once per worker). Checked at collection.
SHARED_GROUPS = {
    "tests/workflow/test_e2e.py": "demo_run",
    "tests/simulator/test_calibration.py": "demo_run",
    "tests/engines/vllm/test_stream.py": "vllm_child",
    "tests/engines/vllm/test_vllm_rollout.py": "vllm_child",
    "tests/engines/vllm/test_moe_reload.py": "vllm_child",
    "tests/agents/test_agent_loop.py": "vllm_child",
    "tests/cluster/test_two_host.py": "two_hosts",
    "tests/cluster/test_across_hosts.py": "two_hosts",
    "tests/cluster/test_tq_two_hosts.py": "two_hosts",
}

# Files whose tests measure this machine (the simulator's calibration and its held-out run): under pytest-xdist they
# run first, with the other worker held until they end (``GroupScheduling``), as calibration assumes the machine is
# its own. Their group (``SHARED_GROUPS``) goes first in the collection.
# The worker-kill test too: beside another worker's runs, its run once did not stop within 120 s of the kill
# (2026-12-02, cause unknown; alone it stopped in 13-14 s every time).
QUIET_MODULES = {"tests/simulator/test_calibration.py", "tests/workflow/test_weight_failure.py"}

# Keep the 2-core CI machine responsive when several processes compute at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Undo what a test sets in this process's environment (an in-process vLLM engine sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, for one), so that runs started by later tests do not inherit it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 model (vocab 19, hidden 64, 2 layers, head_dim 32) with its tokenizer."""
    from asyncflow.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", seed=0)


@pytest.fixture(scope="session")
def vllm_child():
    """One spawned process, for the session, for the tests that drive an in-process vLLM engine (each test's
    function builds and closes its own engine there): vLLM's import is paid once instead of per test file, about
    15 s of a fresh process on 2 cores, and its process-wide settings never reach pytest's own process."""
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo recipe's async GRPO run (its own sizes, 32 prompts x 8 samples), 70 steps; made once and read
    by the end-to-end checks and by the simulator's held-out prediction. Its summary, with ``_out``."""
    from tests.recipe_runs import LEARN_STEPS, run_recipe

    return run_recipe(tmp_path_factory.mktemp("demo_run"), "async", 1, "async",
                      sizes=[f"workflow.steps={LEARN_STEPS}"])


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _group(nodeid: str) -> str:
    """The unit of work a worker takes whole: the test's file (its module fixtures are made once), or the
    file's shared group."""
    module = _module(nodeid)
    return SHARED_GROUPS.get(module, module)


def pytest_collection_modifyitems(config, items):
    """Check ``SHARED_GROUPS``, then put the groups that hold a slow test first: xdist hands out whole groups
    in collection order (``--no-loadscope-reorder``), so the long runs of the loop start early and the short
    tests fill in at the end, instead of one worker idling while the other finishes a long run."""
    for item in items:
        for name in set(item.fixturenames) & set(SHARED_GROUPS.values()):
            if SHARED_GROUPS.get(_module(item.nodeid)) != name:
                raise pytest.UsageError(f"{_module(item.nodeid)} uses the session fixture {name}: add it to "
                                        "SHARED_GROUPS in tests/conftest.py, so that xdist runs it beside the "
                                        "fixture's other users")
    slow = {_group(item.nodeid) for item in items if item.get_closest_marker("slow")}
    shared = set(SHARED_GROUPS.values())
    quiet = {_group(module) for module in QUIET_MODULES}
    # Stable: a file's tests stay together and in order. The quiet groups first, a shared one last among them (its
    # quiet files first in it: the other worker starts when they end, while the rest of that group runs); then the
    # shared groups (the longest), then the other slow ones.
    items.sort(key=lambda item: (_group(item.nodeid) not in quiet, _group(item.nodeid) in shared and
                                 _group(item.nodeid) in quiet, _group(item.nodeid) not in shared,
                                 _group(item.nodeid) not in slow, _module(item.nodeid) not in QUIET_MODULES))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to a pytest without it
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker (``_group``), and the tests of ``QUIET_MODULES`` alone on the machine. xdist's own
    ``loadgroup`` marks do not take under pytest 9, whose node ids no longer come from the attribute xdist
    rewrites, so the grouping is this scheduler's."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        quiet_node = None  # the worker running the quiet tests; the others get no work until they end

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

        def _quiet_left(self) -> bool:
            units = list(self.workqueue.values()) + [u for work in self.assigned_work.values() for u in work.values()]
            return any(not done and _module(nodeid) in QUIET_MODULES for u in units for nodeid, done in u.items())

        def _assign_work_unit(self, node) -> None:
            if self._quiet_left():
                if self.quiet_node is None:
                    self.quiet_node = node  # takes the first unit: the quiet group, collected first
                elif node is not self.quiet_node:
                    return  # held: the quiet tests run alone
            super()._assign_work_unit(node)

        def remove_node(self, node):
            """A worker that crashed: its test is reported failed and not run again (xdist's scope schedulers
            requeue it, and a test that kills its worker every time then leaves the session hanging). If it held
            the quiet tests, their requeued group goes first again and the next worker to ask takes it."""
            if node is self.quiet_node:
                self.quiet_node = None
            crashed = super().remove_node(node)  # requeues the node's unfinished groups, at the end
            for scope, unit in list(self.workqueue.items()):
                if crashed in unit:
                    unit[crashed] = True
                if any(_module(nodeid) in QUIET_MODULES for nodeid in unit):
                    self.workqueue.move_to_end(scope, last=False)
            return crashed

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            quiet_before = self._quiet_left()
            super().mark_test_complete(node, item_index, duration)
            if quiet_before and not self._quiet_left():  # the held workers start now
                for other in self.nodes:
                    if other is not node:  # two units, as xdist starts a worker: it runs a test once it has the next
                        self._reschedule(other)
                        self._reschedule(other)

    return GroupScheduling(config, log)
