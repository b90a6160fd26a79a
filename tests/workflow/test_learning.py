"""DAPO's dynamic sampling in both modes, on the fake engines (the sampling is the loop's: the advantage task
judges groups, drops the flat ones and the driver tops the step up; the engines only make the rows).

GRPO's learning is checked on the fake runs of ``test_loop`` and on the real demo run of ``test_e2e``, PPO's
(with a critic) on the run that ``test_resume`` kills and resumes.
"""

import pytest

from tests.recipe_runs import records, run_fake


@pytest.mark.parametrize("mode, steps", [("async", 6), ("sync", 3)])
def test_dapo_dynamic_sampling_trains_only_groups_with_signal(tmp_path, tiny_model_dir, shared_ray, mode, steps):
    summary = run_fake(tmp_path, tiny_model_dir, "run", f"workflow.mode={mode}", f"workflow.steps={steps}",
                       recipe="dapo_async.yaml")
    metrics = records(summary)
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert m["actor/rows"] == 256 and m["sampling/kept_rows"] == 256  # the step is full ...
        assert m["actor/flat_groups"] == 0  # ... with groups that carry signal only
        assert 0 < m["actor/entropy"] < 3.0  # entropy bonus on: log(19) = 2.94 is the maximum
        assert 0 < m["sampling/kept_reward_mean"] < 1  # every kept group mixes rewards (0..1 on add-one)
    assert sum(m["sampling/judged_rows"] for m in metrics) > steps * 256  # groups were dropped and topped up
    max_prompts = 4 * 32  # algorithm.max_sampling_factor x prompts_per_step: each step's own id range
    for step, ids in summary["trained_groups"].items():
        step = int(step)
        assert len(set(ids)) == 32 and all(step * max_prompts <= i < (step + 1) * max_prompts for i in ids)
