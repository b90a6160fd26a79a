"""Prompt datasets from jsonl and parquet: formats, chat template, endless seeded stream, bad input."""

import json

import pytest

from asyncflow.data import PROMPT_SOURCES, make_prompt_source, next_batch
from asyncflow.data.config import DataConfig
from asyncflow.data.datasets import DatasetError, FilePrompts, PromptDataset, make_file_source, resolve_files
from asyncflow.tiny_model import build_tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def plain_tok():
    """The character-level ascii tokenizer, without a chat template."""
    return build_tokenizer("ascii")


@pytest.fixture(scope="module")
def tok():
    """The ascii tokenizer with a tiny chat template (``<role>content`` then ``<assistant>``)."""
    tokenizer = build_tokenizer("ascii")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def write_jsonl(path, rows):
    """Rows as JSON lines; a string row is written verbatim (for malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cfg(path, **kw):
    return DataConfig(path=str(path), **kw)


def texts(tokenizer, prompts):
    return [tokenizer.decode(p) for p in prompts]


ROWS = [
    {"prompt": "What is 6*7?", "ground_truth": "42", "data_source": "toy"},
    {"prompt": "Half of 1.5?", "ground_truth": 0.75},
    {"prompt": "2+2?", "ground_truth": 4, "extra": {"ignored": [1, 2]}},
]


# ---- formats -------------------------------------------------------------------------------------------------


def test_jsonl_plain_text_prompts_and_answers(tmp_path, plain_tok):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2]) + "\n\n")
    ds = PromptDataset(plain_tok, cfg(path, apply_chat_template=False), "jsonl")
    assert len(ds) == 3
    assert [plain_tok.decode(ds.prompt(i)) for i in range(3)] == ["What is 6*7?", "Half of 1.5?", "2+2?"]
    assert ds.prompt(0) == plain_tok("What is 6*7?")["input_ids"]
    # Numbers become strings; a row with a data source gives it (and its extra info) with the answer.
    assert ds.answers == [{"ground_truth": "42", "data_source": "toy", "extra_info": None}, "0.75", "4"]
    assert ds.sources == [(str(path), 1), (str(path), 3), (str(path), 4)]  # 1-based lines, blank lines skipped
    assert ds.max_prompt_len == len("What is 6*7?")


def test_chat_template_string_and_message_prompts(tmp_path, tok):
    rows = [
        {"prompt": "hi", "ground_truth": "1"},
        {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}], "ground_truth": "2"},
    ]
    ds = PromptDataset(tok, cfg(write_jsonl(tmp_path / "chat.jsonl", rows)), "jsonl")
    assert [tok.decode(ds.prompt(i)) for i in range(2)] == [
        "<user>hi<assistant>",
        "<user>a<assistant>b<user>c<assistant>",
    ]
    assert ds.max_prompt_len == len("<user>a<assistant>b<user>c<assistant>")


def test_system_prompt_is_prepended_unless_the_row_has_one(tmp_path, tok):
    rows = [
        {"prompt": "q1", "ground_truth": "1"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "q2"}], "ground_truth": "2"},
    ]
    ds = PromptDataset(tok, cfg(write_jsonl(tmp_path / "s.jsonl", rows), system_prompt="Box it."), "jsonl")
    assert [tok.decode(ds.prompt(i)) for i in range(2)] == [
        "<system>Box it.<user>q1<assistant>",
        "<system>own<user>q2<assistant>",
    ]


def test_parquet_verl_layout(tmp_path, tok):
    """verl's preprocessed parquet: a chat-list prompt and ``reward_model.ground_truth``."""
    rows = [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(i * 10)}, "extra_info": {"index": i}}
        for i in range(4)
    ]
    path = write_parquet(tmp_path / "train.parquet", rows)
    source = make_prompt_source("parquet", tok, 0, cfg(path, answer_key="reward_model.ground_truth", shuffle=False))
    prompts, answers = source.next_batch(4)
    assert texts(tok, prompts) == [f"<user>q{i}<assistant>" for i in range(4)]
    assert answers == [{"ground_truth": str(i * 10), "data_source": "gsm8k", "extra_info": {"index": i}}
                       for i in range(4)]
    assert source.max_prompt_len == len("<user>q0<assistant>")


def test_data_source_and_extra_info_keys(tmp_path, tok):
    """Optional per row, nested keys reach in, and None turns them off (plain answers, as before)."""
    rows = [{"prompt": "a", "ground_truth": "1", "meta": {"src": "m"}, "extra_info": {"split": "train"}},
            {"prompt": "b", "ground_truth": "2"}]
    for path in (write_jsonl(tmp_path / "x.jsonl", rows), write_parquet(tmp_path / "x.parquet", rows)):
        ds = PromptDataset(tok, cfg(path, data_source_key="meta.src"), "auto")
        assert ds.answers == [{"ground_truth": "1", "data_source": "m", "extra_info": {"split": "train"}}, "2"]
        ds = PromptDataset(tok, cfg(path, data_source_key=None, extra_info_key=None), "auto")
        assert ds.answers == ["1", "2"]


def test_parquet_string_prompts_and_numeric_answers(tmp_path, tok):
    rows = [{"prompt": r["prompt"], "ground_truth": i} for i, r in enumerate(ROWS)]
    path = write_parquet(tmp_path / "a.parquet", rows)
    ds = PromptDataset(tok, cfg(path), "auto")
    assert texts(tok, [ds.prompt(i) for i in range(3)]) == [f"<user>{r['prompt']}<assistant>" for r in ROWS]
    assert ds.answers == ["0", "1", "2"]
    assert ds.sources[0] == (str(path), 0)  # parquet rows are 0-based indexes


def test_format_auto_and_directories(tmp_path, tok):
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "B", "ground_truth": "b"}])
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "A", "ground_truth": "a"}])
    write_parquet(tmp_path / "c.parquet", [{"prompt": "C", "ground_truth": "c"}])
    (tmp_path / "notes.txt").write_text("not data")
    assert resolve_files(tmp_path) == [(tmp_path / "a.jsonl", "jsonl"), (tmp_path / "b.jsonl", "jsonl"),
                                       (tmp_path / "c.parquet", "parquet")]
    assert resolve_files(tmp_path, "parquet") == [(tmp_path / "c.parquet", "parquet")]
    assert resolve_files(tmp_path / "notes.txt", "jsonl") == [(tmp_path / "notes.txt", "jsonl")]  # explicit
    ds = PromptDataset(tok, cfg(tmp_path, shuffle=False), "jsonl")  # the jsonl source reads *.jsonl only
    assert ds.answers == ["a", "b"]
    ds = PromptDataset(tok, cfg(tmp_path), "auto")
    assert ds.answers == ["a", "b", "c"]


# ---- the stream ----------------------------------------------------------------------------------------------


@pytest.fixture()
def twenty(tmp_path):
    return write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"p{i:02d}", "ground_truth": str(i)} for i in range(20)])


def test_registered_sources_and_answers(twenty, tok):
    assert {"jsonl", "parquet"} <= set(PROMPT_SOURCES.names())
    source = make_prompt_source("jsonl", tok, 3, cfg(twenty))
    prompts, answers = next_batch(source, 5)
    # Each answer stays with its prompt through the shuffle.
    assert [t.removeprefix("<user>p").removesuffix("<assistant>") for t in texts(tok, prompts)] == \
        [f"{int(a):02d}" for a in answers]
    no_answers = make_prompt_source("jsonl", tok, 3, cfg(twenty, answer_key=None))
    assert not hasattr(no_answers, "next_batch")
    assert next_batch(no_answers, 5) == (prompts, None)  # same seed, same order


def test_deterministic_per_seed_and_reshuffled_per_epoch(twenty, tok):
    a, b = (make_file_source(tok, 7, cfg(twenty)) for _ in range(2))
    stream_a, stream_b = a.next_prompts(60), b.next_prompts(60)
    assert stream_a == stream_b
    epochs = [texts(tok, stream_a[i : i + 20]) for i in (0, 20, 40)]
    for epoch in epochs:  # each epoch visits every row once
        assert sorted(epoch) == [f"<user>p{i:02d}<assistant>" for i in range(20)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])
    assert make_file_source(tok, 8, cfg(twenty)).next_prompts(60) != stream_a


def test_endless_in_file_order_without_shuffle(twenty, tok):
    source = make_file_source(tok, 0, cfg(twenty, shuffle=False))
    chunks = [texts(tok, source.next_prompts(7)) for _ in range(10)]  # 70 prompts: 3.5 epochs
    flat = [t for c in chunks for t in c]
    assert flat == [f"<user>p{i % 20:02d}<assistant>" for i in range(70)]
    assert source.state_dict() == {"seed": 0, "epoch": 3, "position": 10, "rows": 20}


def test_state_dict_resumes_the_stream(twenty, tok):
    source = make_file_source(tok, 5, cfg(twenty))
    source.next_batch(33)
    state = source.state_dict()
    expected = source.next_batch(25)
    resumed = make_file_source(tok, 5, cfg(twenty))
    resumed.load_state_dict(state)
    assert resumed.next_batch(25) == expected
    with pytest.raises(DatasetError, match="cannot resume"):
        make_file_source(tok, 6, cfg(twenty)).load_state_dict(state)


def test_max_prompt_len_is_the_longest_tokenized_prompt(tmp_path, tok, plain_tok):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "x" * n, "ground_truth": "1"} for n in (3, 11, 5)])
    assert isinstance(make_prompt_source("jsonl", plain_tok, 0, cfg(path, apply_chat_template=False)), FilePrompts)
    assert make_prompt_source("jsonl", plain_tok, 0, cfg(path, apply_chat_template=False)).max_prompt_len == 11
    assert make_prompt_source("jsonl", tok, 0, cfg(path)).max_prompt_len == 11 + len("<user><assistant>")
    limit = 11 + len("<user><assistant>")
    assert make_prompt_source("jsonl", tok, 0, cfg(path, max_prompt_len=limit)).max_prompt_len == limit


# ---- bad input -----------------------------------------------------------------------------------------------

GOOD = {"prompt": "ok", "ground_truth": "1"}
LIST_HINT = 'expected a string or a list of chat messages [{"role": ..., "content": ...}]'


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": "q", "answer": "a"}, "missing field 'prompt' (fields present: question, answer)"),
        ({"prompt": "q"}, "missing field 'ground_truth' (fields present: prompt); set data.answer_key: null"),
        ({"prompt": 5, "ground_truth": "1"}, f"field 'prompt' is a number; {LIST_HINT}"),
        ({"prompt": None, "ground_truth": "1"}, f"field 'prompt' is null; {LIST_HINT}"),
        ({"prompt": {"role": "user"}, "ground_truth": "1"}, f"field 'prompt' is an object; {LIST_HINT}"),
        ({"prompt": "  ", "ground_truth": "1"}, "field 'prompt' is empty"),
        ({"prompt": [], "ground_truth": "1"}, "field 'prompt' is empty"),
        ({"prompt": [{"role": "user", "content": ""}], "ground_truth": "1"}, "field 'prompt' is empty"),
        ({"prompt": [{"role": "user"}], "ground_truth": "1"},
         "field 'prompt' message 0: expected an object with string 'role' and 'content', got {'role': string}"),
        ({"prompt": ["hi"], "ground_truth": "1"}, "field 'prompt' message 0: expected an object with string "
                                                  "'role' and 'content', got a string"),
        ({"prompt": "q", "ground_truth": ["1"]}, "field 'ground_truth' is a list; expected a string or a number"),
        ({"prompt": "q", "ground_truth": True}, "field 'ground_truth' is a boolean; expected a string or a number"),
        ({"prompt": "q", "ground_truth": None}, "field 'ground_truth' is null; expected a string or a number"),
        ({"prompt": "q", "ground_truth": ""}, "field 'ground_truth' is empty"),
        ({"prompt": "q" * 30, "ground_truth": "1"},
         "field 'prompt' is 47 tokens with the chat template, longer than data.max_prompt_len=40"),
        ('{"prompt": "q", "ground_truth": 1', "invalid JSON (Expecting ',' delimiter at column 34)"),
        ('["prompt", "q"]', "expected a JSON object, got a list"),
    ],
)
def test_bad_jsonl_row_names_file_row_and_field(tmp_path, tok, bad_row, message):
    # Line 4 is the bad row: the blank line 2 still counts.
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n" +
                    (bad_row if isinstance(bad_row, str) else json.dumps(bad_row)) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DatasetError) as info:
        make_prompt_source("jsonl", tok, 0, cfg(path, max_prompt_len=40))
    assert str(info.value).startswith(f"{path} row 4: {message}")
    assert isinstance(info.value, ValueError)


def test_invalid_utf8_line(tmp_path, tok):
    path = tmp_path / "u.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"u\.jsonl row 2: not valid UTF-8"):
        make_prompt_source("jsonl", tok, 0, cfg(path))


def test_nested_answer_key_missing(tmp_path, tok):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "q", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError) as info:
        make_prompt_source("jsonl", tok, 0, cfg(path, answer_key="reward_model.ground_truth"))
    assert str(info.value).startswith(f"{path} row 1: missing field 'reward_model.ground_truth' "
                                      "(fields present: prompt, reward_model)")


def test_bad_parquet_rows(tmp_path, tok):
    rows = [GOOD, GOOD, {"prompt": None, "ground_truth": "1"}]
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(DatasetError) as info:
        make_prompt_source("parquet", tok, 0, cfg(path))
    assert str(info.value).startswith(f"{path} row 2: field 'prompt' is null")

    path = write_parquet(tmp_path / "q.parquet", [{"question": "q", "answer": "1"}])
    with pytest.raises(DatasetError) as info:
        make_prompt_source("parquet", tok, 0, cfg(path))
    assert str(info.value) == f"{path} row 0: missing field 'prompt' (fields present: question, answer)"

    path = write_parquet(tmp_path / "long.parquet", [GOOD, {"prompt": "q" * 50, "ground_truth": "1"}])
    with pytest.raises(DatasetError, match=r"long\.parquet row 1: field 'prompt' is 67 tokens"):
        make_prompt_source("parquet", tok, 0, cfg(path, max_prompt_len=64))

    path = tmp_path / "broken.parquet"
    path.write_text("not parquet")
    with pytest.raises(DatasetError, match=r"broken\.parquet: not a readable parquet file"):
        make_prompt_source("parquet", tok, 0, cfg(path))


def test_chat_template_errors(tmp_path, tok, plain_tok):
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD, {"prompt": [{"role": "user", "content": "q"}], "ground_truth": 1}])
    with pytest.raises(DatasetError, match="tokenizer has no chat template; set data.apply_chat_template: false"):
        make_prompt_source("jsonl", plain_tok, 0, cfg(path))
    with pytest.raises(DatasetError) as info:
        make_prompt_source("jsonl", plain_tok, 0, cfg(path, apply_chat_template=False))
    assert str(info.value) == (f"{path} row 2: field 'prompt' is a list of chat messages but "
                               "data.apply_chat_template is false")
    with pytest.raises(DatasetError, match="system_prompt is set but data.apply_chat_template is false"):
        make_prompt_source("jsonl", plain_tok, 0, cfg(path, apply_chat_template=False, system_prompt="s"))

    strict = build_tokenizer("ascii")
    strict.chat_template = "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('last must be user') }}" \
                           "{% endif %}" + TEMPLATE
    bad = write_jsonl(tmp_path / "t.jsonl", [GOOD, {"prompt": [{"role": "assistant", "content": "x"}],
                                                    "ground_truth": "1"}])
    with pytest.raises(DatasetError, match=r"t\.jsonl row 2: field 'prompt': the chat template failed \(.*last must"):
        make_prompt_source("jsonl", strict, 0, cfg(bad))


def test_configuration_errors(tmp_path, tok):
    with pytest.raises(DatasetError, match="needs data.path"):
        make_prompt_source("jsonl", tok, 0, DataConfig())
    with pytest.raises(DatasetError, match="needs data.path"):
        make_prompt_source("jsonl", tok, 0, None)
    with pytest.raises(DatasetError, match="missing.jsonl: no such file or directory"):
        make_prompt_source("jsonl", tok, 0, cfg(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD])
    with pytest.raises(DatasetError, match="data.format is 'parquet' but the prompt source is 'jsonl'"):
        make_prompt_source("jsonl", tok, 0, cfg(path, format="parquet"))
    other = write_jsonl(tmp_path / "x.txt", [GOOD])
    with pytest.raises(DatasetError, match="cannot tell the format from the extension"):
        PromptDataset(tok, cfg(other), "auto")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="empty.jsonl: the dataset has no rows"):
        make_prompt_source("jsonl", tok, 0, cfg(empty))
    (tmp_path / "dir").mkdir()
    with pytest.raises(DatasetError, match="directory has no .parquet files"):
        make_prompt_source("parquet", tok, 0, cfg(tmp_path / "dir"))
