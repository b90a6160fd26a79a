"""The ``reward`` section's cross-key rules: counts at least 1, and what ``remote`` and ``classifier`` need."""

from asyncflow.config import AsyncFlowConfig, replace
from asyncflow.config_rules import problems


def test_reward_section_rules():
    cfg = AsyncFlowConfig()
    assert problems(cfg) == []
    bad = replace(cfg, reward=replace(cfg.reward, workers=0, retries=-1),
                  algorithm=replace(cfg.algorithm, reward="remote"))
    found = problems(bad)
    assert "reward.workers=0 must be at least 1" in found
    assert any(p.startswith("reward.retries=-1") for p in found)
    assert "algorithm.reward=remote needs reward.url (the HTTP endpoint that scores the rows)" in found
    classifier = replace(cfg, algorithm=replace(cfg.algorithm, reward="classifier"))
    assert problems(classifier) == ["algorithm.reward=classifier needs reward.model_path (an HF "
                                    "sequence-classification folder)"]


def test_a_reward_file_is_checked_before_the_run(tmp_path):
    from asyncflow.cli import _check_plugins

    cfg = AsyncFlowConfig()
    missing = replace(cfg, algorithm=replace(cfg.algorithm, reward=f"{tmp_path}/nope.py:compute_score"))
    [problem] = _check_plugins(missing)
    assert problem.startswith(f"algorithm.reward={tmp_path}/nope.py:compute_score: reward file "
                              f"'{tmp_path}/nope.py' not found")
    (tmp_path / "mine.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    return 1.0\n")
    assert _check_plugins(replace(cfg, algorithm=replace(cfg.algorithm, reward=f"{tmp_path}/mine.py:compute_score"))) \
        == []
