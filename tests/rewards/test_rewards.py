"""Reward functions: the built-in add1 reward, the dotted-path contract, and isolation of failures."""

import pytest

from asyncflow.rewards import REWARD_FUNCTIONS, make_reward_fn
from asyncflow.tiny_model import build_tokenizer


def flaky_reward_factory(tokenizer):
    """A user reward factory: ``fn(prompt_ids, response_ids) -> float``; raises on empty responses."""

    def fn(prompt_ids, response_ids):
        if not response_ids:
            raise ValueError("empty response")
        return float(len(response_ids) == 4)

    return fn


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("add1")


def test_add1_reward(tok):
    fn = make_reward_fn("add1", tok)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = [tok.bos_token_id, *ids("3648>")]
    assert fn(prompt, ids("4759")) == 1.0
    assert fn(prompt, ids("4750")) == 0.75
    assert fn(prompt, ids("47") + [tok.eos_token_id]) == 0.5
    assert fn(prompt, []) == 0.0


def test_user_reward_by_dotted_path_contract(tok):
    fn = make_reward_fn("tests.rewards.test_rewards:flaky_reward_factory", tok)
    assert fn([1], [5, 6, 7, 8]) == 1.0 and fn([1], [5]) == 0.0
    assert "add1" in REWARD_FUNCTIONS.names()


def test_raising_reward_is_isolated(tok):
    from asyncflow.rewards import RewardRow, RewardScorer

    scorer = RewardScorer(make_reward_fn("tests.rewards.test_rewards:flaky_reward_factory", tok), tok,
                          reward_on_error=-1.0)
    good, bad = scorer.score([RewardRow([1], [5, 6, 7, 8]), RewardRow([1], [])])
    assert (good.reward, good.error) == (1.0, None)
    assert (bad.reward, bad.error) == (-1.0, "ValueError: empty response")
