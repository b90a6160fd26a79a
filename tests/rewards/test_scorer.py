"""Reward functions in the shapes users bring: verl's signature (per row and batched), dict rewards, batched
token-id functions (decorator or config flag), ``async def`` rewards under a concurrency limit, user files."""

import asyncio

import pytest

from asyncflow.registry import RegistryError
from asyncflow.rewards import RewardConfig, RewardRow, RewardScorer, batched, make_reward_fn
from asyncflow.rewards.registry import absolute_spec
from asyncflow.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ascii")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def rows(tok, responses, truths=None, sources=None, extras=None):
    """Rows as the reward task builds them from the TransferQueue (dataset rows with data source and extra info)."""
    n = len(responses)
    truths, sources, extras = truths or [None] * n, sources or [None] * n, extras or [None] * n
    return [RewardRow.of(ids(tok, "Q"), ids(tok, r), {"ground_truth": t, "data_source": s, "extra_info": e})
            for r, t, s, e in zip(responses, truths, sources, extras)]


# ---- user reward functions, written as their authors write them -------------------------------------------------

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: a float, or a dict with "score" and more."""
    if data_source == "dict":
        return {"score": float(solution_str == ground_truth), "length": len(solution_str), "note": "text is dropped"}
    if solution_str == "boom":
        raise RuntimeError("bad response")
    return float(solution_str == ground_truth) + extra_info.get("bonus", 0.0)


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batched signature (BatchRewardManager)."""
    return [float(s == g) * (2.0 if d == "double" else 1.0) for d, s, g in zip(data_sources, solution_strs,
                                                                               ground_truths)]


@batched
def length_batch(prompt_ids, response_ids, ground_truth):
    """A batched token-id reward by decorator."""
    assert isinstance(ground_truth, list)
    return [float(len(r)) for r in response_ids]


def length_lists(prompt_ids, response_ids, **info):
    """A batched token-id reward by config flag (``reward.batched``)."""
    return [float(len(r)) + len(s) for r, s in zip(response_ids, info["data_source"])]


def strict_tokens(prompt_ids, response_ids, ground_truth=None):
    """A token-id reward that takes no data_source: it must not be given one."""
    return float(len(response_ids))


IN_FLIGHT = {"now": 0, "max": 0, "order": []}


async def slow_judge(data_source, solution_str, ground_truth, extra_info=None):
    """An ``async def`` verl-shaped reward (an LLM judge, say): it waits, counting calls in flight."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    await asyncio.sleep(0.05 if solution_str == "slow" else 0.0)
    IN_FLIGHT["order"].append(solution_str)
    IN_FLIGHT["now"] -= 1
    if solution_str == "bad":
        raise ValueError("judge refused")
    return float(solution_str == ground_truth)


# ---- tests ----------------------------------------------------------------------------------------------------

def test_verl_signature_taken_as_is_by_dotted_path(tok):
    fn = make_reward_fn("tests.rewards.test_scorer:compute_score", tok)
    assert fn is compute_score  # the function itself, not a factory
    scorer = RewardScorer(fn, tok, reward_on_error=-1.0)
    assert scorer.shape == "verl" and not scorer.batched
    out = scorer.score(rows(tok, ["42", "41", "boom", "7"], ["42", "42", "42", "7"], ["gsm8k", "gsm8k", "x", "dict"],
                            [{"bonus": 0.5}, {}, {}, None]))
    assert [s.reward for s in out] == [1.5, 0.0, -1.0, 1.0]
    assert out[2].error == "RuntimeError: bad response" and out[0].error is None
    assert out[3].metrics == {"length": 1.0}  # numbers only: the string is not a metric


def test_verl_batched_signature_and_length_check(tok):
    scorer = RewardScorer(make_reward_fn("tests.rewards.test_scorer:compute_score_batch", tok), tok)
    assert scorer.batched
    out = scorer.score(rows(tok, ["1", "2", "3"], ["1", "2", "0"], ["a", "double", "a"]))
    assert [s.reward for s in out] == [1.0, 2.0, 0.0]

    def short(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    out = RewardScorer(short, tok, reward_on_error=-2.0).score(rows(tok, ["1", "2"]))
    assert [s.reward for s in out] == [-2.0, -2.0]
    assert out[0].error == "ValueError: the batched reward returned 1 rewards for 2 rows"


def test_batched_token_rewards_by_decorator_or_config(tok):
    out = RewardScorer(length_batch, tok).score(rows(tok, ["ab", "abcd"], ["x", "y"]))
    assert [s.reward for s in out] == [2.0, 4.0]
    unflagged = RewardScorer(length_lists, tok)
    assert not unflagged.batched
    flagged = RewardScorer(length_lists, tok, RewardConfig(batched=True))
    assert [s.reward for s in flagged.score(rows(tok, ["ab", "abc"], sources=["src", "s"]))] == [5.0, 4.0]


def test_token_rewards_get_only_the_info_they_accept(tok):
    scorer = RewardScorer(strict_tokens, tok)
    out = scorer.score(rows(tok, ["abc"], ["1"], ["gsm8k"], [{"k": 1}]))
    assert (out[0].reward, out[0].error) == (3.0, None)
    # A source without answers gives no info at all.
    assert scorer.score([RewardRow.of([1], [2, 3], None, has_answer=False)])[0].reward == 2.0


def test_async_rewards_run_concurrently_within_the_limit(tok):
    IN_FLIGHT.update(now=0, max=0, order=[])
    scorer = RewardScorer(slow_judge, tok, RewardConfig(max_concurrency=3), reward_on_error=-1.0)
    assert scorer.is_async
    responses = ["slow", "1", "2", "bad", "4", "5", "6", "7"]
    out = scorer.score(rows(tok, responses, ["slow", "1", "0", "x", "4", "5", "6", "7"]))
    assert [s.reward for s in out] == [1.0, 1.0, 0.0, -1.0, 1.0, 1.0, 1.0, 1.0]
    assert out[3].error == "ValueError: judge refused"
    assert IN_FLIGHT["max"] == 3  # overlapped, and never more than reward.max_concurrency
    assert IN_FLIGHT["order"].index("slow") > IN_FLIGHT["order"].index("2")  # the slow call did not hold the others
    # The scorer's loop lives on: a second chunk is scored the same way.
    assert [s.reward for s in scorer.score(rows(tok, ["1"], ["1"]))] == [1.0]
    scorer.close()


def test_user_reward_file_like_verls_custom_reward_function(tok, tmp_path, monkeypatch):
    file = tmp_path / "my_reward.py"
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 2.0 if solution_str.strip() == ground_truth else 0.0\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("my_reward.py:compute_score") == f"{file}:compute_score"
    assert absolute_spec("math") == "math"
    fn = make_reward_fn(absolute_spec("my_reward.py:compute_score"), tok)
    assert [s.reward for s in RewardScorer(fn, tok).score(rows(tok, ["9", "8"], ["9", "9"]))] == [2.0, 0.0]
    with pytest.raises(RegistryError, match="has no 'score'"):
        make_reward_fn(f"{file}:score", tok)
    with pytest.raises(RegistryError, match="not found"):
        make_reward_fn("missing.py:compute_score", tok)


def cfg_factory(tokenizer, cfg):
    """A factory that asks for the ``reward`` section."""
    return lambda prompt_ids, response_ids: float(cfg.max_concurrency)


def test_factory_receives_the_reward_section_when_it_asks(tok):
    fn = make_reward_fn("tests.rewards.test_scorer:cfg_factory", tok, RewardConfig(max_concurrency=7))
    assert fn([1], [2]) == 7.0


@batched
async def judge_batch(prompt_ids, response_ids, **info):
    """A batched ``async def`` reward (one request per chunk to a judge, say)."""
    await asyncio.sleep(0)
    return [{"score": float(len(r)), "rows_in_call": float(len(response_ids))} for r in response_ids]


def test_batched_async_reward_is_awaited_once_per_chunk(tok):
    scorer = RewardScorer(judge_batch, tok)
    assert scorer.batched and scorer.is_async
    out = scorer.score(rows(tok, ["a", "abc", "ab"]))
    assert [(s.reward, s.metrics) for s in out] == [(1.0, {"rows_in_call": 3.0}), (3.0, {"rows_in_call": 3.0}),
                                                    (2.0, {"rows_in_call": 3.0})]
    scorer.close()
