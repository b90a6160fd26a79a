"""Fixtures of the workflow tests that run on a TransferQueue alone (no run, no Ray)."""

import pytest

from asyncflow.transfer_queue import TransferQueueConfig, start


@pytest.fixture
def tq():
    """A TransferQueue in this process (threads deployment), stopped after the test."""
    deployment = start(TransferQueueConfig(deployment="threads", storage_unit_capacity_bytes=16 << 20,
                                           get_timeout_s=10.0, put_timeout_s=10.0))
    yield deployment
    deployment.shutdown()
