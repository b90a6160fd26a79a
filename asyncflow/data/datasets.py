"""Prompt datasets read from jsonl and parquet files (prompt sources ``jsonl`` and ``parquet``).

One row per prompt, in the formats verl and slime users already have::

    {"prompt": "What is 6 * 7?", "ground_truth": "42"}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}], "ground_truth": 3}
    {"prompt": [...], "reward_model": {"ground_truth": "42"}, "data_source": "gsm8k"}   # verl parquet rows

``data.prompt_key`` / ``data.answer_key`` name the fields (a dotted key such as
``reward_model.ground_truth`` reaches into a nested object). ``data.data_source_key`` and ``data.extra_info_key``
(verl's ``data_source`` and ``extra_info``) are optional per row: a row that has either gives its reward function
a dict ``{"ground_truth", "data_source", "extra_info"}`` as its answer (see :func:`row_answer`), which travels with
the prompt through the TransferQueue like a plain answer. Other fields are ignored. Every row is read,
tokenized and checked when the source is built, so a bad row fails the run before any GPU time is spent,
with a :class:`DatasetError` naming the file, the row and the field. The source is endless: it cycles the
rows epoch after epoch, reshuffled each epoch from the seed, and its position is a small ``state_dict``.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from asyncflow.data.config import DataConfig

SUFFIXES = {"jsonl": (".jsonl",), "parquet": (".parquet",)}
"""File extensions that ``format: auto`` recognises, and that a directory is filtered by."""
PARQUET_BATCH_ROWS = 4096
ANSWER_HINT = "; set data.answer_key: null for prompts without answers"


class DatasetError(ValueError):
    """A dataset that cannot be used: the message names the file, the row and the field at fault."""


def _json_type(value) -> str:
    """The JSON name of ``value``'s type, as users see it in their files."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _a(value) -> str:
    """``value``'s JSON type with its article, for messages: ``null``, ``a number``, ``an object``."""
    name = _json_type(value)
    return name if name == "null" else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def resolve_files(path: str | Path, fmt: str = "auto") -> list[tuple[Path, str]]:
    """The files of dataset ``path`` with the format of each.

    A file is read as ``fmt``, or by its extension when ``fmt`` is ``auto``. A directory means every file
    in it (not recursive) whose extension matches ``fmt`` (any known extension for ``auto``), sorted by name.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in SUFFIXES:
        raise DatasetError(f"unknown data.format {fmt!r}; valid: auto, {', '.join(SUFFIXES)}")
    by_suffix = {s: f for f, suffixes in SUFFIXES.items() for s in suffixes if fmt in ("auto", f)}
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in by_suffix)
        if not files:
            raise DatasetError(f"{path}: directory has no {' or '.join(by_suffix)} files")
        return [(p, by_suffix[p.suffix.lower()]) for p in files]
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory (data.path)")
    if fmt != "auto":
        return [(path, fmt)]
    if path.suffix.lower() not in by_suffix:
        raise DatasetError(f"{path}: cannot tell the format from the extension; set data.format to "
                           f"{' or '.join(SUFFIXES)}")
    return [(path, by_suffix[path.suffix.lower()])]


def _jsonl_rows(file: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line."""
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{file} row {lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{file} row {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{file} row {lineno}: expected a JSON object, got {_a(row)}")
            yield lineno, row


def _parquet_rows(file: Path, keys: dict[str, str], optional: tuple[str, ...] = ()) -> Iterator[tuple[int, dict]]:
    """``(row index, row)`` of each row, reading only the columns that ``keys`` (key -> hint when the
    field is missing) need, and the ``optional`` ones the file has."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("reading parquet datasets needs pyarrow: pip install pyarrow") from exc
    try:
        reader = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a file it cannot read
        raise DatasetError(f"{file}: not a readable parquet file ({exc})") from None
    names = reader.schema_arrow.names
    columns = []
    for key, hint in keys.items():
        column = key if key in names else key.split(".")[0]
        if column not in names:
            if reader.metadata.num_rows == 0:
                return
            raise DatasetError(f"{file} row 0: missing field {key!r} (fields present: {', '.join(names)}){hint}")
        columns.append(column)
    columns += [c for c in (k.split(".")[0] if k not in names else k for k in optional) if c in names]
    index = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=list(dict.fromkeys(columns))):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def _field(row: Mapping, key: str, where: str, hint: str = ""):
    """``row[key]``; a dotted key reaches into nested objects when no top-level field has that name."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            present = ", ".join(map(str, row)) or "none"
            raise DatasetError(f"{where}: missing field {key!r} (fields present: {present}){hint}")
        value = value[part]
    return value


def _check_prompt(value, key: str, where: str):
    """The prompt as a string or a list of chat-message dicts, or a DatasetError."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field {key!r} is empty")
        return value
    if isinstance(value, (list, tuple)):
        for i, message in enumerate(value):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DatasetError(f"{where}: field {key!r} message {i}: expected an object with string 'role' "
                                   f"and 'content', got {_describe(message)}")
        if not any(m["content"].strip() for m in value):
            raise DatasetError(f"{where}: field {key!r} is empty")
        return [dict(m) for m in value]
    raise DatasetError(f"{where}: field {key!r} is {_a(value)}; expected a string or a list of chat "
                       f'messages [{{"role": ..., "content": ...}}]')


def _describe(message) -> str:
    if isinstance(message, Mapping):
        return "{" + ", ".join(f"{k!r}: {_json_type(v)}" for k, v in message.items()) + "}"
    return _a(message)


def _optional_field(row: Mapping, key: str | None):
    """``row[key]`` (a dotted key reaches into nested objects), or None when the row does not have it."""
    if not key:
        return None
    try:
        return _field(row, key, "")
    except DatasetError:
        return None


def row_answer(ground_truth: str, data_source, extra_info):
    """What a row gives its reward function: the plain answer, or, when the row has a data source or extra info,
    ``{"ground_truth", "data_source", "extra_info"}`` (unpacked by the reward task into its keyword arguments)."""
    if data_source is None and extra_info is None:
        return ground_truth
    return {"ground_truth": ground_truth, "data_source": None if data_source is None else str(data_source),
            "extra_info": extra_info}


def _check_answer(value, key: str, where: str) -> str:
    """The reference answer as a string (numbers are converted), or a DatasetError."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field {key!r} is empty")
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: field {key!r} is {_a(value)}; expected a string or a number")


class PromptDataset:
    """Every prompt of a dataset, tokenized and validated when built, and its reference answers.

    ``fmt`` is the format of the prompt source (``jsonl``/``parquet``), or ``auto`` to decide by extension;
    ``data_cfg.format`` must be ``auto`` or agree with it. Token ids are kept in one flat int32 array, so a
    dataset of millions of prompts fits in memory.
    """

    def __init__(self, tokenizer, data_cfg: DataConfig | None, fmt: str = "auto"):
        if data_cfg is None or not data_cfg.path:
            raise DatasetError("a file dataset needs data.path (a .jsonl / .parquet file or a directory of them)")
        if fmt != "auto" and data_cfg.format not in ("auto", fmt):
            raise DatasetError(f"data.format is {data_cfg.format!r} but the prompt source is {fmt!r}; "
                               f"set data.format: auto or {fmt}")
        self.cfg, self.tokenizer = data_cfg, tokenizer
        self.use_template = data_cfg.apply_chat_template
        if self.use_template and not getattr(tokenizer, "chat_template", None):
            raise DatasetError("data.apply_chat_template is true but the tokenizer has no chat template; set "
                               "data.apply_chat_template: false to tokenize string prompts as plain text")
        if data_cfg.system_prompt and not self.use_template:
            raise DatasetError("data.system_prompt is set but data.apply_chat_template is false; the system "
                               "prompt is a chat message, so it needs the chat template")
        self.files = resolve_files(data_cfg.path, fmt if data_cfg.format == "auto" else data_cfg.format)
        self._tokens = array("i")
        self._offsets = array("q", [0])
        self.answers: list | None = [] if data_cfg.answer_key else None
        """Per row: the answer string, or a dict with its data source and extra info (:func:`row_answer`)."""
        self.sources: list[tuple[str, int]] = []
        """``(file, row)`` of each prompt, as errors name them."""
        for file, file_fmt in self.files:
            self._load(file, file_fmt)
        if not self.sources:
            raise DatasetError(f"{data_cfg.path}: the dataset has no rows")
        self.max_prompt_len = int(np.diff(np.frombuffer(self._offsets, dtype=np.int64)).max())

    def _load(self, file: Path, fmt: str) -> None:
        keys = {self.cfg.prompt_key: "", **({self.cfg.answer_key: ANSWER_HINT} if self.cfg.answer_key else {})}
        optional = tuple(k for k in (self.cfg.data_source_key, self.cfg.extra_info_key) if k)
        rows = _jsonl_rows(file) if fmt == "jsonl" else _parquet_rows(file, keys, optional)
        name = str(file)
        for number, row in rows:
            where = f"{name} row {number}"
            prompt = _check_prompt(_field(row, self.cfg.prompt_key, where), self.cfg.prompt_key, where)
            if self.answers is not None:
                value = _field(row, self.cfg.answer_key, where, ANSWER_HINT)
                answer = row_answer(_check_answer(value, self.cfg.answer_key, where),
                                    _optional_field(row, self.cfg.data_source_key),
                                    _optional_field(row, self.cfg.extra_info_key))
            ids = self.encode(prompt, where)
            if len(ids) > self.cfg.max_prompt_len:
                raise DatasetError(f"{where}: field {self.cfg.prompt_key!r} is {len(ids)} tokens"
                                   f"{' with the chat template' if self.use_template else ''}, longer than "
                                   f"data.max_prompt_len={self.cfg.max_prompt_len}")
            self._tokens.extend(ids)
            self._offsets.append(len(self._tokens))
            if self.answers is not None:
                self.answers.append(answer)
            self.sources.append((name, number))

    def encode(self, prompt: str | list[dict], where: str = "prompt") -> list[int]:
        """Token ids of one prompt: through the chat template (with the generation prompt and
        ``data.system_prompt`` unless the conversation has its own system message), or as plain text."""
        key = self.cfg.prompt_key
        if not self.use_template:
            if not isinstance(prompt, str):
                raise DatasetError(f"{where}: field {key!r} is a list of chat messages but "
                                   f"data.apply_chat_template is false")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if self.cfg.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
            try:
                out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001 - a template error is a property of this row
                raise DatasetError(f"{where}: field {key!r}: the chat template failed ({type(exc).__name__}: "
                                   f"{exc})") from exc
            # transformers >= 5 returns a BatchEncoding, older versions a list of ids.
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if not ids:
            raise DatasetError(f"{where}: field {key!r} is empty after tokenization")
        return ids

    def __len__(self) -> int:
        return len(self.sources)

    def prompt(self, index: int) -> list[int]:
        """Token ids of prompt ``index`` (in file order)."""
        return self._tokens[self._offsets[index] : self._offsets[index + 1]].tolist()


class FilePrompts:
    """An endless, seeded stream over a :class:`PromptDataset`: each epoch visits every row once, in an
    order reshuffled per epoch from ``(seed, epoch)`` (file order when ``data.shuffle`` is false)."""

    def __init__(self, tokenizer, seed: int = 0, data_cfg: DataConfig | None = None, fmt: str = "auto"):
        self.dataset = PromptDataset(tokenizer, data_cfg, fmt)
        self.seed, self.shuffle = seed, data_cfg.shuffle
        self.max_prompt_len = self.dataset.max_prompt_len
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed % (1 << 64), epoch]).permutation(len(self.dataset))

    def _take(self, count: int) -> list[int]:
        indexes = []
        while len(indexes) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            step = min(count - len(indexes), len(self._order) - self.position)
            indexes.extend(self._order[self.position : self.position + step].tolist())
            self.position += step
        return indexes

    def next_prompts(self, count: int) -> list[list[int]]:
        """The next ``count`` prompts of the stream, as token ids."""
        return [self.dataset.prompt(i) for i in self._take(count)]

    def state_dict(self) -> dict:
        """The stream's position (for checkpoints): restoring it continues with the same next prompt."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "rows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position saved by :meth:`state_dict` (same dataset and seed)."""
        if state["rows"] != len(self.dataset) or state["seed"] != self.seed:
            raise DatasetError(f"cannot resume the data stream: saved for {state['rows']} rows with seed "
                               f"{state['seed']}, this dataset has {len(self.dataset)} rows with seed {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)


class FilePromptsWithAnswers(FilePrompts):
    """A :class:`FilePrompts` whose rows carry reference answers (``data.answer_key`` is set)."""

    def next_batch(self, count: int) -> tuple[list[list[int]], list]:
        """The next ``count`` prompts and their reference answers (strings, or dicts: :func:`row_answer`)."""
        indexes = self._take(count)
        return [self.dataset.prompt(i) for i in indexes], [self.dataset.answers[i] for i in indexes]


def make_file_source(tokenizer, seed: int = 0, data_cfg: DataConfig | None = None, fmt: str = "auto") -> FilePrompts:
    """A file prompt source; it offers ``next_batch`` (answers for the reward) when ``data.answer_key`` is set."""
    has_answers = data_cfg is not None and bool(data_cfg.answer_key)
    return (FilePromptsWithAnswers if has_answers else FilePrompts)(tokenizer, seed, data_cfg, fmt)


def jsonl_prompts(tokenizer, seed: int = 0, data_cfg: DataConfig | None = None) -> FilePrompts:
    """Prompts from a .jsonl file (or a directory of them): one JSON object per line."""
    return make_file_source(tokenizer, seed, data_cfg, "jsonl")


def parquet_prompts(tokenizer, seed: int = 0, data_cfg: DataConfig | None = None) -> FilePrompts:
    """Prompts from a .parquet file (or a directory of them), such as verl's preprocessed datasets."""
    return make_file_source(tokenizer, seed, data_cfg, "parquet")
