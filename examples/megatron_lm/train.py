"""Run a Megatron-LM pretraining script's arguments as RL post-training (``asyncflow.train``).

``pretrain_gpt.sh`` passes its flags here. With Megatron-LM installed, its own parser reads them
(``megatron.training.arguments``); without it, ``_stand_in_parser`` declares the flags that script uses, with
Megatron-LM's names and defaults. Either way the parsed namespace goes to ``asyncflow.train(megatron_args=...)``,
which maps each argument to an AsyncFlow key or refuses it, together with the model provider of ``provider.py``.
The RL task is the tiny recipe's (add-one prompts and reward); pass ``prompts=`` and ``reward=`` for your own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/tiny_cpu/grpo_async.yaml"


def _stand_in_parser() -> argparse.ArgumentParser:
    """The flags of ``pretrain_gpt.sh`` with Megatron-LM's destinations and defaults."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--seq-length",
                 "--train-iters", "--save-interval"):
        p.add_argument(flag, type=int, default=None)
    for flag in ("--group-query-attention", "--swiglu", "--add-qkv-bias", "--untie-embeddings-and-output-weights"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--position-embedding-type", default="learned_absolute")
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--normalization", default="LayerNorm")
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--lr-decay-style", default="linear")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--save", default=None)
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(megatron_args, own)``: Megatron-LM's namespace and this script's ``--asyncflow-*`` flags."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--asyncflow-model", default="outputs/tiny_model", help="Hugging Face model folder")
    own.add_argument("--asyncflow-output", default="outputs/megatron_lm", help="metrics and summary folder")
    own.add_argument("--asyncflow-dry-run", action="store_true", help="print the resolved config and stop")
    mine, rest = own.parse_known_args(argv)
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:  # megatron-core alone (the CPU stack)
        parser = _stand_in_parser()
    else:
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return parser.parse_args(rest), mine


def main(argv: list[str] | None = None) -> int:
    from provider import model_provider  # this folder is sys.path[0]; asyncflow.train exports it to the workers

    import asyncflow
    from asyncflow.config_loader import dump_yaml

    megatron_args, own = parse_args(sys.argv[1:] if argv is None else argv)
    hooks = dict(megatron_args=megatron_args, model_provider=model_provider,
                 overrides=[f"model.path={own.asyncflow_model}", f"observability.output_dir={own.asyncflow_output}"])
    if own.asyncflow_dry_run:
        print(dump_yaml(asyncflow.build_config(RECIPE, **hooks)), end="")
        return 0
    summary = asyncflow.train(RECIPE, **hooks)
    print(f"{summary['steps']} steps; reward {summary['reward_first']:.3f} -> {summary['reward_last10_mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
