"""Shared fixtures: a tiny Hugging Face model, one spawned vLLM process and the demo recipe's run, each made once per
session; the order of the suite's files; and the session-end check that no test left a shared-memory segment.

``make test`` runs two pytest-xdist workers with ``--dist loadfile``: a worker takes a whole file, so a session
fixture is made once per worker that runs one of its files. The costliest (``ONE_FILE_FIXTURES``) are used by one
file only, which keeps them to one build; ``vllm_child`` may be made once on each worker.
"""

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from tests.zygote import configure_environment as configure_fork_server

# Session fixtures too costly to build once per worker: each may be used by one test file only. xdist's own
# ``loadgroup`` marks cannot keep several files on one worker under pytest 9 (its worker renames ``item._nodeid``,
# which pytest 9 no longer reads), so files sharing such a fixture are merged instead.
ONE_FILE_FIXTURES = {"demo_run"}

SHM = Path("/dev/shm")
SLOW_S = 10.0  # a test over this (set-up included) is marked slow (or faults): make test-fast runs the others
_FAST_SECONDS: dict[str, float] = {}
FILE_SECONDS_KEY = "asyncflow/file_seconds"  # in pytest's cache (.pytest_cache): each file's seconds, last run
_FILE_SECONDS: dict[str, float] = {}
_SHM_BEFORE = pytest.StashKey[set]()
_SHM_LEFT = pytest.StashKey[list]()
_RAY_BEFORE = pytest.StashKey[set]()
RAY_ROOT = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"
"""Where a local Ray puts its session folders (logs, sockets; ``session_<date>_<pid>``) and leaves them (Ray's
``get_default_ray_temp_dir`` on Linux)."""

# Keep the 2-core CI machine responsive when several processes compute at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray workers of the in-process runs find the repository's test modules (engines and agent loops named by dotted
# path). Set here, before any Ray thread exists: a setenv while one reads the environment can crash it.
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))
# The shared Ray's workers are forked from a server that imported what they need (tests/zygote): its socket's path.
configure_fork_server()


@pytest.fixture(autouse=True)
def _restore_environment():
    """Undo what a test sets in this process's environment (an in-process vLLM engine sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, for one), so that runs started by later tests do not inherit it."""
    saved = dict(os.environ)
    yield
    # Only the keys that changed: each change is a setenv or unsetenv, which can crash a thread of this process's
    # Ray (its C++ core reads the environment with getenv) that reads it at that instant; clearing and refilling
    # the whole environment after every test made that race likely enough to SIGSEGV a worker.
    for key in [key for key in os.environ if key not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 model (vocab 19, hidden 64, 2 layers, head_dim 32) with its tokenizer."""
    from asyncflow.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", seed=0)


@pytest.fixture(scope="session")
def vllm_child():
    """One spawned process, for the session, for the tests that drive an in-process vLLM engine (each test's
    function builds and closes its own engine there): vLLM's import is paid once per worker instead of per test
    file, and its process-wide settings never reach pytest's own process. Forked from the tests' real-stack server
    (``tests.zygote.spawned_from_server``), which imported vLLM already: a fresh process took about 15 s on 2 cores."""
    from tests.zygote import spawned_from_server

    with spawned_from_server():
        pool = mp.get_context("spawn").Pool(1)
    with pool:
        yield pool


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo recipe's async GRPO run (its own sizes, 32 prompts x 8 samples), 70 steps; made once and read
    by the end-to-end checks. Its summary, with ``_out``."""
    from tests.recipe_runs import LEARN_STEPS, run_recipe

    return run_recipe(tmp_path_factory.mktemp("demo_run"), "async", 1, "async",
                      sizes=[f"workflow.steps={LEARN_STEPS}"])


_SHARED_RAY = None  # this process's SharedRay, once a test asked for it


@pytest.fixture(scope="session")
def shared_ray():
    """The process's one local Ray for the in-process fake runs (``tests.recipe_runs.SharedRay``); shut down
    before a test that does not use it (such a test may start a Ray of its own), started again on next use."""
    global _SHARED_RAY
    from tests.recipe_runs import SharedRay

    _SHARED_RAY = SharedRay()
    _SHARED_RAY.up()
    yield _SHARED_RAY
    _SHARED_RAY.close()


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: a module fixture may start its own Ray
def pytest_runtest_setup(item):
    if _SHARED_RAY is None:
        return
    if "shared_ray" in item.fixturenames:
        _SHARED_RAY.up()
    else:
        _SHARED_RAY.down()


def _file(item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after `-m` deselected: the order is that of the tests that run
def pytest_collection_modifyitems(config, items):
    """Check ``ONE_FILE_FIXTURES``, then put the files that hold a slow test first, the longest of the last run
    first among them where pytest's cache has their times (stable: a file's tests stay together and in order).
    ``make test`` passes ``--no-loadscope-reorder``, so xdist hands out files in this order: the long runs of the
    loop start early and the short files fill in at the end, instead of one worker idling while the other
    finishes a long run."""
    users: dict[str, set[str]] = {}
    for item in items:
        for name in ONE_FILE_FIXTURES & set(item.fixturenames):
            users.setdefault(name, set()).add(_file(item))
    for name, files in users.items():
        if len(files) > 1:
            raise pytest.UsageError(f"the session fixture {name} is used by {sorted(files)}: it is built once per "
                                    "xdist worker that runs one of them, so keep its tests in one file "
                                    "(ONE_FILE_FIXTURES in tests/conftest.py)")
    slow = {_file(item) for item in items if item.get_closest_marker("slow")}
    # Where the cache has no times (a fresh clone), the files that run the loop on fake engines (each run starts
    # its services: seconds, not milliseconds) go before the unit tests, which fill in at the end.
    loop = {_file(item) for item in items if "shared_ray" in item.fixturenames or item.get_closest_marker("loop")}
    cache = getattr(config, "cache", None)
    seconds = cache.get(FILE_SECONDS_KEY, {}) if cache is not None else {}
    items.sort(key=lambda item: (_file(item) not in slow, -seconds.get(_file(item), 0.0), _file(item) not in loop))


# The shared-memory check. It runs in the process that holds the session (the xdist controller, or pytest itself
# without xdist): workers and the runs they start come and go inside it.


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput")


def _held_paths() -> set[str]:
    """The paths live processes map, hold open or run in (their ``maps``, ``fd`` and ``cwd`` under /proc; a file
    unlinked while held keeps its name)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone, or not ours to read
            continue
        mapped = (fields[5] for fields in (line.split(None, 5) for line in maps.splitlines()) if len(fields) == 6)
        held.update(path.removesuffix(" (deleted)") for path in (*mapped, *fds, cwd))
    return held


def _in_use() -> set[str]:
    """Names under /dev/shm that a live process maps or holds open (a segment of a run that is still stopping, or
    of another session on the same machine: not left behind, or not this session's)."""
    return {path[len("/dev/shm/"):] for path in _held_paths() if path.startswith("/dev/shm/")}


def left_in_shm(before: set[str], wait_s: float = 10.0) -> list[str]:
    """Entries of /dev/shm that are not in ``before`` and that no live process uses, after up to ``wait_s`` for
    processes still exiting to remove theirs."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(set(os.listdir(SHM)) - before - _in_use())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def _ray_sessions(root: Path = RAY_ROOT) -> set[str]:
    try:
        return {name for name in os.listdir(root) if name.startswith("session_") and name != "session_latest"}
    except FileNotFoundError:
        return set()


def remove_ray_sessions(before: set[str], root: Path = RAY_ROOT) -> list[str]:
    """Remove the session folders of ``root`` that are not in ``before`` and in which no live process holds a
    file open or runs (those of this test session's local Ray instances, about 0.5 MB each: a suite run left
    hundreds); returns their names. A folder in use (another Ray on the machine) stays."""
    import shutil

    busy = {Path(path).relative_to(root).parts[0] for path in _held_paths() if path.startswith(f"{root}/session_")}
    removed = sorted(_ray_sessions(root) - before - busy)
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    latest = root / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink(missing_ok=True)
    return removed


def pytest_sessionstart(session):
    if _is_controller(session.config):
        session.config.stash[_RAY_BEFORE] = _ray_sessions()
    if _is_controller(session.config) and SHM.is_dir():
        session.config.stash[_SHM_BEFORE] = set(os.listdir(SHM))


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown (pytest's runner does it in this hook)
def pytest_sessionfinish(session, exitstatus):
    """Record each file's seconds in pytest's cache (the next run's order); fail the session when a segment made
    during it is left in /dev/shm (psm_*, vllm_dist_*, sem.mp-*, a TransferQueue arena or a weight staging
    segment that a killed process never unlinked). Stop this process's fork servers (tests.zygote). Remove the Ray
    session folders the session's local Ray instances left (``remove_ray_sessions``)."""
    from tests.zygote import stop_session_servers

    stop_session_servers()
    cache = getattr(session.config, "cache", None)
    if cache is not None and _FILE_SECONDS and _is_controller(session.config):
        cache.set(FILE_SECONDS_KEY, {**cache.get(FILE_SECONDS_KEY, {}), **_FILE_SECONDS})
    ray_before = session.config.stash.get(_RAY_BEFORE, None)
    if ray_before is not None:
        remove_ray_sessions(ray_before)
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    left = left_in_shm(before)
    session.config.stash[_SHM_LEFT] = left
    if left and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_logreport(report):
    """Each test's set-up, call and teardown seconds, summed per file for the next run's order and kept for the
    summary of unmarked tests over ``SLOW_S`` (on the controller: xdist forwards the workers' reports)."""
    file = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[file] = _FILE_SECONDS.get(file, 0.0) + report.duration
    if "slow" not in report.keywords and "faults" not in report.keywords:  # what make test-fast runs
        _FAST_SECONDS[report.nodeid] = _FAST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = {nodeid: s for nodeid, s in _FAST_SECONDS.items() if s > SLOW_S}
    if over:
        terminalreporter.section(f"tests not marked slow that took over {SLOW_S:g} s (mark them slow, or make "
                                 "them faster)", sep="-", yellow=True)
        for nodeid, seconds in sorted(over.items(), key=lambda kv: -kv[1]):
            terminalreporter.line(f"{seconds:7.1f} s  {nodeid}")
    left = config.stash.get(_SHM_LEFT, [])
    if left:
        terminalreporter.section("shared memory left behind", sep="=", red=True, bold=True)
        terminalreporter.line(f"{len(left)} segment(s) made during this session are still in /dev/shm and no "
                              f"process uses them (the suite fails):")
        for name in left:
            terminalreporter.line(f"  /dev/shm/{name}")

