#!/usr/bin/env python
"""Convert a GSM8K file you have (HF ``openai/gsm8k`` jsonl or parquet: ``question``, ``answer`` ending in
``#### 42``) into the rows ``workflow.task: jsonl | parquet`` reads (``asyncflow.data.gsm8k``).

    python tools/prepare_gsm8k.py SRC OUT [--split train] [--limit N]

OUT's extension picks the format (.jsonl or .parquet). Then train with ``data.path=OUT`` (examples/math_gsm8k).
"""

import argparse
import sys

from asyncflow.data.gsm8k import Gsm8kError, convert


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="GSM8K jsonl or parquet file")
    parser.add_argument("out", help="where to write the rows (.jsonl or .parquet)")
    parser.add_argument("--split", default="train", help="recorded in each row's extra_info")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N rows")
    args = parser.parse_args(argv)
    try:
        rows = convert(args.src, args.out, args.split, args.limit)
    except (Gsm8kError, OSError, ValueError) as exc:
        print(f"prepare_gsm8k: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {rows} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
