"""Shared fixtures: a tiny Hugging Face model, one spawned vLLM process and the demo recipe's run, each made once per
session."""

import multiprocessing as mp
import os

import pytest

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
