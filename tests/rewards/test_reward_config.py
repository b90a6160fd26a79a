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
