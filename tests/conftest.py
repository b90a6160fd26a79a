"""Shared fixtures: a tiny Hugging Face model made locally once per session."""

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
