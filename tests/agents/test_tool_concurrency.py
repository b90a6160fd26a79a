"""Agent-loop calls run off the engine loop (``asyncflow.agents.calls``), with a deadline, and see the row's metadata.

- ``AgentCalls`` alone: a call that blocks does not hold back the others (plain ``observe`` on threads and
  ``async def observe`` on the event loop); a call past its deadline comes back timed out, is counted, and the
  workers go on serving (a blocked thread is replaced); exceptions come back as errors; ``ask=False`` calls
  only ``turn_reward``; the two settings are checked when the config loads.
- ``Trajectory``: the row's metadata (a plain answer, or verl's ground_truth/data_source/extra_info) and its
  decoded text.
- Through the rollout stream on the fake engines (the loop, the stream, the services and the TransferQueue are
  real): one trajectory's tool sleeps 2 s, every other trajectory of the step finishes all its turns before it
  returns; another trajectory's tool outlives ``agent.tool_timeout_s``, is cut off, counted in
  ``agent/tool_timeouts``, and the run goes on; every call saw its row's metadata and decoded text.
"""

import asyncio
import json
import threading

import pytest

from asyncflow.agents import AgentLoop, Trajectory, row_metadata
from asyncflow.agents.calls import AgentCalls
from tests.recipe_runs import SMALL, records, run_fake


def _traj(n: int, turns: int = 1, **kw) -> Trajectory:
    return Trajectory([1, 2], [n], [1], turns, "stop", **kw)


class _Blocking(AgentLoop):
    """Trajectory 0's call blocks until ``release`` is set; the others answer at once."""

    def __init__(self):
        self.release = threading.Event()
        self.seen: list[int] = []

    def turn_reward(self, trajectory) -> float:
        return 0.5

    def observe(self, trajectory):
        n = trajectory.response_ids[0]
        if n == 0:
            self.release.wait(30)
        if n == 13:
            raise ConnectionError("tool service down")
        self.seen.append(n)
        return [n, n]


class _AsyncBlocking(_Blocking):
    async def turn_reward(self, trajectory) -> float:
        return 0.5

    async def observe(self, trajectory):
        n = trajectory.response_ids[0]
        if n == 0:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if n == 13:
            raise ConnectionError("tool service down")
        self.seen.append(n)
        return [n, n]


def _collect(calls: AgentCalls, want: int) -> dict:
    got = {}
    while len(got) < want:
        got.update(calls.ready(wait_s=0.5))
    return got


@pytest.mark.parametrize("loop_cls", [_Blocking, _AsyncBlocking])
def test_a_blocked_call_does_not_hold_back_the_others(loop_cls):
    loop = loop_cls()
    calls = AgentCalls(loop, workers=2, timeout_s=60)
    assert calls.is_async == (loop_cls is _AsyncBlocking)
    try:
        for n in range(6):
            calls.submit(n, _traj(n))
        calls.submit(13, _traj(13))
        calls.submit(7, _traj(7), ask=False)  # at its last turn: only its turn reward
        got = _collect(calls, 7)  # every call but the blocked one, while it still blocks
        assert set(got) == {1, 2, 3, 4, 5, 7, 13} and len(calls) == 1 and not loop.release.is_set()
        assert all(got[n].observation == [n, n] and got[n].turn_reward == 0.5 for n in range(1, 6))
        assert got[7].observation is None and got[7].turn_reward == 0.5 and 7 not in loop.seen
        assert isinstance(got[13].error, ConnectionError) and got[13].turn_reward == 0.5
        loop.release.set()
        assert _collect(calls, 1)[0].observation == [0, 0]
        assert calls.timeouts == 0 and len(calls) == 0
    finally:
        loop.release.set()
        calls.close()


@pytest.mark.parametrize("loop_cls", [_Blocking, _AsyncBlocking])
def test_a_call_past_its_deadline_is_cut_off_and_the_workers_go_on(loop_cls):
    loop = loop_cls()
    calls = AgentCalls(loop, workers=1, timeout_s=0.5)
    try:
        calls.submit(0, _traj(0))  # blocks its only worker past the deadline
        got = _collect(calls, 1)
        assert got[0].timed_out and got[0].observation is None and calls.timeouts == 1 and len(calls) == 0
        # The blocked call still holds its thread (or coroutine): a fresh worker serves the next call.
        calls.submit(1, _traj(1))
        got = _collect(calls, 1)
        assert got[1].observation == [1, 1] and not got[1].timed_out and calls.timeouts == 1
    finally:
        loop.release.set()
        calls.close()


def test_metadata_and_text_reach_the_trajectory(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert row_metadata(None) == {}
    assert row_metadata("42") == {"ground_truth": "42"}
    verl = {"ground_truth": "42", "data_source": "gsm8k", "extra_info": {"index": 3}}
    assert row_metadata(verl) == verl
    assert row_metadata({"ground_truth": "7", "data_source": None, "extra_info": None}) == {"ground_truth": "7"}
    # An answer that is itself a dict (not the data source's wrapping) stays the ground truth.
    assert row_metadata({"x": 1}) == {"ground_truth": {"x": 1}}
    ids = [tok.convert_tokens_to_ids(c) for c in "12+3"]
    t = Trajectory(ids[:2], ids[2:], [1, 0], 1, "stop", metadata=verl, tokenizer=tok)
    assert (t.prompt_text.replace(" ", ""), t.response_text.replace(" ", "")) == ("12", "+3")
    assert t.metadata["extra_info"] == {"index": 3}
    with pytest.raises(ValueError, match="tokenizer"):
        _ = Trajectory(ids, [], [], 1, "stop").response_text

    class Seen(AgentLoop):
        def observe(self, trajectory):
            return [len(trajectory.metadata["data_source"])]

    calls = AgentCalls(Seen(), workers=1, timeout_s=60)
    try:
        calls.submit("k", t)
        assert _collect(calls, 1)["k"].observation == [len("gsm8k")]
    finally:
        calls.close()


def test_agent_call_settings_are_checked():
    from asyncflow.config import load_config
    from asyncflow.config_loader import ConfigError

    cfg = load_config(None, ["agent.loop=calculator", "agent.tool_workers=1", "agent.tool_timeout_s=0.5"])
    assert (cfg.agent.tool_workers, cfg.agent.tool_timeout_s) == (1, 0.5)
    with pytest.raises(ConfigError, match=r"agent.tool_workers=0 must be at least 1.*agent.tool_timeout_s=0.0 must"):
        load_config(None, ["agent.tool_workers=0", "agent.tool_timeout_s=0"])


def test_slow_tool_does_not_stall_the_others_and_a_hung_one_is_cut_off(tmp_path, tiny_model_dir, shared_ray):
    from tests.agents import slow_tool_loop as tool

    log = tmp_path / "tool_events.jsonl"
    tool.MetadataPrompts.log = str(log)
    turns, rows = 3, 8 * 4
    s = run_fake(tmp_path, tiny_model_dir, "slow_tool", *SMALL, "workflow.steps=1",
                 "workflow.task=tests.agents.slow_tool_loop:make_prompts",
                 "algorithm.reward=tests.agents.slow_tool_loop:make_reward", "algorithm.kl_coef=0",
                 "agent.loop=tests.agents.slow_tool_loop:make_loop", f"agent.max_turns={turns}",
                 "agent.tool_timeout_s=4", "rollout.max_new_tokens=8")
    assert s["steps"] == 1
    (r,) = records(s)
    assert r["rollout/rows"] == rows and r["agent/tool_timeouts"] == 1 and r["agent/errors"] == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names.count("slow_start") == names.count("slow_end") == names.count("hang_start") == 1
    slow_end = names.index("slow_end")
    # Every trajectory but the slow and the hung one ran all its turns while the slow tool was running.
    finished_before = [e for e in events[:slow_end] if e["event"] == "turn" and e["turns"] == turns]
    assert len(finished_before) == rows - 2, names
    # The slow trajectory went on after its tool returned and finished its turns; the hung one never did.
    assert any(e["event"] == "turn" and e["turns"] == turns for e in events[slow_end:])
    assert r["agent/turns_mean"] == pytest.approx(((rows - 1) * turns + 1) / rows)
    # Every call saw its row's metadata and the decoded text of the trajectory so far.
    turn_events = [e for e in events if e["event"] == "turn"]
    assert len(turn_events) == (rows - 1) * turns + 1
    for e in turn_events:
        assert e["metadata"]["data_source"] == tool.DATA_SOURCE and e["metadata"]["extra_info"]["log"] == str(log)
        assert e["metadata"]["ground_truth"] == str(e["metadata"]["extra_info"]["n"])
        assert len(e["response_ids"]) == 2 * e["turns"] - 1 and e["text"] and e["prompt_text"]
