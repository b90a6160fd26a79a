"""A rollout instance of the sample stream that dies while its multi-turn trajectories wait for their tool calls
(``tests.workflow.stream_tool_loop.SlowTools``: every call takes a while, so an instance always holds groups whose
trajectories are out of the engine): the supervisor starts it again, the ledger forgets what it held
(``StreamLedger.forget``) and the prompts of its groups go back to the stream, so every prompt is still trained once,
whole, within the staleness bound per token."""

import pytest

from tests.recipe_runs import GROUP, PROMPTS, SMALL, check_stream, records, run_fake
from tests.workflow.stream_tool_loop import waiting_pids
from tests.workflow.test_restart import Killer

pytestmark = [pytest.mark.loop, pytest.mark.faults]

STEPS = 6
# Two groups in each engine at a time (a group is admitted into free slots; a trajectory waiting for its tool frees
# its slot), so both instances hold groups and reservations when one is killed.
RUN = [*SMALL, "workflow.mode=stream", f"workflow.steps={STEPS}", "workflow.rollout_instances=2",
       "rollout.max_num_seqs=8", "workflow.task=calc", "algorithm.reward=calc", "rollout.max_new_tokens=12",
       "rollout.max_model_len=32",
       "agent.loop=tests.workflow.stream_tool_loop:make_slow_loop", "agent.max_turns=3", "algorithm.kl_coef=0",
       "transfer_queue.put_lease_s=20", "transfer_queue.row_lease_s=20"]


class ToolWaitKiller(Killer):
    """Kills a rollout instance that has a tool call waiting at that moment (``SlowTools`` marks each wait), so the
    instance killed holds rows whatever the machine's load (by pid order alone, an instance that had just handed
    in its groups could be the one)."""

    def __init__(self, out, model_dir):
        super().__init__(out, "rollout", [2])
        self.model_dir = model_dir

    def _pid(self) -> int | None:
        waiting = [pid for pid in self._alive() if pid in waiting_pids(self.model_dir)]
        return waiting[0] if waiting else None


def test_a_stream_instance_killed_while_its_trajectories_wait_for_tools_gives_their_prompts_back(
        tmp_path, tiny_model_dir, shared_ray):
    out = tmp_path / "tools"
    killer = ToolWaitKiller(out, tiny_model_dir)
    killer.start()
    try:
        summary = run_fake(tmp_path, tiny_model_dir, "tools", *RUN)
    finally:
        killer.stop = True
        killer.join(10)
    assert len(killer.killed) == 1, "the run ended before the kill"
    check_stream(summary, 1, STEPS, PROMPTS, GROUP)
    for m in records(summary):
        assert 0 <= m["staleness/token_lag_min"] <= m["staleness/token_lag_max"] <= 1, m
        assert m["agent/observations"] > 0 and m["agent/errors"] == m["agent/tool_timeouts"] == 0, m
    deaths = [e for e in summary["service_restarts"] if e["service"] == "rollout" and str(e["restart"]) == "1"]
    assert len(deaths) == 1 and deaths[0]["released_rows"] > 0, summary["service_restarts"]
