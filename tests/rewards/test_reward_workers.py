"""Rewards in a whole run (fake engines): two reward workers share every step's rows, each row scored once, and a
verl-shaped reward gets each dataset row's data source and extra info through the TransferQueue."""

import json

import pytest

from tests.recipe_runs import GROUP, PROMPTS, SMALL, STEPS, records, run_fake


@pytest.mark.slow
def test_two_reward_workers_score_each_row_once_with_its_row_info(tmp_path, tiny_model_dir, shared_ray):
    rows = []
    for i in range(2 * PROMPTS):
        digits = f"{(i * 379) % 10000:04d}"
        answer = "".join(str((int(d) + 1) % 10) for d in digits)
        rows.append({"prompt": f"{digits}>", "ground_truth": answer, "data_source": "toy",
                     "extra_info": {"answer": answer}})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = run_fake(tmp_path, tiny_model_dir, "two", *SMALL, "workflow.task=jsonl", f"data.path={data}",
                   "data.apply_chat_template=false", "data.max_prompt_len=8", "reward.workers=2",
                   "algorithm.reward=tests.rewards.verl_rewards:compute_score")
    assert run["steps"] == STEPS
    # Every step's rows were scored, by one worker each (the counts add up to the step's rows, no more)...
    metrics = records(run)
    assert [m["reward/rows"] for m in metrics] == [PROMPTS * GROUP] * STEPS
    assert all(m["reward/failures"] == 0 for m in metrics)
    # ... each with its own row's data source and extra info.
    assert all(m["reward/extra/source_seen_mean"] == 1.0 and m["reward/extra/extra_seen_mean"] == 1.0
               for m in metrics)
    # Both workers scored rows (the timeline's score spans, by worker).
    trace = json.loads((run["_out"] / "timeline.json").read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    by_worker: dict[str, int] = {}
    for e in trace:
        if e["ph"] == "X" and e["cat"] == "reward" and e["name"] == "score":
            who = names[(e["pid"], e["tid"])]
            by_worker[who] = by_worker.get(who, 0) + e["args"]["rows"]
    assert sorted(by_worker) == ["reward/0", "reward/1"]
    assert all(n > 0 for n in by_worker.values()) and sum(by_worker.values()) == STEPS * PROMPTS * GROUP
