"""The ``math`` reward: the response's final answer checked against the reference with math-verify.

The final answer is the response's last ``\\boxed{...}`` if it has one, else its last number or
expression (``the answer is 3/4``); math-verify compares it with the reference symbolically, so
``\\frac{3}{4}``, ``3/4`` and ``0.75`` are the same answer. The reward is 1.0 for a match and 0.0
otherwise, including a response with no answer in it.
"""

from __future__ import annotations

import functools
import threading

from asyncflow.rewards.registry import RewardFn

TIMEOUT_S = 5
"""math-verify's limit on parsing or comparing one expression (it uses SIGALRM: main thread only)."""


def last_boxed(text: str) -> str | None:
    """The last complete ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced, or None.

    Only the last one counts: math-verify would read several as a set, but a model that boxes twice has
    usually revised its answer. An unclosed box (a truncated response) is skipped."""
    opens = sorted((i + len(marker) - 1 for marker in ("\\boxed{", "\\fbox{") for i in _find_all(text, marker)),
                   reverse=True)
    for open_ in opens:
        depth = 0
        for end in range(open_, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return "\\boxed" + text[open_ : end + 1]
    return None


def _find_all(text: str, marker: str) -> list[int]:
    """Start indexes of every occurrence of ``marker`` in ``text``."""
    found, i = [], text.find(marker)
    while i >= 0:
        found.append(i)
        i = text.find(marker, i + 1)
    return found


def _as_final_answer(ground_truth: str) -> str:
    """The reference as math-verify extracts it best: boxed, since the whole string is the answer
    (unboxed, ``(1, 2)`` would parse as its last number ``2``)."""
    if "\\boxed" in ground_truth or "$" in ground_truth:
        return ground_truth
    return f"\\boxed{{{ground_truth}}}"


def make_math_reward(tokenizer, timeout_s: int | None = TIMEOUT_S) -> RewardFn:
    """``fn(prompt_ids, response_ids, ground_truth=...) -> 1.0 | 0.0``: the response (decoded, special
    tokens skipped) has the reference's answer. A missing reference raises ValueError (the workflow
    records the failure and goes on); so does a reference math-verify cannot parse."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError("the 'math' reward needs the math-verify package: pip install math-verify") from exc

    def timeout() -> int | None:
        # SIGALRM exists only in the main thread; elsewhere math-verify must run without its timeout.
        return timeout_s if threading.current_thread() is threading.main_thread() else None

    @functools.lru_cache(maxsize=4096)  # a GRPO group scores n responses against the same reference
    def parse_reference(ground_truth: str):
        gold = parse(_as_final_answer(ground_truth), parsing_timeout=timeout())
        if not gold:
            raise ValueError(f"math-verify cannot parse the reference answer {ground_truth!r}")
        return gold

    def math_reward(prompt_ids: list[int], response_ids: list[int], ground_truth=None, **info) -> float:
        if ground_truth is None:
            raise ValueError("the math reward needs a reference answer (ground_truth); the prompt source gave "
                             "none: check data.answer_key")
        gold = parse_reference(str(ground_truth).strip())
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        answer = parse(last_boxed(text) or text, parsing_timeout=timeout())
        if not answer:
            return 0.0
        return 1.0 if verify(gold, answer, timeout_seconds=timeout()) else 0.0

    return math_reward
