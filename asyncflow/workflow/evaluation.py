"""Evaluation while training: the validation set through a rollout engine at the current weights.

The driver reads the validation set (``data.val_path``) once, before the workers start, and hands it to rollout
instance 0 (``evaluation_spec``). That instance evaluates on an empty engine, never over requests in flight: when
the weight version it is about to serve reaches the next multiple of ``workflow.eval_every`` (version 0 too with
``workflow.eval_before_train``), it generates one greedy response (temperature 0) and ``workflow.eval_k`` sampled
responses (at ``rollout.temperature``) per validation prompt, scores them with the run's reward function and
returns the metrics (``eval/*``, ``asyncflow.observability.keys``) and the first ``workflow.eval_samples``
prompts' responses. The driver logs the metrics with a step's and writes the samples to
``<output_dir>/eval_samples/step_<n>.jsonl``.

Where that fits: the chunked rollout and ``sync`` mode evaluate between two generations, with the version admitted
for the step about to be generated, and the result goes with that step's report. The streaming loops (the
continuous stream, ``rollout_stream``; the sample stream, ``sample_stream``) keep requests in flight across steps:
instance 0 stops admitting, drains its engine (under partial rollout too), applies the newest weights and evaluates
them, then admits again; the result is a report of its own (``EVAL_SERVICE``). The other instances never stop.

Nothing of an evaluation enters the TransferQueue: validation responses are never trained and never counted by
the staleness bound or the exactly-once record of trained prompts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from asyncflow.observability import keys

EVAL_SERVICE = "evaluation"
"""The service name of the report that carries an evaluation of the streaming loops (``RolloutService.
evaluate_drained``): not a rollout report, so it never stands in for one of its step's."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt from ``n`` samples of which ``c`` are correct (Chen et al. 2021):
    ``1 - C(n-c, k) / C(n, k)``, the chance that ``k`` of the ``n`` drawn without replacement hold a correct one;
    computed as a product, which stays exact where the binomials overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclasses.dataclass
class EvalSpec:
    """What rollout instance 0 needs to evaluate (plain data, sent once when the instance starts)."""

    prompts: list[list[int]]
    answers: list | None
    """What each prompt's row gives the reward function (its answer, or ``{"ground_truth", "data_source",
    "extra_info"}``: ``asyncflow.data.datasets.row_answer``); None when the set has no answers."""
    every: int
    """Evaluate each time the admitted version reaches the next multiple of this (0: only ``before``)."""
    before: bool
    """Evaluate version 0, the weights before the first step."""
    k: int
    samples: int
    correct_reward: float
    reward: str
    reward_on_error: float
    reward_cfg: object = None
    """The run's ``reward`` section (``asyncflow.rewards.RewardConfig``): the function is called as in training."""
    tokenizer_class: str | None = None
    """The policy tokenizer's class, resolved by the driver (``asyncflow.models.tokenizer``)."""


def evaluation_spec(cfg, model_dir: str | Path) -> EvalSpec | None:
    """The run's validation set and settings for rollout instance 0, or None when the run does not evaluate.

    Read with the training data's options (``data.prompt_key``, ``answer_key``, chat template, ...), in file
    order, the first ``data.val_size`` rows (all when None)."""
    wf, data = cfg.workflow, cfg.data
    if not (wf.eval_every or wf.eval_before_train):
        return None
    from transformers import AutoTokenizer

    from asyncflow.data.datasets import DatasetError, PromptDataset
    from asyncflow.models.tokenizer import tokenizer_class
    from asyncflow.rewards.registry import absolute_spec

    val_cfg = dataclasses.replace(data, path=data.val_path, shuffle=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = PromptDataset(tokenizer, val_cfg)
    count = len(dataset) if data.val_size is None else min(data.val_size, len(dataset))
    room = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    if dataset.max_prompt_len > room:
        raise DatasetError(f"{data.val_path}: a validation prompt is {dataset.max_prompt_len} tokens; "
                           f"rollout.max_model_len - rollout.max_new_tokens = {room} leaves room for that many")
    return EvalSpec(prompts=[dataset.prompt(i) for i in range(count)],
                    answers=None if dataset.answers is None else dataset.answers[:count],
                    every=wf.eval_every, before=wf.eval_before_train, k=wf.eval_k, samples=wf.eval_samples,
                    correct_reward=wf.eval_correct_reward, reward=absolute_spec(cfg.algorithm.reward),
                    reward_on_error=cfg.algorithm.reward_on_error, reward_cfg=cfg.reward,
                    tokenizer_class=tokenizer_class(tokenizer))


def _restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray started again after its process died."""
    import ray

    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


class Evaluator:
    """Runs in rollout instance 0: decides when an evaluation is due and runs it on the instance's engine."""

    def __init__(self, spec: EvalSpec, model_dir: str, restarted: bool | None = None, evaluated: int = -1):
        """``restarted``: this instance is a new incarnation of one that died (default: ask Ray whether this actor
        was started again). The evaluations before the death were made: it evaluates next at the first multiple of
        ``spec.every`` from the first version it admits (the version of an evaluation cut short by the death, when
        still admitted), not at once as ``spec.before`` has a first incarnation do, and never at or below
        ``evaluated``, the newest version whose evaluation was reported (``VersionBoard.evaluated``)."""
        from asyncflow.models.tokenizer import load_tokenizer
        from asyncflow.rewards import RewardScorer, make_reward_fn

        self.spec = spec
        self.tokenizer = load_tokenizer(model_dir, spec.tokenizer_class)
        # The training reward's scorer: every shape it reads (token ids, verl's text signature, batched, async).
        self.scorer = RewardScorer(make_reward_fn(spec.reward, self.tokenizer, spec.reward_cfg), self.tokenizer,
                                   spec.reward_cfg, spec.reward_on_error)
        restarted = _restarted_actor() if restarted is None else restarted
        self.next_due = None if restarted else 0 if spec.before else (spec.every or None)
        self.resuming = restarted and bool(spec.every)
        self.evaluated = evaluated

    def due(self, version: int) -> bool:
        """Whether the weights of ``version`` (just admitted) are to be evaluated."""
        if self.resuming:  # the first version a restarted instance admits fixes its next evaluation
            self.resuming = False
            first = max(version, self.evaluated + 1)
            self.next_due = -(-first // self.spec.every) * self.spec.every
        return self.next_due is not None and version >= self.next_due

    def _score(self, prompts: list[list[int]], samples: list, answers: list) -> list[float]:
        """Rewards of ``samples`` (of ``prompts``, with their rows' ``answers``); a function that raises gives
        ``reward_on_error``, as in training."""
        from asyncflow.rewards.scorer import RewardRow

        has = self.spec.answers is not None
        rows = [RewardRow.of(p, s.response_ids, a, has) for p, s, a in zip(prompts, samples, answers)]
        return [scored.reward for scored in self.scorer.score(rows)]

    def close(self) -> None:
        """Release the scorer (its event loop, for ``async def`` rewards)."""
        self.scorer.close()

    def run(self, engine, version: int) -> tuple[dict, list[dict]]:
        """Evaluate ``engine`` (serving ``version``): the ``eval/*`` metrics and the sample records."""
        spec, t0 = self.spec, time.perf_counter()
        answers = spec.answers or [None] * len(spec.prompts)
        greedy = engine.generate(spec.prompts, n=1, temperature=0.0)
        sampled = engine.generate(spec.prompts, n=spec.k)  # prompt order, k consecutive per prompt
        greedy_r = self._score(spec.prompts, greedy, answers)
        sampled_r = self._score([p for p in spec.prompts for _ in range(spec.k)], sampled,
                                [a for a in answers for _ in range(spec.k)])
        correct = [sum(r >= spec.correct_reward for r in sampled_r[i * spec.k:(i + 1) * spec.k])
                   for i in range(len(spec.prompts))]
        n = max(len(spec.prompts), 1)
        metrics = {keys.EVAL_GREEDY_ACC: sum(r >= spec.correct_reward for r in greedy_r) / n,
                   keys.eval_pass_at(spec.k): sum(pass_at_k(spec.k, c, spec.k) for c in correct) / n,
                   keys.EVAL_MEAN_REWARD: sum(sampled_r) / max(len(sampled_r), 1),
                   keys.EVAL_GREEDY_REWARD: sum(greedy_r) / n,
                   keys.EVAL_VERSION: float(version), keys.EVAL_PROMPTS: float(len(spec.prompts)),
                   "eval/seconds": time.perf_counter() - t0}
        if spec.k > 1:  # pass@1 from the same samples: the mean chance that one sampled response is correct
            metrics[keys.eval_pass_at(1)] = sum(pass_at_k(spec.k, c, 1) for c in correct) / n
        records = []
        for i in range(min(spec.samples, len(spec.prompts))):
            records.append({
                "version": version, "prompt": self._text(spec.prompts[i]), "ground_truth": answers[i],
                "greedy": {"response": self._text(greedy[i].response_ids), "reward": greedy_r[i]},
                "sampled": [{"response": self._text(s.response_ids), "reward": r}
                            for s, r in zip(sampled[i * spec.k:(i + 1) * spec.k],
                                            sampled_r[i * spec.k:(i + 1) * spec.k])],
            })
        self.next_due = (version // spec.every + 1) * spec.every if spec.every else None
        return metrics, records

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def write_samples(output_dir: str | Path, step: int, records: list[dict]) -> Path:
    """``<output_dir>/eval_samples/step_<step>.jsonl``: one validation prompt per line, with its reference answer,
    greedy response and sampled responses and their rewards."""
    folder = Path(output_dir) / "eval_samples"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
    return path
