"""The ``math`` reward (math-verify): final-answer extraction, equivalence, failures."""

import sys
import threading

import pytest

from asyncflow.rewards import REWARD_FUNCTIONS, make_reward_fn
from asyncflow.rewards.math import last_boxed
from asyncflow.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ascii")


@pytest.fixture(scope="module")
def score(tok):
    """``score(response_text, ground_truth)`` through the registered reward, with an eos token appended."""
    fn = make_reward_fn("math", tok)
    prompt = tok("What is it?")["input_ids"]
    return lambda text, truth: fn(prompt, tok(text)["input_ids"] + [tok.eos_token_id], ground_truth=truth)


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("so the result is \\boxed{42}", "42", 1.0),
        ("the answer is 3/4", "0.75", 1.0),
        ("the answer is 3/4", "\\frac{3}{4}", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("first 5, then 7", "7", 1.0),  # no box: the last number
        ("\\boxed{7} and some 9 after it", "7", 1.0),  # a box wins over later numbers
        ("\\boxed{1} no, wait: \\boxed{2}", "2", 1.0),  # the last box is the answer
        ("\\boxed{1} no, wait: \\boxed{2}", "1", 0.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{x^2+1}", "1 + x^2", 1.0),
        ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
        ("\\boxed{2}", "(1, 2)", 0.0),
        ("the answer is 42", 42, 1.0),  # numeric ground truth
        ("\\boxed{41}", "42", 0.0),
        ("the answer is 3/5", "0.75", 0.0),
        ("I do not know", "42", 0.0),
        ("}}{{\\boxed{", "1", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_reward_cases(score, response, truth, reward):
    assert score(response, truth) == reward


def test_missing_ground_truth_raises(tok, score):
    fn = make_reward_fn("math", tok)
    with pytest.raises(ValueError, match="needs a reference answer"):
        fn([1], tok("\\boxed{1}")["input_ids"])
    with pytest.raises(ValueError, match="needs a reference answer"):
        fn([1], tok("\\boxed{1}")["input_ids"], ground_truth=None)


def test_special_tokens_are_skipped(tok):
    fn = make_reward_fn("math", tok)
    response = [tok.bos_token_id, *tok("\\boxed{12}")["input_ids"], tok.eos_token_id, tok.pad_token_id]
    assert fn([1], response, ground_truth="12") == 1.0


def test_runs_outside_the_main_thread(score):
    """math-verify's timeouts use SIGALRM, which only the main thread may set: a reward task that scores
    in a worker thread must still work."""
    results = []
    worker = threading.Thread(target=lambda: results.append(score("\\boxed{3/4}", "0.75")))
    worker.start()
    worker.join()
    assert results == [1.0]


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed("\\fbox{7}") == "\\boxed{7}"
    assert last_boxed("x \\boxed{3} y \\boxed{4") == "\\boxed{3}"  # a truncated box does not count
    assert last_boxed("no box") is None


def test_registered_without_importing_math_verify_early():
    assert "math" in REWARD_FUNCTIONS.names()
    import subprocess

    code = "import sys, asyncflow.rewards; print('math_verify' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_clear_error_when_math_verify_is_missing(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match="needs the math-verify package"):
        make_reward_fn("math", tok)
