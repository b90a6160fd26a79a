#!/usr/bin/env python
"""Write a tiny random Llama / Qwen2 / Qwen3 model in Hugging Face format with a local tokenizer.

    python tools/make_tiny_model.py OUT_DIR [--family qwen2] [--hidden 64] [--layers 2] [--heads 2]
                                            [--kv-heads 1] [--ffn 256] [--charset add1|ascii] [--tied]
"""

import argparse
import sys

from asyncflow.tiny_model import CHARSETS, FAMILIES, make_tiny_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2")
    parser.add_argument("--charset", choices=sorted(CHARSETS), default="add1")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(
            args.out_dir, family=args.family, charset=args.charset, hidden_size=args.hidden,
            num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
            intermediate_size=args.ffn, tie_word_embeddings=args.tied, seed=args.seed,
        )
    except ValueError as exc:
        print(f"make_tiny_model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.family} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
