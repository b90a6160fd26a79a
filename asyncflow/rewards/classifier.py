"""The ``classifier`` reward: a sequence-classification model (a reward model) from an HF folder scores the text.

The prompt and response are decoded with the policy's tokenizer (special tokens skipped), joined, re-tokenized
with the reward model's own tokenizer (truncated to its maximum length) and scored by
``AutoModelForSequenceClassification``; the reward is the logit ``reward.model_label`` (a reward model has one,
label 0). It runs on the CPU of the reward worker, ``reward.model_batch_size`` texts a forward pass.
"""

from __future__ import annotations

from asyncflow.rewards.config import RewardConfig


class ClassifierReward:
    """A batched reward function scoring ``prompt + response`` text with a sequence classifier."""

    batched = True

    def __init__(self, tokenizer, cfg: RewardConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not cfg.model_path:
            raise ValueError("algorithm.reward: classifier needs reward.model_path (an HF folder of a "
                             "sequence-classification model)")
        self.policy_tokenizer, self.cfg = tokenizer, cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        if self.tokenizer.pad_token is None:  # batches are padded; a decoder-only reward model often has no pad
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.model_path).eval()
        if self.model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= cfg.model_label < self.model.config.num_labels:
            raise ValueError(f"reward.model_label is {cfg.model_label} but {cfg.model_path} has "
                             f"{self.model.config.num_labels} label(s)")
        self.torch = torch

    def texts(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[str]:
        """The texts the model scores: each prompt's text followed by its response's."""
        decode = self.policy_tokenizer.decode
        return [decode(p, skip_special_tokens=True) + decode(r, skip_special_tokens=True)
                for p, r in zip(prompt_ids, response_ids)]

    def score_texts(self, texts: list[str]) -> list[float]:
        """The reward of each text."""
        out: list[float] = []
        size = max(1, self.cfg.model_batch_size)
        for start in range(0, len(texts), size):
            enc = self.tokenizer(texts[start:start + size], return_tensors="pt", padding=True, truncation=True)
            with self.torch.no_grad():
                logits = self.model(**enc).logits
            out.extend(logits[:, self.cfg.model_label].float().tolist())
        return out

    def __call__(self, prompt_ids: list[list[int]], response_ids: list[list[int]], **info) -> list[float]:
        return self.score_texts(self.texts(prompt_ids, response_ids))


def make_classifier_reward(tokenizer, cfg: RewardConfig) -> ClassifierReward:
    """The ``classifier`` reward of the ``reward`` section."""
    return ClassifierReward(tokenizer, cfg)
