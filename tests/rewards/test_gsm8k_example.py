"""The worked GSM8K example: a GSM8K-style file made here is converted by tools/prepare_gsm8k.py, read by the file
prompt source, and a correct and a wrong response are scored by the math reward with the row's answer."""

import json
import subprocess
import sys

import pytest

from asyncflow.data import make_prompt_source
from asyncflow.data.config import DataConfig
from asyncflow.data.gsm8k import INSTRUCTION, Gsm8kError, convert
from asyncflow.rewards import RewardRow, RewardScorer, make_reward_fn
from asyncflow.tiny_model import build_tokenizer
from tests.recipe_runs import REPO

ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?", "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10"},
    {"question": "A farm has 1,200 hens. How many legs?", "answer": "1,200 x 2 = 2,400\n#### 2,400"},
    {"question": "What is 7 minus 9?", "answer": "7 - 9 = -2\n#### -2"},
    {"question": "Half of 3?", "answer": "3/2 = 1.5\n#### 1.5"},
]


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer("ascii")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tokenizer


@pytest.mark.parametrize("src_ext,out_ext", [("jsonl", "jsonl"), ("parquet", "parquet")])
def test_prepare_load_and_score(tmp_path, tok, src_ext, out_ext):
    src, out = tmp_path / f"gsm8k.{src_ext}", tmp_path / f"train.{out_ext}"
    if src_ext == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), src)
    if src_ext == "jsonl":  # the command line once (a fresh interpreter costs seconds), the library otherwise
        proc = subprocess.run([sys.executable, str(REPO / "tools/prepare_gsm8k.py"), str(src), str(out)],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"wrote 5 rows to {out}"
    else:
        assert convert(src, out) == 5

    cfg = DataConfig(path=str(out), shuffle=False, max_prompt_len=512)
    source = make_prompt_source(out_ext, tok, 0, cfg)
    prompts, answers = source.next_batch(5)
    assert [a["ground_truth"] for a in answers] == ["72", "10", "2400", "-2", "1.5"]
    assert {a["data_source"] for a in answers} == {"openai/gsm8k"}
    assert answers[1]["extra_info"] == {"split": "train", "index": 1, "question": ROWS[1]["question"],
                                        "answer": ROWS[1]["answer"]}
    assert tok.decode(prompts[0]) == f"<user>{ROWS[0]['question']} {INSTRUCTION}<assistant>"

    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    scorer = RewardScorer(make_reward_fn("math", tok), tok)
    responses = ["48/2 = 24 in May, 48 + 24 = 72. The answer is \\boxed{72}.", "So she sold \\boxed{71} clips.",
                 "Two legs each: \\boxed{2400}", "\\boxed{2}"]
    rows = [RewardRow.of(prompts[i], enc(r), answers[i]) for i, r in zip([0, 0, 2, 3], responses)]
    assert [(s.reward, s.error) for s in scorer.score(rows)] == [(1.0, None), (0.0, None), (1.0, None), (0.0, None)]


def test_rows_that_are_not_gsm8k_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(Gsm8kError, match=r"bad.jsonl row 1: field 'answer' has no '#### <final answer>' line"):
        convert(bad, tmp_path / "out.jsonl")
    bad.write_text(json.dumps({"problem": "q", "solution": "#### 1"}) + "\n")
    with pytest.raises(Gsm8kError, match=r"row 0: expected a non-empty string field 'question' \(fields present: "
                                         "problem, solution\\)"):
        convert(bad, tmp_path / "out.jsonl")
    with pytest.raises(Gsm8kError, match="missing.jsonl: no such file"):
        convert(tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    five = tmp_path / "five.jsonl"
    five.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert convert(five, tmp_path / "two.jsonl", limit=2) == 2


def test_the_example_config_loads():
    from asyncflow.config import load_config

    cfg = load_config(REPO / "examples/math_gsm8k/config.yaml", ["data.path=/data/gsm8k/train.jsonl"])
    assert (cfg.algorithm.reward, cfg.workflow.task, cfg.data.answer_key) == ("math", "jsonl", "ground_truth")
