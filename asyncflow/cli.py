"""The ``asyncflow`` command line.

    asyncflow train CONFIG [--resume] [section.key=value ...]   RL training (GRPO, PPO, DAPO...; async or sync)
    asyncflow demo [CONFIG] [section.key=value ...]     train with Megatron, move weights, generate with vLLM
    asyncflow config show [CONFIG] [section.key=value ...]   print the resolved configuration as YAML
    asyncflow config keys [SECTION]     every key with its type, default and documentation
    asyncflow plan RECIPE [section.key=value ...]    per-device memory of a cluster recipe; exit 1 if it does not fit
    asyncflow profile [CONFIG] [section.key=value ...] --out FILE   measure this machine's cost model (JSON)
    asyncflow simulate RECIPE --costs FILE [section.key=value ...]  predict a run; search the device split
"""

from __future__ import annotations

import argparse
import sys

from asyncflow.config import ConfigError, load_config
from asyncflow.config_loader import ConfigSyntaxError
from asyncflow.workflow.checkpoints import CheckpointError
from asyncflow.workflow.errors import ClusterUnreachableError, NodePathError, WeightApplyError, WorkerDiedError
from asyncflow.workflow.sampling import SamplingBudgetError


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is a config file unless it looks like an override (contains '=')."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _cmd_config_show(args: argparse.Namespace) -> int:
    from asyncflow.config_loader import dump_yaml
    from asyncflow.workflow.network import rule

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    print(dump_yaml(cfg), end="")
    # Not settings: what the run decides at start from the Ray cluster it finds (printed again then, as chosen).
    print("# resolved at start:\n" + "".join(f"#   {line}\n" for line in rule(cfg)), end="")
    return 0


def _cmd_config_keys(args: argparse.Namespace) -> int:
    from asyncflow.config_keys import render

    print(render(args.section), end="")
    return 0


def _refuse(problems: list[str]) -> int:
    for problem in problems:
        print(f"asyncflow: error: {problem}", file=sys.stderr)
    return 2


def _checks_before_train(cfg, path: str | None, overrides: list[str]) -> list[str]:
    """What ``train`` would otherwise find minutes later inside an actor: the model path, and the recipe and
    layout checks of ``asyncflow.recipes_check`` (the launcher's and ``asyncflow plan``'s). The rules between config
    keys ran when the config was loaded."""
    from asyncflow.recipes_check import check_model_path, check_run
    from asyncflow.tiny_model import ensure_model

    problems = check_model_path(cfg) + _check_data_path(cfg) + _check_val_path(cfg) + _check_plugins(cfg)
    if problems:
        return problems
    ensure_model(cfg.model)  # a tiny model, where the recipe asks for one, so that its layout can be checked too
    return check_run(cfg, path, overrides)


def _check_data_path(cfg) -> list[str]:
    """A file dataset (``workflow.task: jsonl`` or ``parquet``) must name files that exist; otherwise the prompt
    source would fail inside the run, after Ray and the engines have started."""
    from asyncflow.data.datasets import DatasetError, resolve_files

    if cfg.workflow.task not in ("jsonl", "parquet"):
        return []
    if not cfg.data.path:
        return [f"workflow.task={cfg.workflow.task} needs data.path (a .{cfg.workflow.task} file or a directory "
                "of them); set data.path=FILE"]
    try:
        resolve_files(cfg.data.path, cfg.workflow.task if cfg.data.format == "auto" else cfg.data.format)
    except DatasetError as exc:
        return [f"{exc}; workflow.task={cfg.workflow.task} reads its prompts from data.path"]
    return []


def _check_val_path(cfg) -> list[str]:
    """A validation set (``data.val_path``) of an evaluating run must name files that exist."""
    from asyncflow.data.datasets import DatasetError, resolve_files

    if not cfg.data.val_path or not (cfg.workflow.eval_every or cfg.workflow.eval_before_train):
        return []
    try:
        resolve_files(cfg.data.val_path, cfg.data.format)
    except DatasetError as exc:
        return [f"{str(exc).replace('(data.path)', '(data.val_path)')}; data.val_path is the validation set of "
                "workflow.eval_every"]
    return []


def _check_plugins(cfg) -> list[str]:
    """Every engine, prompt source, reward and agent loop the config names must be a registered name or, on a
    local Ray cluster (whose workers share this process's environment), a dotted path that imports here; otherwise
    the worker that loads it would fail after start-up, with a traceback from inside an actor."""
    from asyncflow.agents import AGENT_LOOPS
    from asyncflow.data.sources import PROMPT_SOURCES
    from asyncflow.engines.base import CRITIC_ENGINES, ROLLOUT_ENGINES, TRAIN_ENGINES
    from asyncflow.registry import RegistryError, load_object
    from asyncflow.rewards.registry import REWARD_FUNCTIONS, resolve_reward

    named = [("trainer.engine", TRAIN_ENGINES, cfg.trainer.engine), ("critic.engine", CRITIC_ENGINES,
             cfg.critic.engine), ("rollout.engine", ROLLOUT_ENGINES, cfg.rollout.engine),
             ("workflow.task", PROMPT_SOURCES, cfg.workflow.task), ("algorithm.reward", REWARD_FUNCTIONS,
             cfg.algorithm.reward), ("agent.loop", AGENT_LOOPS, cfg.agent.loop)]
    problems = []
    for key, registry, spec in named:
        if spec is None or spec in registry:
            continue
        if "." not in spec and ":" not in spec:
            problems.append(f"{key}={spec}: unknown {registry.kind}; valid: {', '.join(registry.names())}, or a "
                            "dotted path (package.module:attribute) to your own")
        elif cfg.ray.address is None:
            try:
                (resolve_reward if registry is REWARD_FUNCTIONS else load_object)(spec)
            except RegistryError as exc:
                problems.append(f"{key}={spec}: {exc} (the module must be importable here: install it, or put its "
                                "folder on PYTHONPATH)")
    return problems


def final_line(summary: dict) -> str:
    """The line ``train`` ends with: steps, time, reward and lag, each saying over what it was measured."""
    tail = summary.get("reward_tail_steps", min(summary["steps"], 10))
    return (f"finished {summary['steps']} steps in {summary['wall_s']:.1f} s: reward {summary['reward_first']:.3f} "
            f"(first step) -> {summary['reward_last10_mean']:.3f} (mean of the last {tail} "
            f"step{'s' if tail != 1 else ''}); max version lag {summary['max_version_lag']:.0f}")


def resume_command(path: str | None, overrides: list[str]) -> str:
    """The command that resumes a stopped ``asyncflow train`` run with the same config and overrides."""
    import shlex

    return shlex.join(["asyncflow", "train", *([path] if path else []), "--resume", *overrides])


def _cmd_train(args: argparse.Namespace) -> int:
    from asyncflow.workflow.loop import train
    from asyncflow.workflow.signals import RunStopped, stopped_line

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    problems = _checks_before_train(cfg, path, overrides)
    if problems:
        return _refuse(problems)
    try:
        summary = train(cfg, resume=args.resume)
    except RunStopped as stop:
        print(stopped_line(stop, resume_command(path, overrides)), flush=True)
        return stop.exit_code
    print(final_line(summary), flush=True)
    if summary.get("fresh_logprob_gap_max") is not None:
        print(f"|vLLM logprob - Megatron logprob| on the {summary['fresh_logprob_gap_tokens']:.0f} tokens trained by "
              f"the weights that generated them: mean {summary['fresh_logprob_gap_mean']:.2e}, p99 "
              f"{summary['fresh_logprob_gap_p99']:.2e}, max {summary['fresh_logprob_gap_max']:.2e}", flush=True)
        for problem in summary.get("fresh_logprob_gap_problems", []):
            print(f"asyncflow: warning: {problem}", flush=True)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from asyncflow.demo import run_demo
    from asyncflow.recipes_check import check_model_path

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    if problems := check_model_path(cfg):
        return _refuse(problems)
    summary = run_demo(cfg)
    return 0 if summary["max_abs_logprob_diff"] < 1e-5 or args.no_check else 1


def _cmd_plan(args: argparse.Namespace) -> int:
    from asyncflow.planner.plan import run

    return run(args.recipe, args.overrides)


def _cmd_profile(args: argparse.Namespace) -> int:
    from asyncflow.recipes_check import check_model_path
    from asyncflow.simulator.profile import profile

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    if problems := check_model_path(cfg):
        return _refuse(problems)
    variants = args.variants.split(",") if args.variants else None
    costs = profile(cfg, args.out, variants=variants, reps=args.reps, quick=args.quick)
    print(f"wrote {args.out}: variants {', '.join(costs.variants)} in {costs.hardware['seconds']:.0f} s "
          f"(load average before/after {costs.hardware['loadavg_before'][0]:.1f}/"
          f"{costs.hardware['loadavg_after'][0]:.1f})", flush=True)
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    from asyncflow.workflow.supervisor import request_scale

    name, _, value = args.target.partition("=")
    if name != "rollout" or not value.isdigit() or int(value) < 1:
        print(f"asyncflow: error: scale takes rollout=N with N >= 1, got {args.target!r}", file=sys.stderr)
        return 2
    try:
        request_scale(args.run, int(value))
    except FileNotFoundError as exc:
        print(f"asyncflow: error: {exc}", file=sys.stderr)
        return 2
    print(f"asked the run writing to {args.run} for {value} rollout instance(s); it prints what it does", flush=True)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from asyncflow.simulator.report import run

    replay = args.lengths.removeprefix("replay:") if args.lengths and args.lengths.startswith("replay:") else None
    if not args.costs.startswith("published:") and not Path(args.costs).is_file():
        return _refuse([f"--costs {args.costs} does not exist; write one with `asyncflow profile --out {args.costs}`"])
    if replay is not None and not Path(replay).is_file():
        return _refuse([f"--lengths replay:{replay}: no such file (the metrics.jsonl of a run, under its "
                        "observability.output_dir)"])
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    parser = argparse.ArgumentParser(prog="asyncflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="RL post-training (see recipes/)")
    train.add_argument("items", nargs="*", metavar="CONFIG|key=value", help="YAML file, then overrides")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint under checkpoint.dir (fresh if none)")
    train.set_defaults(func=_cmd_train)

    demo = sub.add_parser("demo", help="Megatron trains a tiny model, weights move to vLLM, logprobs compared")
    demo.add_argument("items", nargs="*", metavar="CONFIG|key=value", help="optional YAML file, then overrides")
    demo.add_argument("--no-check", action="store_true", help="exit 0 even if logprobs disagree by >= 1e-5")
    demo.set_defaults(func=_cmd_demo)

    plan = sub.add_parser("plan", help="per-device memory of a cluster recipe's tasks against DEVICE_MEMORY_GB "
                          "(see docs/recipes.md); exit 1 when a task does not fit")
    plan.add_argument("recipe", metavar="RECIPE", help="recipe directory (recipes/<model>)")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for the launcher")
    plan.set_defaults(func=_cmd_plan)

    prof = sub.add_parser("profile", help="measure this machine's cost model (rollout, trainer, weight sync, "
                          "TransferQueue) along the real code paths and write it as JSON")
    prof.add_argument("items", nargs="*", metavar="CONFIG|key=value", help="optional YAML file, then overrides")
    prof.add_argument("--out", default="outputs/costs.json", help="cost file to write")
    prof.add_argument("--variants", default=None,
                      help="comma-separated: threads per worker on CPU (default 1,2), or 'device' on a GPU node")
    prof.add_argument("--reps", type=int, default=5,
                      help="timings per grid point (the median is kept)")
    prof.add_argument("--quick", action="store_true", help="a smaller measurement grid (about half the time)")
    prof.set_defaults(func=_cmd_profile)

    simulate = sub.add_parser("simulate", help="discrete-event prediction of a run (step time, samples/s, idle, "
                              "version lag), a Gantt chart, and the best device split")
    simulate.add_argument("recipe", metavar="RECIPE", help="recipe directory (recipes/<model>) or YAML config")
    simulate.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    simulate.add_argument("--costs", required=True, help="cost file from asyncflow profile, or published:h100 / "
                          "published:h20: costs from the GPU's published figures for the recipe's model")
    simulate.add_argument("--lengths", default=None,
                          help="response lengths: constant:N, lognormal:MEDIAN:SIGMA, replay:metrics.jsonl or "
                          "heavytail (the published runs' heavy tail: mean max_new_tokens / 18)")
    simulate.add_argument("--prompt-len", type=int, default=None,
                          help="prompt tokens per row (default: data.max_prompt_len for jsonl/parquet tasks)")
    simulate.add_argument("--steps", type=int, default=None, help="simulated steps (default: workflow.steps, "
                          "at most 50)")
    simulate.add_argument("--devices", type=int, default=None,
                          help="search the split of this many devices between rollout and training")
    simulate.add_argument("--modes", action="store_true", help="also search the sample stream's rollout share "
                          "(down to 1/4), rollout mode and staleness against the colocated baseline")
    simulate.add_argument("--out", default="outputs/simulate", help="folder for timeline.png / timeline.json")
    simulate.set_defaults(func=_cmd_simulate)

    scale = sub.add_parser("scale", help="change the number of rollout instances of a running async run "
                           "(docs/fault_tolerance.md)")
    scale.add_argument("run", metavar="RUN", help="the run's output directory (observability.output_dir)")
    scale.add_argument("target", metavar="rollout=N", help="the rollout instances wanted")
    scale.set_defaults(func=_cmd_scale)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved configuration (defaults + file + overrides)")
    show.add_argument("items", nargs="*", metavar="CONFIG|key=value", help="optional YAML file, then overrides")
    show.set_defaults(func=_cmd_config_show)
    keys = config_sub.add_parser("keys", help="every key with its type, default and documentation")
    keys.add_argument("section", nargs="?", metavar="SECTION", help="one section (trainer, critic, rollout, ...)")
    keys.set_defaults(func=_cmd_config_keys)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asyncflow`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (loading, checks): one line, no traceback
        print("asyncflow: interrupted", file=sys.stderr)
        return 130
    except ConfigSyntaxError as exc:  # file:line:column first, so that editors and terminals link to the spot
        print(f"asyncflow: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"asyncflow: config error: {exc}", file=sys.stderr)
        return 2
    except (SamplingBudgetError, CheckpointError, WeightApplyError, WorkerDiedError, NodePathError,
            ClusterUnreachableError) as exc:
        # The message says what failed or what to change; no traceback. Errors raised inside a Ray actor come
        # wrapped: print the service's own message.
        cause = getattr(exc, "cause", None)
        print(f"asyncflow: error: {cause if isinstance(cause, BaseException) else exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
