"""Static checks of a cluster recipe (``recipes/<model>/``) that need neither the weights nor a cluster.

A recipe directory holds ``config.yaml`` (an ``AsyncFlowConfig``), ``model_arch.json`` (the model's public
``config.json`` facts), ``cluster.env`` (nodes, devices per node and the trainer / rollout device split, which
``AsyncFlowConfig`` has no fields for) and ``launch.sh``.
``check_recipe`` returns every problem found, each naming the recipe, the key and the numbers; the launcher
runs it before it starts Ray, and ``tests/recipes`` runs it on every recipe of the repository.

The divisibility rules are Megatron-core's (``TransformerConfig.__post_init__`` and
``parallel_state.initialize_model_parallel``) and vLLM's (attention heads split over its TP ranks):

- TP divides the attention heads and the MLP width; the KV heads (query groups) are a multiple or a divisor
  of TP (fewer KV heads than TP ranks are replicated).
- PP divides the layers.
- EP divides the routed experts; Megatron builds a second rank grid for the experts, ETP x EP x PP, which
  must divide the trainer's world TP x PP x CP x DP (the trainer never sets ETP, so Megatron uses TP).
- Trainer devices = TP x PP x CP x DP (the expert grid reuses these ranks); rollout devices = instances x
  rollout TP; in async mode the two sets are disjoint and together fit in nodes x devices per node.
- The memory features of the trainer and critic (``asyncflow.engines.megatron.features``) are checked as a GPU
  cluster with Transformer Engine runs them (MoE at TP > 1 needs sequence parallelism).

Rules between config keys alone (sizes at least 1, whole micro-batches per step, room for the prompt in
``rollout.max_model_len``, ...) are ``asyncflow.config_rules``'s: ``load_config`` runs them, so a recipe that
breaks one reports it as a ``config.yaml`` problem. The checks here need the model facts or ``cluster.env``.

``asyncflow plan`` (``asyncflow.planner``) reads recipes through ``load_recipe`` and adds the memory check
against ``DEVICE_MEMORY_GB``.

    python -m asyncflow.recipes_check recipes/qwen2.5-7b [--model-dir DIR] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from asyncflow.config import AsyncFlowConfig, ConfigError, load_config

__all__ = ["ClusterSpec", "Recipe", "check_layout", "check_loaded", "check_model_path", "check_recipe", "check_run",
           "load_recipe", "read_cluster_env", "main"]

RECIPE_FILES = ("config.yaml", "model_arch.json", "cluster.env", "launch.sh")

# A cluster.env line that bash and this parser read the same way: KEY=VALUE, no expansion, optional comment.
_ENV_LINE = re.compile(
    r"""^(?:export\s+)?(?P<key>[A-Z_][A-Z0-9_]*)=(?P<value>"[^"$`\\]*"|'[^']*'|[^\s"'$`\\#;&|()<>]*)\s*(?:\#.*)?$"""
)
# Facts of model_arch.json that must match the checkpoint's config.json (the launcher compares them).
_ARCH_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
              "intermediate_size", "vocab_size", "num_experts", "moe_intermediate_size", "num_experts_per_tok")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The cluster shape of a recipe, from its ``cluster.env``."""

    nodes: int
    """Nodes of the Ray cluster (one Ray node per host)."""
    devices_per_node: int
    """Accelerators per node."""
    trainer_devices: int
    """Accelerators for the Megatron trainer (TP x PP x DP)."""
    rollout_devices: int
    """Accelerators for the vLLM rollout engines (instances x rollout TP)."""
    device_resource: str = "GPU"
    """Ray resource name of one accelerator (``GPU``; ``NPU`` on Ascend)."""
    device_memory_gb: float | None = None
    """Memory of one accelerator in GiB (``DEVICE_MEMORY_GB``; 80 for an H100 80GB), for ``asyncflow plan``."""

    @property
    def total_devices(self) -> int:
        """Accelerators of the whole cluster."""
        return self.nodes * self.devices_per_node


_ENV_FIELDS = {
    "NODES": "nodes",
    "DEVICES_PER_NODE": "devices_per_node",
    "TRAINER_DEVICES": "trainer_devices",
    "ROLLOUT_DEVICES": "rollout_devices",
}
_ENV_REQUIRED = ("NODES", "DEVICES_PER_NODE", "TRAINER_DEVICES", "ROLLOUT_DEVICES")
# The Ray resource name and memory (GiB) of a device; launcher settings (RAY_PORT, ...) come from the
# environment instead.
_ENV_OTHER = ("DEVICE_RESOURCE", "DEVICE_MEMORY_GB")


def read_cluster_env(path: str | Path) -> dict[str, str]:
    """Parse ``cluster.env``: ``KEY=VALUE`` lines, ``#`` comments, optional ``export``, no shell expansion.

    Raises ``ValueError`` naming the file and line for anything bash might read differently.
    """
    path = Path(path)
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if not match:
            raise ValueError(f"{path}:{number}: expected KEY=VALUE without shell expansion, got {raw!r}")
        value = match["value"]
        if value[:1] in ("'", '"'):
            value = value[1:-1]
        values[match["key"]] = value
    return values


def _cluster_spec(env: dict[str, str], name: str) -> tuple[ClusterSpec | None, list[str]]:
    problems = [f"{name}: cluster.env: {key} is missing" for key in _ENV_REQUIRED if key not in env]
    problems += [f"{name}: cluster.env: unknown variable {key}; known: {', '.join([*_ENV_FIELDS, *_ENV_OTHER])}"
                 for key in env if key not in _ENV_FIELDS and key not in _ENV_OTHER]
    kwargs: dict[str, object] = {}
    for key, attr in _ENV_FIELDS.items():
        if key not in env:
            continue
        if not env[key].isdigit() or int(env[key]) < 1:
            problems.append(f"{name}: cluster.env: {key}={env[key]!r} must be a positive integer")
            continue
        kwargs[attr] = int(env[key])
    if "DEVICE_RESOURCE" in env:
        kwargs["device_resource"] = env["DEVICE_RESOURCE"]
    if "DEVICE_MEMORY_GB" in env:
        try:
            kwargs["device_memory_gb"] = float(env["DEVICE_MEMORY_GB"])
        except ValueError:
            kwargs["device_memory_gb"] = 0.0
        if not kwargs["device_memory_gb"] > 0:
            problems.append(f"{name}: cluster.env: DEVICE_MEMORY_GB={env['DEVICE_MEMORY_GB']!r} must be a "
                            "positive number (GiB per device)")
    if problems:
        return None, problems
    return ClusterSpec(**kwargs), []


def _divides(small: int, big: int) -> bool:
    return small > 0 and big % small == 0


def _check_attention(name: str, key: str, tp: int, arch) -> list[str]:
    """Megatron and vLLM split the heads over TP; KV heads are split or replicated."""
    problems = []
    if not _divides(tp, arch.num_attention_heads):
        problems.append(f"{name}: {key}={tp} does not divide num_attention_heads={arch.num_attention_heads}")
    kv = arch.num_query_groups
    if kv % tp and tp % kv:
        problems.append(f"{name}: {key}={tp} and num_key_value_heads={kv}: one must divide the other "
                        "(GQA: KV heads are split over TP ranks, or replicated when fewer than TP)")
    return problems


def _expert_sizes(cfg: AsyncFlowConfig) -> tuple[int, int]:
    """EP and expert TP of the trainer. ``MegatronConfig`` has no expert-TP field and the trainer never passes
    ``expert_tensor_parallel_size`` to ``initialize_model_parallel``, so Megatron uses the trainer's TP."""
    return cfg.trainer.expert_parallel, cfg.trainer.tensor_parallel


def _uses_critic(cfg: AsyncFlowConfig) -> bool:
    from asyncflow.algorithms.advantages import estimator_scope

    return estimator_scope(cfg.algorithm.advantage) == "critic"


def _check_features(name: str, section: str, mcfg, arch) -> list[str]:
    """The memory features of a trained model as a GPU cluster with Transformer Engine would run them."""
    from asyncflow.engines.megatron.features import problems

    return [f"{name}: {problem}" for problem in problems(mcfg, section, is_moe=arch.is_moe, cuda=True, te=True)]


def _check_trainer(name: str, cfg: AsyncFlowConfig, arch, cluster: ClusterSpec | None,
                   features: bool = True) -> list[str]:
    """The trainer's sizes against the model, and against ``cluster`` when its devices are known."""
    tr = cfg.trainer
    tp, pp, cp, dp = tr.tensor_parallel, tr.pipeline_parallel, tr.context_parallel, tr.data_parallel
    problems = _check_attention(name, "trainer.tensor_parallel", tp, arch)
    if not _divides(tp, arch.ffn_hidden_size):
        problems.append(f"{name}: trainer.tensor_parallel={tp} does not divide "
                        f"intermediate_size={arch.ffn_hidden_size}")
    if not _divides(pp, arch.num_layers):
        problems.append(f"{name}: trainer.pipeline_parallel={pp} does not divide num_hidden_layers={arch.num_layers}")
    if cluster is not None and tp > cluster.devices_per_node:
        problems.append(f"{name}: trainer.tensor_parallel={tp} exceeds DEVICES_PER_NODE={cluster.devices_per_node} "
                        "(tensor-parallel all-reduces would cross nodes)")
    world = tp * pp * cp * dp
    if cluster is not None and world != cluster.trainer_devices:
        sizes = f"{tp} x {pp} x {dp}" if cp == 1 else f"{tp} x {pp} x {cp} x {dp}"
        factors = "pipeline_parallel x " + ("" if cp == 1 else "context_parallel x ") + "data_parallel"
        problems.append(f"{name}: trainer devices: TRAINER_DEVICES={cluster.trainer_devices} in cluster.env but "
                        f"trainer.tensor_parallel x {factors} = {sizes} = {world}")
    ep, etp = _expert_sizes(cfg)
    if arch.is_moe:
        if not _divides(ep, arch.num_experts):
            problems.append(f"{name}: trainer.expert_parallel={ep} does not divide num_experts={arch.num_experts}")
        if not _divides(etp, arch.moe_ffn_hidden_size):
            problems.append(f"{name}: expert tensor parallel ETP={etp} does not divide "
                            f"moe_intermediate_size={arch.moe_ffn_hidden_size}")
        if not _divides(etp * ep * pp, world):
            what = "TP x PP x DP" if cp == 1 else "TP x PP x CP x DP"
            problems.append(f"{name}: expert grid ETP x EP x PP = {etp} x {ep} x {pp} = {etp * ep * pp} does not "
                            f"divide the trainer's world {what} = {world} (Megatron initialize_model_parallel)")
    elif ep > 1:
        problems.append(f"{name}: trainer.expert_parallel={ep} on a dense model ({arch.model_type}); set it to 1")
    return problems + (_check_features(name, "trainer", tr, arch) if features else [])


def rollout_engines(cfg: AsyncFlowConfig) -> int:
    """Rollout engines that hold devices of their own: the instances and the warm spares."""
    return cfg.workflow.rollout_instances + cfg.workflow.rollout_spares


def _check_rollout(name: str, cfg: AsyncFlowConfig, arch, cluster: ClusterSpec | None) -> list[str]:
    """Rollout TP against the model, and against the device split of ``cluster`` (a recipe's)."""
    rtp = cfg.rollout.tensor_parallel
    problems = _check_attention(name, "rollout.tensor_parallel", rtp, arch)
    if cluster is None:
        pass
    elif not _divides(rtp, cluster.rollout_devices):
        problems.append(f"{name}: ROLLOUT_DEVICES={cluster.rollout_devices} is not divisible by "
                        f"rollout.tensor_parallel={rtp}")
    engines = rollout_engines(cfg) * rtp
    if cluster is not None and engines != cluster.rollout_devices:
        wf = cfg.workflow
        keys, counts = "workflow.rollout_instances", f"{wf.rollout_instances}"
        if wf.rollout_spares:  # warm spares hold devices of their own
            keys, counts = f"({keys} + workflow.rollout_spares)", f"({counts} + {wf.rollout_spares})"
        problems.append(f"{name}: rollout devices: ROLLOUT_DEVICES={cluster.rollout_devices} in cluster.env but "
                        f"{keys} x rollout.tensor_parallel = {counts} x {rtp} = {engines}")
    if cluster is not None and not _divides(rtp, cluster.devices_per_node):
        problems.append(f"{name}: rollout.tensor_parallel={rtp} does not divide DEVICES_PER_NODE="
                        f"{cluster.devices_per_node} (a vLLM engine would span two nodes)")
    return problems


def _check_devices(name: str, cfg: AsyncFlowConfig, cluster: ClusterSpec) -> list[str]:
    from asyncflow.workflow.placement import world_size

    problems = []
    if cfg.ray.accelerator != cluster.device_resource:
        problems.append(f"{name}: ray.accelerator={cfg.ray.accelerator!r} but DEVICE_RESOURCE="
                        f"{cluster.device_resource} in cluster.env (the placement group asks Ray for ray.accelerator)")
    # asyncflow.workflow.placement gives trainer ranks and rollout engines their own devices in both modes; a
    # critic shares the trainer's devices when its parallel sizes match the actor's, else it needs its own.
    needed, how = cluster.trainer_devices + cluster.rollout_devices, "trainer + rollout"
    if _uses_critic(cfg) and world_size(cfg.critic) != world_size(cfg.trainer):
        needed, how = needed + world_size(cfg.critic), how + " + critic"
    if cfg.algorithm.kl_coef > 0 and cfg.trainer.reference_placement == "own":
        needed, how = needed + world_size(cfg.trainer), how + " + reference"
    total = cluster.total_devices
    if needed > total:
        problems.append(f"{name}: too many devices: {how} = {needed} > NODES x DEVICES_PER_NODE = "
                        f"{cluster.nodes} x {cluster.devices_per_node} = {total}")
    return problems


def _compare_checkpoint(name: str, facts: dict, model_dir: Path) -> list[str]:
    path = model_dir / "config.json"
    if not path.is_file():
        return [f"{name}: model dir {model_dir} has no config.json"]
    actual = json.loads(path.read_text())
    return [f"{name}: {path}: {key}={actual.get(key)!r} but model_arch.json says {facts[key]!r} "
            "(is this the recipe's model?)"
            for key in _ARCH_KEYS if key in facts and actual.get(key) != facts[key]]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recipe directory, read: its config (with overrides), model facts, architecture and cluster."""

    name: str
    """The directory name (``qwen2.5-7b``); every problem starts with it."""
    cfg: AsyncFlowConfig
    """``config.yaml`` plus the overrides."""
    facts: dict
    """``model_arch.json`` as read."""
    arch: object
    """``GPTArch`` of ``model_arch.json``."""
    cluster: ClusterSpec
    """``cluster.env``."""


def load_recipe(recipe_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Recipe | None, list[str]]:
    """Read a recipe directory: ``(Recipe, [])``, or ``(None, problems)`` when a file is missing or invalid."""
    recipe = Path(recipe_dir)
    loaded, problems = _load(recipe, recipe.name, overrides)
    return (Recipe(recipe.name, *loaded) if loaded else None), problems


def _load(recipe: Path, name: str, overrides: list[str] | tuple[str, ...]):
    """Config, architecture and cluster of a recipe, or the problems that stop the checks."""
    from asyncflow.models.arch import GPTArch

    problems = [f"{name}: {f} is missing" for f in RECIPE_FILES if not (recipe / f).is_file()]
    if problems:
        return None, problems
    try:
        cfg = load_config(recipe / "config.yaml", overrides)
    except ConfigError as exc:
        problems.append(f"{name}: config.yaml: {exc}")
    try:
        facts = json.loads((recipe / "model_arch.json").read_text())
        arch = GPTArch.from_hf_config(facts)
    except (ValueError, KeyError) as exc:  # JSONDecodeError is a ValueError
        problems.append(f"{name}: model_arch.json: {type(exc).__name__}: {exc}")
    try:
        cluster, env_problems = _cluster_spec(read_cluster_env(recipe / "cluster.env"), name)
        problems += env_problems
    except ValueError as exc:
        problems.append(f"{name}: {exc}")
    if problems:
        return None, problems
    return (cfg, facts, arch, cluster), []


def check_recipe(recipe_dir: str | Path, model_dir: str | Path | None = None,
                 overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every problem of the recipe in ``recipe_dir`` (empty: it is consistent).

    Loads ``config.yaml`` plus ``overrides`` (``section.key=value``, as given to the launcher) with
    ``load_config`` (unknown keys are problems), reads ``model_arch.json`` with
    ``GPTArch.from_hf_config`` and ``cluster.env``, then checks the trainer's TP/PP/DP/EP against the heads,
    KV heads, MLP width, layers and experts, the rollout TP against the heads and the devices, and the device
    split against the cluster. With ``model_dir``, also compares its ``config.json`` with ``model_arch.json``.
    """
    recipe, problems = load_recipe(recipe_dir, overrides)
    if recipe is None:
        return problems
    return check_loaded(recipe, model_dir)


def check_loaded(recipe: Recipe, model_dir: str | Path | None = None) -> list[str]:
    """``check_recipe`` of an already read recipe (the planner checks the changes it tries this way)."""
    name, cfg, facts, arch, cluster = recipe.name, recipe.cfg, recipe.facts, recipe.arch, recipe.cluster
    problems = _check_trainer(name, cfg, arch, cluster)
    if _uses_critic(cfg):
        problems += _check_features(name, "critic", cfg.critic, arch)
    problems += _check_rollout(name, cfg, arch, cluster)
    problems += _check_devices(name, cfg, cluster)
    if model_dir is not None:
        problems += _compare_checkpoint(name, facts, Path(model_dir))
    return problems


def check_model_path(cfg: AsyncFlowConfig) -> list[str]:
    """``model.path`` must hold a Hugging Face ``config.json``, unless a tiny model may be created there; a
    ``trainer.load_dir`` must hold weights of its ``trainer.load_format``."""
    from asyncflow.engines.megatron.initial_weights import resolve

    if cfg.trainer.load_dir is not None or cfg.trainer.load_format != "auto":
        try:
            resolve(cfg.trainer.load_dir, cfg.trainer.load_format, cfg.model.path)
        except ConfigError as exc:
            return [str(exc)]
    path = Path(cfg.model.path)
    if (path / "config.json").is_file() and not cfg.trainer.model_provider:
        from asyncflow.models.arch import GPTArch
        from asyncflow.models.megatron import rope_scaling_kwargs

        try:
            rope_scaling_kwargs(GPTArch.from_pretrained(path))
        except ValueError as exc:
            return [f"model.path {path}: {exc}"]
    if (path / "config.json").is_file() or cfg.model.make_tiny_if_missing:
        return []
    what = "does not exist" if not path.exists() else "has no config.json"
    return [f"model.path {path} {what} (a Hugging Face model directory; the tiny CPU recipes set "
            "model.make_tiny_if_missing=true to create a random tiny model there)"]


def check_layout(name: str, cfg: AsyncFlowConfig, arch) -> list[str]:
    """The parallel layout of a run that is not a cluster recipe, against the model ``arch`` and, where a local Ray
    cluster declares its devices (``ray.accelerator`` with ``ray.local_devices``), against those devices."""
    from asyncflow.workflow.placement import world_size

    cluster, acc, sync = None, cfg.ray.accelerator, cfg.workflow.mode == "sync"
    if acc is not None and cfg.ray.address is None and cfg.ray.local_devices is not None:
        # Colocated sync gives rollout engines no devices of their own (asyncflow.workflow.placement).
        rollout = 0 if sync else rollout_engines(cfg) * cfg.rollout.tensor_parallel
        # Bundles of ray.device_fraction of a device: 1 / fraction of them fit on each device.
        slots = int(cfg.ray.local_devices / cfg.ray.device_fraction + 1e-9)
        cluster = ClusterSpec(nodes=1, devices_per_node=slots, trainer_devices=world_size(cfg.trainer),
                              rollout_devices=rollout, device_resource=acc)
    problems = _check_trainer(name, cfg, arch, cluster, features=False)
    problems += _check_rollout(name, cfg, arch, None)
    if cluster is not None:
        problems += _check_devices(name, cfg, cluster)
        # The shared checks speak of cluster.env; here the devices are the local cluster's ray.local_devices.
        problems = [p.replace("NODES x DEVICES_PER_NODE = 1 x ", "ray.local_devices = ")
                    .replace("DEVICES_PER_NODE", "ray.local_devices") for p in problems]
    return problems


def check_run(cfg: AsyncFlowConfig, config_path: str | Path | None = None,
              overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every problem ``asyncflow train`` can find before it starts anything (empty: go ahead).

    ``model.path`` must exist (``check_model_path``; when it is missing and a tiny model may be made, the layout
    checks wait for the run to create it). A cluster recipe's ``config.yaml`` (beside ``cluster.env`` and
    ``model_arch.json``) gets ``check_recipe`` with the same overrides and the model compared; any other config
    gets ``check_layout`` against the model's ``config.json``.
    """
    from asyncflow.models.arch import GPTArch

    problems = check_model_path(cfg)
    model_dir = Path(cfg.model.path)
    if problems or not (model_dir / "config.json").is_file():
        return problems
    if config_path is not None:
        recipe = Path(config_path).parent
        if Path(config_path).name == "config.yaml" and all((recipe / f).is_file() for f in RECIPE_FILES):
            return check_recipe(recipe, model_dir, overrides)
    name = Path(config_path).name if config_path is not None else "config"
    try:
        arch = GPTArch.from_pretrained(model_dir)
    except (ValueError, KeyError) as exc:
        return [f"{name}: {model_dir / 'config.json'}: unsupported model: {exc}"]
    return check_layout(name, cfg, arch)


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncflow.recipes_check RECIPE_DIR... [section.key=value ...]``: print the problems; exit 1 if
    there are any."""
    parser = argparse.ArgumentParser(prog="python -m asyncflow.recipes_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="+", metavar="RECIPE_DIR|key=value",
                        help="recipe directories (recipes/<model>), then config overrides applied to each")
    parser.add_argument("--model-dir", type=Path, help="checkpoint to compare with model_arch.json")
    args = parser.parse_intermixed_args(argv)
    overrides = [item for item in args.items if "=" in item]
    recipes = [Path(item) for item in args.items if "=" not in item]
    if not recipes:
        parser.error("no recipe directory given")
    problems = [p for recipe in recipes for p in check_recipe(recipe, args.model_dir, overrides)]
    for problem in problems:
        print(f"recipe check: {problem}", file=sys.stderr)
    return 1 if problems else 0

if __name__ == "__main__":
    sys.exit(main())
