#!/usr/bin/env python
"""Convert checkpoints: Hugging Face <-> Megatron distributed checkpoint (any TP/PP/EP), streamed.

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2 [--ep 2]
    python tools/convert_checkpoint.py mcore-to-hf --mcore DIR --out DIR [--hf-config DIR]

The library code is ``asyncflow.bridge.checkpoint``; wrong inputs end with one ``error:`` line and leave
no output directory behind.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run one conversion, return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="Hugging Face safetensors -> Megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, help="Hugging Face model directory")
    h2m.add_argument("--out", required=True, help="new directory for the Megatron checkpoint")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size the writers use")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the writers use")
    h2m.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    h2m.add_argument("--layers-per-stage", default=None, help="uneven pipeline stages, e.g. 5,6,6,5")
    h2m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m2h = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> Hugging Face safetensors")
    m2h.add_argument("--mcore", required=True, help="Megatron distributed checkpoint directory")
    m2h.add_argument("--out", required=True, help="new directory for the Hugging Face model")
    m2h.add_argument(
        "--hf-config",
        default=None,
        help="Hugging Face directory to take config and tokenizer files from, never its weights "
        "(default: the copy hf-to-mcore stored inside the checkpoint)",
    )
    m2h.add_argument("--max-shard-size-gb", type=float, default=5.0, help="size cap of each safetensors file")
    args = parser.parse_args(argv)

    from asyncflow.bridge.checkpoint import ConversionError, hf_to_mcore, mcore_to_hf
    from asyncflow.bridge.shards import ParallelLayout

    try:
        if args.cmd == "hf-to-mcore":
            stages = (
                tuple(int(x) for x in args.layers_per_stage.split(",")) if args.layers_per_stage else None
            )
            layout = ParallelLayout(args.tp, args.pp, args.ep, stages, args.make_vocab_size_divisible_by)
            hf_to_mcore(args.hf, args.out, layout)
        else:
            mcore_to_hf(args.mcore, args.out, args.hf_config, int(args.max_shard_size_gb * 2**30))
    except (ConversionError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
