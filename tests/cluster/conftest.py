"""The two-host cluster (``tools/two_host.py``) as a session fixture for the tests of this folder.

Host B is a network namespace with a private /dev/shm and its own hostname; both hosts run a Ray node declaring
2 ``NPU``. Making namespaces needs root: without it the tests fail with the reason when ``CI`` is set (CI runs as
root, so a skip there would hide that the cross-host tests never ran) and skip with the reason otherwise.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_two_host():
    """``tools/two_host.py`` as a module (``tools/`` is not a package)."""
    if "two_host" not in sys.modules:
        spec = importlib.util.spec_from_file_location("two_host", REPO / "tools/two_host.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["two_host"] = module
        spec.loader.exec_module(module)
    return sys.modules["two_host"]


@pytest.fixture(scope="session")
def two_hosts():
    """A running two-host Ray cluster (``two_host.TwoHost``), removed at the end of the session.

    Pass ``cluster.env()`` to processes that join it (``asyncflow train ... ray.address=<cluster.address>``).
    """
    two_host = load_two_host()
    try:
        cluster = two_host.up()
    except two_host.TwoHostError as exc:
        message = f"the two-host cluster cannot be made here: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield cluster
    finally:
        two_host.down(cluster)
