"""Shared fixtures: a tiny Hugging Face model made locally once per session."""

import os
from pathlib import Path

import pytest

# Keep the 2-core CI machine responsive when several processes compute at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent
SERIAL = ("transfer_queue", "simulator/test_calibration.py")
"""Tests that must not share the machine with another test (marked ``serial`` here, besides any marked by hand):
the TransferQueue's leases and heartbeats run out in 0.2-5 s, and the calibration test measures a run against
the costs it profiled. ``make test`` runs every other test on two workers (``--phase parallel``), then these
alone (``--phase serial``)."""


def pytest_addoption(parser):
    parser.addoption("--phase", choices=("all", "parallel", "serial"), default="all",
                     help="all tests (default); only those not marked serial (for pytest-xdist); only the serial ones")


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        if any(rel == p or rel.startswith(p + "/") for p in SERIAL):
            item.add_marker(pytest.mark.serial)
    phase = config.getoption("--phase")
    if phase == "all":
        return
    keep = [item for item in items if (item.get_closest_marker("serial") is not None) == (phase == "serial")]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


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
