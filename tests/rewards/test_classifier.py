"""The ``classifier`` reward: a tiny sequence classifier made here (random weights, saved with save_pretrained)
scores the decoded prompt + response exactly as its own forward pass does, one text at a time."""

import pytest
import torch

from asyncflow.rewards import RewardConfig, RewardRow, RewardScorer, make_reward_fn
from asyncflow.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ascii")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tok):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def own_forward(folder, text: str) -> float:
    """The classifier's score of one text, by transformers alone (no padding, no batching)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    enc = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits[0, 0].item()


def test_scores_equal_the_classifiers_own_forward(tok, reward_model):
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = [("What is 2+2? ", "4"), ("Name a colour. ", "A long answer: blue, surely blue."), ("Hi ", "")]
    cfg = RewardConfig(model_path=str(reward_model), model_batch_size=2)  # a padded batch, then a batch of one
    scorer = RewardScorer(make_reward_fn("classifier", tok, cfg), tok, cfg)
    assert scorer.batched
    out = scorer.score([RewardRow.of(enc(p), enc(r), "x") for p, r in pairs])
    expected = [own_forward(reward_model, p + r) for p, r in pairs]
    assert all(s.error is None for s in out)
    assert torch.allclose(torch.tensor([s.reward for s in out]), torch.tensor(expected), atol=1e-5)
    assert len(set(expected)) == 3  # the texts really score differently


def test_label_out_of_range_and_missing_path(tok, reward_model):
    with pytest.raises(ValueError, match="reward.model_label is 1 but .* has 1 label"):
        make_reward_fn("classifier", tok, RewardConfig(model_path=str(reward_model), model_label=1))
    with pytest.raises(ValueError, match="needs reward.model_path"):
        make_reward_fn("classifier", tok, RewardConfig())
