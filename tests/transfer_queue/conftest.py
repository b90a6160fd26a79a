"""Fixtures: every test gets its own TransferQueue (random ports, private shared memory) and the
deployment is shut down, processes and shared memory included, even when the test fails."""

from __future__ import annotations

import os

import pytest

from asyncflow.transfer_queue import TransferQueueConfig, start
from asyncflow.transfer_queue.shm import SHM_DIR


def small_config(**overrides) -> TransferQueueConfig:
    """Small arenas and short timeouts so that failures show up in seconds."""
    values = dict(deployment="threads", storage_unit_capacity_bytes=64 << 20, rpc_timeout_s=10.0,
                  heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, get_timeout_s=30.0,
                  put_timeout_s=30.0)
    values.update(overrides)
    return TransferQueueConfig(**values)


@pytest.fixture
def make_tq():
    """Factory: start a deployment with config overrides; all are shut down at teardown."""
    started = []

    def make(**overrides):
        deployment = start(small_config(**overrides))
        started.append(deployment)
        return deployment

    yield make
    for deployment in started:
        deployment.shutdown()


@pytest.fixture
def tq():
    deployment = start(small_config())
    yield deployment
    deployment.shutdown()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(deployment.shm_prefix)]


@pytest.fixture
def client(tq):
    c = tq.client()
    yield c
    c.close()


@pytest.fixture
def tq_procs():
    deployment = start(small_config(deployment="processes"))
    yield deployment
    deployment.shutdown()
    assert all(p.poll() is not None for p in deployment.procs)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(deployment.shm_prefix)]
