"""GSM8K-style rows (``question``, and ``answer`` ending in ``#### 42``) converted into the rows the file prompt
sources read: a chat prompt asking for a boxed final answer, ``ground_truth``, ``data_source`` and ``extra_info``
(verl's names, so a verl ``compute_score`` reads them as it does there).

The input is the file a user has: the HF ``openai/gsm8k`` jsonl or parquet (``main/train-*.parquet``), or any
jsonl/parquet with those two fields. ``tools/prepare_gsm8k.py`` is the command line around :func:`convert`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
"""Appended to each question: the ``math`` reward reads the response's last ``\\boxed{...}``."""
DATA_SOURCE = "openai/gsm8k"


class Gsm8kError(ValueError):
    """A row that is not a GSM8K row: the message names the file, the row and the field."""


def final_answer(answer: str, where: str = "row") -> str:
    """The number after the last ``####`` of a GSM8K answer, thousands separators removed (``1,000`` -> ``1000``)."""
    if "####" not in answer:
        raise Gsm8kError(f"{where}: field 'answer' has no '#### <final answer>' line")
    value = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not value:
        raise Gsm8kError(f"{where}: field 'answer' is empty after '####'")
    return value


def convert_row(row: dict, index: int, split: str, where: str = "row") -> dict:
    """One GSM8K row as a prompt-source row."""
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise Gsm8kError(f"{where}: expected a non-empty string field {key!r} (fields present: "
                             f"{', '.join(map(str, row)) or 'none'})")
    question = row["question"].strip()
    return {"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ground_truth": final_answer(row["answer"], where), "data_source": DATA_SOURCE,
            "extra_info": {"split": split, "index": index, "question": question, "answer": row["answer"]}}


def read_rows(path: Path) -> Iterator[dict]:
    """The rows of a jsonl or parquet file (by extension)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path, columns=["question", "answer"]).to_pylist()
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_rows(rows: list[dict], path: Path) -> None:
    """``rows`` as jsonl or parquet (by ``path``'s extension)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def convert(src: str | Path, out: str | Path, split: str = "train", limit: int | None = None) -> int:
    """Convert GSM8K file ``src`` (jsonl or parquet) into ``out`` (jsonl or parquet); returns the rows written."""
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise Gsm8kError(f"{src}: no such file")
    rows = []
    for i, row in enumerate(read_rows(src)):
        if limit is not None and i >= limit:
            break
        rows.append(convert_row(row, i, split, f"{src} row {i}"))
    if not rows:
        raise Gsm8kError(f"{src}: no rows")
    write_rows(rows, out)
    return len(rows)
