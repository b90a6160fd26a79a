"""A worker's tokenizer loaded from the class the driver resolved (``asyncflow.models.tokenizer``) is the tokenizer
``AutoTokenizer`` loads: same class, same special tokens, same ids, and the same text for every decode."""

import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from asyncflow.models.tokenizer import load_tokenizer, resolve_tokenizer_class, tokenizer_class
from asyncflow.tiny_model import make_tiny_model

SPECIAL = ["bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "all_special_tokens"]


def _same(auto, fast) -> None:
    assert type(fast) is type(auto)
    assert fast.get_vocab() == auto.get_vocab()
    for attr in SPECIAL:
        assert getattr(fast, attr) == getattr(auto, attr), attr
    ids = list(range(len(auto)))
    rng = random.Random(0)
    rows = [ids] + [[rng.choice(ids) for _ in range(rng.randint(1, 24))] for _ in range(200)]
    for row in rows:
        for skip in (True, False):
            assert fast.decode(row, skip_special_tokens=skip) == auto.decode(row, skip_special_tokens=skip)
    assert fast.batch_decode(rows, skip_special_tokens=True) == auto.batch_decode(rows, skip_special_tokens=True)
    tokens = auto.convert_ids_to_tokens(ids) + ["no-such-token"]
    assert fast.convert_tokens_to_ids(tokens) == auto.convert_tokens_to_ids(tokens)
    text = auto.decode(ids, skip_special_tokens=False)
    assert fast(text)["input_ids"] == auto(text)["input_ids"]


@pytest.mark.parametrize("family,charset", [("qwen2", "add1"), ("llama", "ascii"), ("qwen3", "ascii")])
def test_the_resolved_class_loads_what_autotokenizer_loads(tmp_path, family, charset):
    model = make_tiny_model(tmp_path / family, family=family, charset=charset)
    auto = AutoTokenizer.from_pretrained(model)
    cls = resolve_tokenizer_class(str(model))
    assert cls == tokenizer_class(auto) and cls.startswith("transformers.")
    _same(auto, load_tokenizer(str(model), cls))


def test_added_special_tokens_decode_the_same(tmp_path):
    # A chat model's extra special tokens (an end-of-turn and a tool-call marker) and a plain added token: decode
    # skips the special ones and keeps the plain one, on both paths.
    model = make_tiny_model(tmp_path / "m", family="qwen2", charset="ascii")
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<tool_call>"]})
    tok.add_tokens(["<plain>"])
    tok.save_pretrained(model)
    auto = AutoTokenizer.from_pretrained(model)
    fast = load_tokenizer(str(model), resolve_tokenizer_class(str(model)))
    _same(auto, fast)
    end, plain = auto.convert_tokens_to_ids(["<|im_end|>", "<plain>"])
    assert fast.decode([end, plain], skip_special_tokens=True) == "<plain>"


def test_loading_from_the_class_does_not_import_autotokenizers_machinery(tmp_path):
    # What the cut is for: the worker's process never imports transformers' auto-model modules.
    model = make_tiny_model(tmp_path / "m", family="qwen2")
    cls = resolve_tokenizer_class(str(model))
    code = ("import sys; from asyncflow.models.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(model)!r}, {cls!r}); print(t.decode([3, 4]), "
            "'transformers.models.auto.auto_factory' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False"
