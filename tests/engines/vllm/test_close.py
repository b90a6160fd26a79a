"""Closing a vLLM engine at TP2 leaves nothing in /dev/shm, even when vLLM has to kill its workers.

The CPU tensor-parallel communicator's segments are unlinked by a destructor that runs only when a worker exits
normally; workers too slow to exit (an overloaded host) are killed by vLLM's shutdown. Here the workers are frozen
(SIGSTOP) before ``close()``, so vLLM kills them, and ``close()`` must remove what they left. The engine runs in a
spawned process of its own (not daemonic: vLLM's TP workers are its children).
"""

import json
import multiprocessing as mp
import os
import signal

import pytest

pytestmark = pytest.mark.slow


def _engine(model_dir: str, conn) -> None:
    from asyncflow.config import VllmConfig
    from asyncflow.engines.vllm import rollout as vllm_rollout

    rollout = vllm_rollout.VllmRollout(VllmConfig(tensor_parallel=2, max_model_len=64, max_num_seqs=4), model_dir)
    segments = sorted(vllm_rollout._worker_segments(rollout._worker_pids))
    workers = [pid for pid in rollout._worker_pids if any(s in vllm_rollout._mapped_segments([pid]) for s in segments)]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # they cannot exit now: vLLM's shutdown kills them
    try:
        rollout.close()
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    conn.send(json.dumps({"segments": segments, "workers": len(workers),
                          "left": [s for s in segments if os.path.exists(s)]}))


def test_close_removes_the_segments_of_workers_vllm_had_to_kill(tiny_model_dir):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(str(tiny_model_dir), child))
    proc.start()
    child.close()  # the engine process holds the only other end: if it dies, recv() ends at once (EOFError)
    try:
        assert parent.poll(600), "the engine process never answered"
        try:
            out = json.loads(parent.recv())
        except EOFError:
            proc.join(60)
            raise AssertionError(f"the engine process died before it answered (exit {proc.exitcode})") from None
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert len(out["segments"]) == 2 and all("-cpushm_" in s for s in out["segments"]), out
    assert out["workers"] == 2, out
    assert out["left"] == [], out
