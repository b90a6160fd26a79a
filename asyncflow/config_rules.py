"""Cross-field rules of ``AsyncFlowConfig``: ``validate(cfg)`` runs them all, once, when a config is loaded.

A single key's type and allowed values are checked by ``config_loader`` as it builds the dataclasses; the rules
here relate two or more keys. Each rule returns its problems as text that names the keys and their values;
``validate`` raises one ``ConfigError`` holding all of them.

Checks that need more than the config stay where that is at hand, and run after this one:
``asyncflow.recipes_check`` (the model's architecture and the cluster's devices: heads, layers, experts against
the parallel sizes), ``asyncflow.engines.megatron.features.check`` (what the machine the trainer starts on can
run: CUDA, Transformer Engine, MoE models at TP > 1) and ``asyncflow.workflow.placement`` (the nodes Ray finds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncflow.config_loader import ConfigError

if TYPE_CHECKING:
    from asyncflow.config import AsyncFlowConfig, MegatronEngineConfig

__all__ = ["RULES", "problems", "stream_unit", "validate"]


def _estimator_scope(cfg: AsyncFlowConfig) -> str:
    from asyncflow.algorithms.advantages import estimator_scope

    return estimator_scope(cfg.algorithm.advantage)


def stream_unit(cfg: AsyncFlowConfig) -> int:
    """Responses that go through the sample stream together, under one group id: a prompt's whole group, or one
    response (``workflow.stream_unit``; ``auto`` takes one for an estimator that scores a response alone,
    ``asyncflow.algorithms.advantages.estimator_per_sample``). Outside ``stream`` mode, a prompt's group."""
    from asyncflow.algorithms.advantages import estimator_per_sample

    wf = cfg.workflow
    if wf.mode != "stream" or wf.stream_unit == "group" or not estimator_per_sample(cfg.algorithm.advantage):
        return wf.samples_per_prompt
    return 1


def _trainers(cfg: AsyncFlowConfig) -> list[tuple[str, MegatronEngineConfig]]:
    """The Megatron-trained models of a run, by section: the policy, and the critic when GAE uses one."""
    found: list[tuple[str, MegatronEngineConfig]] = [("trainer", cfg.trainer)]
    if _estimator_scope(cfg) == "critic":
        found.append(("critic", cfg.critic))
    return found


def sizes(cfg: AsyncFlowConfig) -> list[str]:
    """Parallel sizes, micro-batches and instance counts are at least 1 (the other rules divide by them)."""
    values = {f"{name}.{key}": getattr(mcfg, key) for name, mcfg in (("trainer", cfg.trainer), ("critic", cfg.critic))
              for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel",
                          "expert_parallel", "micro_batch_size", "recompute_num_layers")}
    values.update({"rollout.tensor_parallel": cfg.rollout.tensor_parallel,
                   "workflow.rollout_instances": cfg.workflow.rollout_instances,
                   "workflow.prompts_per_step": cfg.workflow.prompts_per_step,
                   "workflow.samples_per_prompt": cfg.workflow.samples_per_prompt})
    return [f"{key}={value} must be at least 1" for key, value in values.items() if value < 1]


def batching(cfg: AsyncFlowConfig) -> list[str]:
    """Each trained model splits a step's rows into whole micro-batches on every data-parallel replica; a packing
    one (``micro_batch_tokens``) groups its share by tokens, and the shares may differ by a row."""
    rows = cfg.workflow.prompts_per_step * cfg.workflow.samples_per_prompt
    found = []
    for name, mcfg in _trainers(cfg):
        if mcfg.micro_batch_tokens > 0:
            if rows < mcfg.data_parallel:
                found.append(f"workflow.prompts_per_step x workflow.samples_per_prompt = {rows} rows per step must be "
                             f"at least {name}.data_parallel = {mcfg.data_parallel} (a row for every replica)")
        elif rows % (mcfg.micro_batch_size * mcfg.data_parallel):
            found.append(f"workflow.prompts_per_step x workflow.samples_per_prompt = {rows} rows per step must be a "
                         f"multiple of {name}.micro_batch_size x {name}.data_parallel = {mcfg.micro_batch_size} x "
                         f"{mcfg.data_parallel} (or pack: {name}.micro_batch_tokens, and the replicas' shares may "
                         f"differ by a row)")
    return found


def algorithm(cfg: AsyncFlowConfig) -> list[str]:
    """Loss aggregation under context parallelism; what dynamic sampling can be combined with."""
    algo, found, cp = cfg.algorithm, [], cfg.trainer.context_parallel
    # The critic's value loss is always a token mean; the policy's follows algorithm.loss_agg.
    if cp > 1 and algo.loss_agg != "token-mean":
        found.append(f"trainer.context_parallel={cp} needs algorithm.loss_agg=token-mean (got {algo.loss_agg!r}): "
                     "a context-parallel rank sees part of each row")
    if algo.dynamic_sampling:
        scope = _estimator_scope(cfg)
        if scope != "group":
            found.append(f"algorithm.dynamic_sampling needs a group estimator (grpo, rloo); "
                         f"algorithm.advantage={algo.advantage!r} is {scope}-scoped")
        if algo.kl_coef > 0 and algo.kl_mode == "reward":
            found.append("algorithm.dynamic_sampling with algorithm.kl_mode=reward is not supported: the reference "
                         "would have to score groups before they are kept; use kl_mode=loss or kl_coef=0")
    return found


def memory_features(cfg: AsyncFlowConfig) -> list[str]:
    """Megatron memory features that need another key (what the machine can run is checked by the trainer)."""
    found = []
    for name, mcfg in _trainers(cfg):
        if mcfg.overlap_param_gather and not mcfg.use_distributed_optimizer:
            found.append(f"{name}.overlap_param_gather=true: needs use_distributed_optimizer=true (it overlaps the "
                         "distributed optimizer's parameter all-gather)")
    if cfg.trainer.sequence_parallel and cfg.trainer.tensor_parallel == 1:
        found.append("trainer.sequence_parallel=true: needs tensor_parallel > 1 (it splits activations over the TP "
                     "ranks)")
    return found


def rollout(cfg: AsyncFlowConfig) -> list[str]:
    """Room for the prompt in vLLM's context; partial rollout's KV reuse against the prefix cache."""
    r, found = cfg.rollout, []
    if cfg.workflow.task in ("jsonl", "parquet"):
        longest = cfg.data.max_prompt_len + r.max_new_tokens
        if longest > r.max_model_len:
            found.append(f"data.max_prompt_len + rollout.max_new_tokens = {cfg.data.max_prompt_len} + "
                         f"{r.max_new_tokens} = {longest} > rollout.max_model_len={r.max_model_len}")
    elif r.max_new_tokens >= r.max_model_len:
        found.append(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for the prompt in "
                     f"rollout.max_model_len={r.max_model_len}")
    if r.partial_kv == "keep" and r.enable_prefix_caching:
        found.append("rollout.partial_kv=keep needs rollout.enable_prefix_caching=false: the prefix cache cannot be "
                     "dropped while requests run, so a new request could attend to an old version's cached prompt "
                     "blocks")
    return found


def sync_on_devices(cfg: AsyncFlowConfig) -> list[str]:
    """Colocated sync on devices gives every device to both training and generation, so their counts match."""
    if cfg.workflow.mode != "sync" or cfg.ray.accelerator is None:
        return []
    tr = cfg.trainer
    world = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel * tr.data_parallel
    engines = cfg.workflow.rollout_instances * cfg.rollout.tensor_parallel
    if engines == world:
        return []
    return [f"workflow.mode=sync on devices shares every device between training and generation: "
            f"workflow.rollout_instances x rollout.tensor_parallel = {engines} must equal the trainer's "
            f"TP x PP x CP x DP = {world}"]


def stream(cfg: AsyncFlowConfig) -> list[str]:
    """The sample stream admits whole GRPO groups into one engine (multi-turn ones with agent.loop too); it takes
    responses one by one only for an estimator that scores a response alone."""
    from asyncflow.algorithms.advantages import estimator_per_sample

    if cfg.workflow.mode != "stream":
        return []
    found, n = [], stream_unit(cfg)
    if cfg.workflow.stream_spare < 0:
        found.append(f"workflow.stream_spare={cfg.workflow.stream_spare} must be at least 0")
    if cfg.workflow.stream_unit == "sample" and not estimator_per_sample(cfg.algorithm.advantage):
        found.append(f"workflow.stream_unit=sample trains responses apart from their group; "
                     f"algorithm.advantage={cfg.algorithm.advantage!r} compares each with its group: use "
                     f"workflow.stream_unit=group (or auto), or a per-sample estimator (reinforce_pp, gae)")
    if cfg.rollout.max_num_seqs < n:
        found.append(f"workflow.mode=stream admits a group's {n} responses together (workflow.samples_per_prompt): "
                     f"rollout.max_num_seqs={cfg.rollout.max_num_seqs} must be at least that")
    return found


def evaluation(cfg: AsyncFlowConfig) -> list[str]:
    """Evaluation needs a validation set and single-turn generation (every mode and rollout evaluates; the
    streaming ones drain their engine for it: ``asyncflow.workflow.evaluation``)."""
    wf, found = cfg.workflow, []
    found += [f"workflow.{key}={getattr(wf, key)} must be at least {low}"
              for key, low in (("eval_every", 0), ("eval_k", 1), ("eval_samples", 0)) if getattr(wf, key) < low]
    if cfg.data.val_size is not None and cfg.data.val_size < 1:
        found.append(f"data.val_size={cfg.data.val_size} must be at least 1 (or null: the whole validation set)")
    if not (wf.eval_every or wf.eval_before_train):
        return found
    what = f"workflow.eval_every={wf.eval_every}" if wf.eval_every else "workflow.eval_before_train=true"
    if not cfg.data.val_path:
        found.append(f"{what} needs data.val_path (a .jsonl / .parquet validation set)")
    if cfg.agent.loop is not None:
        found.append(f"{what} generates single-turn responses; agent.loop={cfg.agent.loop!r} runs multi-turn ones")
    return found


def device_sharing(cfg: AsyncFlowConfig) -> list[str]:
    """A bundle of a share of a device holds one whole engine, so a shared device takes no rollout TP."""
    share, rtp = cfg.ray.device_fraction, cfg.rollout.tensor_parallel
    if not 0.0 < share <= 1.0:
        return [f"ray.device_fraction={share} must be in (0, 1]"]
    if share < 1.0 and rtp != 1:
        return [f"ray.device_fraction={share} below 1 needs rollout.tensor_parallel=1 (got {rtp}): a bundle holds a "
                "share of one device"]
    return []


def rollout_labels(cfg: AsyncFlowConfig) -> list[str]:
    """A list of rollout label selectors has one entry per rollout instance."""
    selector, n = cfg.ray.rollout_label_selector, cfg.workflow.rollout_instances
    if isinstance(selector, list) and len(selector) != n:
        return [f"ray.rollout_label_selector has {len(selector)} entries but workflow.rollout_instances={n}: give "
                "one selector per instance, or one mapping for all"]
    return []


def failures(cfg: AsyncFlowConfig) -> list[str]:
    """The bounds of restarts and of the wait for a death's cause are counts and times: none is negative."""
    values = {"workflow.max_restarts": cfg.workflow.max_restarts,
              "workflow.max_service_restarts": cfg.workflow.max_service_restarts,
              "ray.death_info_wait_ms": cfg.ray.death_info_wait_ms}
    return [f"{key}={value} must be at least 0" for key, value in values.items() if value < 0]


def spares(cfg: AsyncFlowConfig) -> list[str]:
    """Spare rollout instances stand in for dead ones: only where rollout instances are restarted in place
    (``workflow.supervisor.restartable``). On devices each holds ``rollout.tensor_parallel`` devices of its own
    (``workflow.placement``)."""
    wf, n = cfg.workflow, cfg.workflow.rollout_spares
    if n == 0:
        return []
    if n < 0:
        return [f"workflow.rollout_spares={n} must be at least 0"]
    restarted = wf.max_service_restarts > 0 and (wf.mode == "async" or (wf.mode == "stream"
                                                                       and not cfg.algorithm.dynamic_sampling))
    if not restarted:
        return [f"workflow.rollout_spares={n} needs rollout instances that are restarted: workflow.mode async or "
                "stream (without algorithm.dynamic_sampling) and workflow.max_service_restarts above 0; set it to 0"]
    return []


def agent(cfg: AsyncFlowConfig) -> list[str]:
    """The agent loop's calls need a worker and a deadline."""
    a, found = cfg.agent, []
    if a.tool_workers < 1:
        found.append(f"agent.tool_workers={a.tool_workers} must be at least 1")
    if a.tool_timeout_s <= 0:
        found.append(f"agent.tool_timeout_s={a.tool_timeout_s} must be above 0 (a call that never answers would hold "
                     "its trajectory forever)")
    return found


def reward(cfg: AsyncFlowConfig) -> list[str]:
    """The reward section's counts, and the settings the built-in ``remote`` and ``classifier`` rewards need."""
    r, found = cfg.reward, []
    found += [f"reward.{key}={getattr(r, key)} must be at least 1" for key in ("workers", "max_concurrency",
                                                                                "model_batch_size")
              if getattr(r, key) < 1]
    if r.retries < 0 or r.timeout_s <= 0 or r.backoff_s < 0:
        found.append(f"reward.retries={r.retries}, reward.timeout_s={r.timeout_s} and reward.backoff_s={r.backoff_s} "
                     "must be at least 0 (timeout_s above 0)")
    if cfg.algorithm.reward == "remote" and not r.url:
        found.append("algorithm.reward=remote needs reward.url (the HTTP endpoint that scores the rows)")
    if cfg.algorithm.reward == "classifier" and not r.model_path:
        found.append("algorithm.reward=classifier needs reward.model_path (an HF sequence-classification folder)")
    return found


RULES: tuple[Callable[[AsyncFlowConfig], list[str]], ...] = (batching, algorithm, memory_features, rollout,
                                                              sync_on_devices, device_sharing, rollout_labels,
                                                              failures, spares, stream, agent, reward, evaluation)
"""The rules that run once ``sizes`` passes (they divide by the sizes)."""


def problems(cfg: AsyncFlowConfig) -> list[str]:
    """Every cross-field problem of ``cfg``, each naming its keys (empty: consistent)."""
    found = sizes(cfg)
    if found:
        return found
    return [problem for rule in RULES for problem in rule(cfg)]


def validate(cfg: AsyncFlowConfig) -> None:
    """Raise ``ConfigError`` listing every cross-field problem of ``cfg``."""
    found = problems(cfg)
    if found:
        raise ConfigError("; ".join(found))
