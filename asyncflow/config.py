"""Typed configuration: one dataclass per component, nested under ``AsyncFlowConfig``.

Defaults live only here; recipe YAML files hold overrides, and ``section.key=value`` on the command line
overrides the file (see ``config_loader``). Each component receives its own section, never the whole
tree. ``load_config`` checks the rules between keys once (``asyncflow.config_rules``).
``asyncflow config show FILE [overrides]`` prints the resolved result; ``asyncflow config keys [SECTION]`` lists
every key with its type, default and the docstring under its field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from asyncflow import config_loader
from asyncflow.bridge.config import WeightSyncConfig
from asyncflow.config_loader import ConfigError
from asyncflow.config_rules import validate
from asyncflow.data.config import DataConfig
from asyncflow.observability.config import ObservabilityConfig
from asyncflow.rewards.config import RewardConfig
from asyncflow.transfer_queue.config import TransferQueueConfig

__all__ = [
    "ModelConfig",
    "MegatronEngineConfig",
    "MegatronConfig",
    "CriticConfig",
    "VllmConfig",
    "RayConfig",
    "DemoConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "WorkflowConfig",
    "ObservabilityConfig",
    "DataConfig",
    "TransferQueueConfig",
    "AsyncFlowConfig",
    "ConfigError",
    "load_config",
    "validate",
]


@dataclass
class ModelConfig:
    """The policy model: a Hugging Face checkpoint directory (Llama / Qwen2 / Qwen3 family)."""

    path: str = "outputs/tiny_model"
    """Hugging Face model directory (config.json, safetensors weights, tokenizer files)."""
    make_tiny_if_missing: bool = False
    """Create a tiny random model at ``path`` when it does not exist (the tiny CPU recipes set it; off by default
    so that a mistyped path of a real model is an error, not a run that trains a random one)."""
    tiny_family: Literal["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"] = "qwen2"
    """Family of the tiny model created when ``make_tiny_if_missing`` applies."""
    tiny_charset: Literal["add1", "ascii"] = "add1"
    """Tokenizer character set of the tiny model: ``add1`` (19 tokens) or ``ascii``."""


@dataclass
class MegatronEngineConfig:
    """Keys of every model Megatron-core trains (the policy and the critic): parallel sizes and optimizer."""

    engine: str = "megatron"
    """Engine name in its registry, or a dotted path to an engine class taking ``(cfg, model_dir)``."""

    tensor_parallel: int = 1
    """Tensor-model-parallel size (TP)."""
    pipeline_parallel: int = 1
    """Pipeline-model-parallel size (PP)."""
    data_parallel: int = 1
    """Data-parallel replicas (DP); a worker group has TP x PP x DP ranks."""
    expert_parallel: int = 1
    """Expert-parallel size (EP) of MoE models: experts are split over EP ranks inside the DP x TP ranks."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype; float32 on CPU."""
    lr: float = 1e-3
    """Adam learning rate."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.99
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon (the denominator's floor)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Gradient-norm clip (0 disables)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch in the pipeline schedule."""
    micro_batch_tokens: int = 0
    """Sequence packing: form micro-batches by this token budget (rows x the micro-batch's longest row) instead of
    ``micro_batch_size`` rows. Rows of like length go together and each micro-batch is padded to its own longest
    row, under pipeline parallelism too (Megatron's variable sequence lengths); every data-parallel replica runs
    the same number of micro-batches. The actor then reads its step's rows before its first pass. 0: rows."""
    row_order: Literal["shortest", "arrival"] = "shortest"
    """Which of a step's ready rows each micro-batch takes (the actor's passes, the reference and critic
    forwards). ``shortest``: the shortest ready rows (the TransferQueue's ``shortest`` sampler), so rows of
    like length share a micro-batch, padded to about their own length, when many are ready at once (every
    sync step; an async actor a step behind rollout). ``arrival``: first come, first served, padding each
    micro-batch to the longest of a mixed set. The loss is normalized over the whole step, so the order does
    not change the update, only the padding."""
    seed: int = 1234
    """Seed of Megatron's RNG streams."""
    model_provider: str | None = None
    """Dotted path to your own ``fn(config, pre_process, post_process) -> GPTModel`` (Megatron-LM's
    model_provider shape); None builds the Llama/Qwen GPTModel from the checkpoint's config.json."""

    # Memory features (``asyncflow plan RECIPE`` estimates what each one saves). The rules between them are in
    # ``asyncflow.config_rules``; what the machine can run, and Megatron's own config arguments, in
    # ``asyncflow.engines.megatron.features``.
    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights and Adam moments over the data-parallel ranks (Megatron's distributed
    optimizer, ZeRO-1): 6 + 12/DP bytes per bf16 parameter instead of 18. Needs CUDA."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: ``selective`` recomputes core attention (the s x s scores of Megatron's
    unfused attention; nothing to gain with flash attention); ``full`` keeps only each layer's input and
    recomputes the layer in the backward pass."""
    recompute_num_layers: int = 1
    """``recompute: full``: layers per recomputed chunk (Megatron's uniform method); one chunk's activations
    are alive at once during the backward pass."""
    context_parallel: int = 1
    """Context-parallel size (CP) for long responses: each rank holds 2 of 2 x CP chunks of every sequence (the
    activations of a row shrink CP-fold); a worker group has TP x PP x CP x DP ranks. Needs Transformer Engine's
    attention (GPU); the split and gather are in ``engines/megatron/context_parallel.py``. Token-mean loss
    aggregation only (a per-sequence mean would need each row's whole token count on every rank)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient all-reduce / reduce-scatter with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass (needs
    ``use_distributed_optimizer``)."""
    moe_token_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """MoE token dispatcher: ``allgather`` (works everywhere) or ``alltoall`` (less memory and traffic at large
    EP; creates CUDA streams, so not on CPU)."""
    moe_grouped_gemm: bool = False
    """Run each rank's local experts as one grouped GEMM (Transformer Engine's TEGroupedMLP; not on CPU)."""


@dataclass
class MegatronConfig(MegatronEngineConfig):
    """The Megatron-core train engine of the policy (``trainer:``); the reference policy reads it too."""

    engine: str = "megatron"
    """Train engine (registry ``TRAIN_ENGINES`` or a dotted path to a ``TrainEngine`` subclass taking
    ``(cfg, model_dir)``)."""
    sequence_parallel: bool = False
    """Split the norm and residual activations over the TP ranks along the sequence (Megatron sequence
    parallelism; TP > 1). Needs Transformer Engine's norms, so not on CPU."""
    load_dir: str | None = None
    """Where the trainer's initial weights come from: None reads ``model.path`` (Hugging Face safetensors); a
    folder here is read as ``load_format`` says. ``model.path`` still gives the architecture and the tokenizer, and
    rollout starts from the trainer's weights (version 0), whichever folder they came from."""
    load_format: Literal["auto", "hf", "megatron_dist"] = "auto"
    """Format of ``load_dir``: ``hf`` (safetensors), ``megatron_dist`` (a Megatron distributed checkpoint: a folder
    with its ``metadata.json``, or a Megatron-LM ``--save`` folder whose ``latest_checkpointed_iteration.txt`` names
    the iteration; written at any TP/PP), or ``auto`` (told apart by the folder's files)."""
    reference_placement: Literal["colocated", "own", "offload"] = "colocated"
    """Where the reference policy (``algorithm.kl_coef > 0``; there is none at 0) runs. ``colocated``: on the
    trainer's devices with its weights resident (a frozen copy: weights only, no gradients or optimizer state).
    ``own``: on devices of its own, as many as the trainer has. ``offload``: on the trainer's devices with its
    weights in host memory, each layer copied in only while it runs (``engines.megatron.offload.LayerStreamer``):
    the device holds the embedding, the output layer and two layers. The cluster recipes use ``offload``
    (docs/recipes.md says why); the CPU recipes keep ``colocated``, since host memory is the device there."""


@dataclass
class CriticConfig(MegatronEngineConfig):
    """The Megatron critic (``critic:``, used by ``algorithm.advantage: gae``): the policy's model family with a
    scalar value head, loaded from the policy's checkpoint. It has the policy's parallel and optimizer keys but
    no sequence parallelism (the value head is replicated over TP ranks and reads whole sequences) and no
    reference placement (the reference is a copy of the policy)."""

    engine: str = "megatron"
    """Critic engine (registry ``CRITIC_ENGINES`` or a dotted path to a ``CriticEngine`` subclass taking
    ``(cfg, model_dir)``)."""


@dataclass
class VllmConfig:
    """A vLLM rollout engine instance."""

    engine: str = "vllm"
    """Rollout engine (registry ``ROLLOUT_ENGINES`` or a dotted path to a ``RolloutEngine`` subclass
    taking ``(cfg, model_dir)``)."""

    tensor_parallel: int = 1
    """vLLM tensor-parallel size (multi-process executor when > 1)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Model dtype inside vLLM; float32 on CPU for exact logprob agreement."""
    max_model_len: int = 64
    """Longest prompt + response, in tokens."""
    max_num_seqs: int = 256
    """Largest number of sequences vLLM schedules at once."""
    kv_cache_gib: int = 1
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE), GiB."""
    enforce_eager: bool = True
    """Skip graph capture and compilation (a much faster start-up, the CPU recipes' choice)."""
    in_process: bool = True
    """Run vLLM's engine core inside the caller's process (faster start, easier debugging): at TP=1 the model
    too; at TP>1 the TP workers still run in processes of their own. False: the engine core runs in a process of
    its own as well (vLLM's default, which overlaps the caller's work with the engine's steps; the cluster
    recipes use it). At TP>1 in process starts sooner: one process fewer imports vLLM."""
    temperature: float = 1.0
    """Sampling temperature."""
    max_new_tokens: int = 4
    """Tokens generated per response."""
    seed: int = 0
    """Sampling seed."""
    gpu_memory_utilization: float = 0.5
    """GPUs: fraction of each device vLLM may use for weights, activations and KV cache (the KV cache gets
    what is left). On CPU ``kv_cache_gib`` sizes the KV cache instead. ``asyncflow plan`` checks it."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes (GRPO's samples of one prompt share it); the prefix cache
    is dropped at every weight update."""
    continuous: bool = False
    """Continuous batching (``asyncflow.workflow.rollout_stream``): keep up to ``max_num_seqs`` responses in
    flight, admit a prompt as soon as one finishes, start the next step's prompts while this step's tail
    finishes (within workflow.max_staleness). False: take ``workflow.rollout_chunk`` prompts, generate them
    all to the end, then take more."""
    partial: bool = False
    """Partial rollout (implies ``continuous``): apply a newer weight version at a token boundary and carry
    on with the in-flight responses on it (their prefixes are recomputed). Each token records its version and
    behaviour logprob; a row's version is its oldest token's. False: weights change only on an empty engine."""
    partial_kv: Literal["recompute", "keep"] = "recompute"
    """What partial rollout does with an in-flight response's KV cache at a weight swap. ``recompute``
    (default): abort and re-add it with its tokens so far as the prompt; the new version prefills that prefix,
    so every later token's behaviour logprob is exactly what the trainer computes under that version.
    ``keep``: leave the requests running; the next tokens are sampled by the new weights while attending to
    the KV of the versions before (no prefill, no exact per-version logprobs: the recorded behaviour logprob
    is still the probability the token was sampled with, which decoupled PPO and TIS correct for). Needs
    ``enable_prefix_caching: false``: a cached prompt block of an old version must not serve a new request."""


@dataclass
class RayConfig:
    """The Ray cluster that hosts worker groups."""

    address: str | None = None
    """Address of an existing cluster (``auto`` or ``host:port``); None starts a local one."""
    num_cpus: int | None = None
    """CPUs of a local cluster (None: all)."""
    namespace: str = "asyncflow"
    """Ray namespace of this job's actors."""
    accelerator: str | None = None
    """Ray resource name of the devices (``GPU``, ``NPU``, ...): one bundle per trainer rank and per rollout
    engine (see ``asyncflow.workflow.placement``). None: the CPU layout of the tiny recipes."""
    cpus_per_device: int = 4
    """CPU cores reserved beside each device (data loading, tokenization, the vLLM scheduler)."""
    local_devices: int | None = None
    """Devices a *local* cluster declares (None: Ray's own detection); lets the device layout be tested on a
    machine without them."""
    placement_timeout_s: float = 600.0
    """How long to wait for the placement group (all devices of the run) before failing."""
    device_fraction: float = 1.0
    """Share of a device that each device bundle of the placement asks for (and its workers, of their share).
    Below 1, bundles share devices: 0.5 puts the rollout engine and the trainer of an ``async`` run side by side
    on one GPU (``tools/gpu_check.py`` on a one-GPU machine), each process seeing that one device; vLLM's memory
    is then capped by ``rollout.gpu_memory_utilization``. Needs ``rollout.tensor_parallel: 1``."""
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    """Ray placement-group strategy of the workers' bundles: ``PACK`` (as few nodes as possible) or ``SPREAD``
    (bundles over different nodes where possible, e.g. rollout and trainer on different hosts)."""
    rollout_label_selector: dict[str, str] | list[dict[str, str]] | None = None
    """Ray node labels the rollout engines' devices must carry in ``async`` on devices (``ray start --labels``;
    every node has ``ray.io/node-id``), e.g. rollout on nodes of its own; None: where the placement packs them. A
    list gives one selector per rollout instance, in instance order (``{}``: anywhere), e.g. one instance per host;
    it has ``workflow.rollout_instances`` entries."""
    death_info_wait_ms: int = 0
    """How long the driver's Ray waits for the cause of a worker's death before it fails the task the worker ran
    (Ray's ``timeout_ms_task_wait_for_death_info``, 1000 by default). The supervisor hands a dead worker's rows
    back, and the others take them, only once the driver sees the death: 0 sees it at once (the error is then Ray's
    ``ActorUnavailableError``, without the cause Ray would add). Applied to the Ray a run starts itself; a cluster
    started with ``ray start`` (``ray.address``) takes Ray's own setting: ``RAY_timeout_ms_task_wait_for_death_info``
    in the environment of ``ray start`` and of the driver."""


@dataclass
class DemoConfig:
    """``asyncflow demo``: the smallest honest slice of the pipeline (train, move weights, generate)."""

    train_steps: int = 5
    """Megatron optimizer steps before the weights move to vLLM."""
    batch_size: int = 16
    """Sequences per training step."""
    num_prompts: int = 8
    """Prompts generated by vLLM after the weight move."""
    output_dir: str = "outputs/demo"
    """Where the demo writes its summary."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL regularization, reward function."""

    advantage: str = "grpo"
    """Advantage estimator: ``grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``gae`` (PPO: a
    Megatron critic from the ``critic`` section adds the values and critic-update tasks) or a dotted path."""
    adv_eps: float = 1e-4
    """GRPO: added to the group's reward std."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std (False gives Dr.GRPO's mean-centred advantage)."""
    policy_loss: str = "decoupled_ppo"
    """``ppo``, ``decoupled_ppo`` (off-policy correction against rollout logprobs), ``tis`` or a dotted path."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (raise it for DAPO-style clip-higher)."""
    is_cap: float = 2.0
    """Truncation of the importance weight between the proximal/current policy and the rollout policy."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``- entropy_coef x`` the policy's per-token entropy is added to the loss (0 disables;
    computed from the vocab-parallel logits without gathering the vocabulary)."""
    gae_gamma: float = 1.0
    """GAE discount (``advantage: gae``)."""
    gae_lambda: float = 1.0
    """GAE lambda (``advantage: gae``)."""
    whiten_advantages: bool = False
    """``advantage: gae``: whiten the advantages over the global batch (the advantage task then waits for the
    whole step instead of streaming)."""
    value_loss: str = "clipped"
    """Critic loss: ``clipped`` (PPO's clipped value loss), ``mse`` or a dotted path."""
    value_clip: float = 0.2
    """Clip range of the value prediction around the values the critic produced at rollout time."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop GRPO groups whose rewards are all equal (no signal) and feed more prompts
    into the step until ``prompts_per_step`` groups with signal are kept. Pair it with clip_high > clip_low
    (clip-higher), ``kl_coef: 0`` and ``loss_agg: token-mean`` for DAPO."""
    max_sampling_factor: float = 4.0
    """Dynamic sampling: fail (with an error naming this setting) once a step has been fed more than this
    many times ``prompts_per_step`` prompts: the data is then too easy or too hard for the policy."""
    kl_coef: float = 0.05
    """Weight of the KL to the reference model (0 disables the reference task)."""
    kl_estimator: str = "k3"
    """KL estimator: ``k1``, ``k2`` or ``k3``."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term or as a per-sequence reward penalty."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are averaged over the global batch."""
    ppo_epochs: int = 2
    """Optimizer steps per global batch (the first streams from the TransferQueue)."""
    reward: str = "add1"
    """Reward function (registry ``REWARD_FUNCTIONS``: ``add1``, ``calc``, ``math``, ``remote``, ``classifier``), or
    user code as ``pkg.module:name`` or ``path/to/file.py:name``: a factory ``factory(tokenizer) -> fn`` or the
    function itself, e.g. verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``; how it is
    called is set in the ``reward`` section (docs/rewards.md)."""
    reward_on_error: float = 0.0
    """Reward given to a sample whose reward function raised (the failure is counted and reported)."""


@dataclass
class WorkflowConfig:
    """The RL loop: mode, staleness bound, batch shape and worker layout."""

    mode: Literal["async", "sync", "stream"] = "async"
    """``async``: task-separated streaming with delayed parameter update, every row tied to its step's partition;
    ``sync``: colocated lock-step baseline; ``stream``: the sample stream (``asyncflow.workflow.sample_stream``):
    rollout generates continuously from a prompt stream and step s trains the first ``prompts_per_step`` whole
    groups to finish whose every token comes from a version >= s - max_staleness; a group that finishes too late
    for that bound is counted (``stream/stale_groups``) and its prompt goes back to the stream."""
    max_staleness: int = 1
    """k: a sample generated with weight version v is trained at step <= v + k (0 = on-policy)."""
    stream_spare: float = 0.25
    """``stream`` mode: groups admitted beyond what the staleness bound can train, as a fraction of
    ``prompts_per_step`` (rounded up). With none, a slow response holds the last slot of its window and so the step
    it would fill; with them, the step takes the first groups to finish and a spare that finishes too late goes
    stale (counted, generated again)."""
    stream_unit: Literal["auto", "group", "sample"] = "auto"
    """``stream`` mode: what a step takes as it finishes. ``group``: a prompt's whole group of
    ``samples_per_prompt`` responses (GRPO and RLOO compare a response with its group); ``sample``: each response on
    its own, so a long response holds neither a step nor its siblings (needs an estimator that scores a response
    alone: ``reinforce_pp``, ``gae``); ``auto``: ``sample`` for such an estimator, else ``group``. Single
    responses favour the short ones (those that finish first; docs/training.md, The sample stream)."""
    steps: int = 100
    """Global training steps (one optimizer-step group and one weight version each)."""
    task: str = "add1"
    """Prompt source (registry ``PROMPT_SOURCES`` or a dotted path)."""
    prompts_per_step: int = 32
    """Prompts per global batch."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group size)."""
    rollout_instances: int = 1
    """vLLM engines; each pulls prompts from the TransferQueue, so a faster one takes more."""
    rollout_chunk: int = 64
    """Rows a rollout instance takes per request."""
    score_chunk: int = 64
    """Rows the reward and reference tasks take per request."""
    worker_threads: int = 1
    """Torch threads per heavy worker (async mode: workers run side by side)."""
    sync_worker_threads: int = 2
    """Torch threads per heavy worker in sync mode (workers take turns on the same cores)."""
    seed: int = 0
    """Seed of the prompt stream."""
    step_timeout_s: float = 600.0
    """A task waiting longer than this for its inputs fails with an error naming what it waits for."""
    max_service_restarts: int = 3
    """``async`` mode: how many times the workers of one stateless service (a rollout instance on the chunked
    path, the reward task, the advantage task without dynamic sampling) are started again after their process
    dies; their unfinished rows are made again, once. One more death stops the run naming the service (a
    rollout instance is left out instead while others run). 0: any death stops the run (docs/fault_tolerance.md)."""
    restart_timeout_s: float | None = None
    """How long the supervisor waits for a worker that died to be started again (Ray placing its process, the
    process answering) before it gives up: a rollout instance is then left out while others run, any other worker
    is lost as past ``max_service_restarts``. Ray waits without bound for devices it cannot place, e.g. those of a
    lost host. Counted from the first death where a replacement dies again before it answers. None:
    ``step_timeout_s``."""
    rollout_spares: int = 0
    """Warm spare rollout instances: started with the run (engine built, model loaded), idle (no rows, no weights)
    until a rollout instance dies, when one takes the dead instance's place at once instead of waiting for its
    process to start again; a new spare is started in the background once the promoted one has made its first step's
    rows. Each spare holds what an instance holds
    (cores, memory; on devices ``rollout.tensor_parallel`` devices of its own, counted in ``ROLLOUT_DEVICES``) while
    idle. Only where rollout instances are restarted (``async`` or ``stream`` mode with ``max_service_restarts``
    above 0; docs/fault_tolerance.md)."""
    max_restarts: int = 2
    """How many times the whole run is started again from its newest complete checkpoint after a trainer rank
    (actor or critic) dies, or a TransferQueue storage unit or controller dies with rows the run still needs: every
    worker is stopped and the run goes on as ``--resume`` would (model, optimizer, data position, trained-prompt
    record). Only with checkpoints on (``checkpoint.dir``, ``checkpoint.interval`` or ``checkpoint.every_minutes``
    set); one more death stops the run naming what died. 0: such a death stops the run (docs/fault_tolerance.md)."""
    eval_every: int = 0
    """Evaluate on the validation set (``data.val_path``) each time rollout admits the weights of the next multiple
    of this many trained steps (0: off); the ``eval/*`` metrics go with that step's metrics
    (``asyncflow.workflow.evaluation``)."""
    eval_before_train: bool = False
    """Also evaluate the weights before the first step (version 0)."""
    eval_k: int = 4
    """Sampled responses per validation prompt (at ``rollout.temperature``), for ``eval/pass@<k>``; one greedy
    response (temperature 0) per prompt gives ``eval/greedy_acc``."""
    eval_samples: int = 4
    """Validation prompts whose responses are written to ``<output_dir>/eval_samples/step_<n>.jsonl`` per
    evaluation (0: none)."""
    eval_correct_reward: float = 1.0
    """A validation response counts as correct (greedy accuracy, pass@k) when its reward is at least this."""


@dataclass
class AgentConfig:
    """Multi-turn rollouts (``asyncflow.agents``): an agent loop runs between vLLM turns of every sample."""

    loop: str | None = None
    """Agent loop (registry ``AGENT_LOOPS``, e.g. ``calculator``, or a dotted path to ``factory(tokenizer)``);
    None: single-turn rollouts. Implies ``rollout.continuous``. The trajectory's token budget, observations
    included, is ``rollout.max_new_tokens``."""
    max_turns: int = 4
    """Model turns per trajectory at most (the loop is not asked again after the last one)."""
    tool_workers: int = 8
    """Agent-loop calls (``turn_reward`` + ``observe``) running at once per rollout instance, off the engine
    loop: threads for a plain ``observe``, coroutines for an ``async def`` one. The engine keeps stepping the
    other sequences while a call runs."""
    tool_timeout_s: float = 60.0
    """A call not answered this many seconds after its turn ended ends its trajectory as an agent failure
    (``algorithm.reward_on_error``), counted in ``agent/tool_timeouts``."""


@dataclass
class CheckpointConfig:
    """Checkpoints for ``asyncflow train CONFIG --resume``: actor (and critic) Megatron distributed checkpoints
    with optimizer state, plus the data cursor, step, weight version and trained-prompt record."""

    dir: str | None = None
    """Where checkpoints go (None: ``<observability.output_dir>/checkpoints``); one ``step_NNNNNN`` folder each."""
    interval: int = 0
    """Save after every this many trained steps and after the last one (0: never)."""
    every_minutes: float = 0.0
    """Also save at the first step boundary this many minutes after the previous checkpoint (0: off), so that a
    trainer restart (``workflow.max_restarts``) loses at most about this much work. Every trainer rank and the
    driver take the same boundary (the version board decides)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is committed (0 keeps all)."""
    signal_grace_s: float = 120.0
    """On SIGTERM or SIGINT the run stops at the next step boundary and writes a checkpoint there (when ``dir`` is
    set or ``interval`` > 0); if the boundary is not reached within this many seconds it stops without one (the
    previous checkpoint stays the resume point; 0: no limit). Exit status 75 either way (docs/fault_tolerance.md)."""


@dataclass
class AsyncFlowConfig:
    """The whole configuration tree; each component reads only its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model checkpoint."""
    trainer: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron train engine."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Megatron critic (``algorithm.advantage: gae``): its own parallel sizes and optimizer."""
    rollout: VllmConfig = field(default_factory=VllmConfig)
    """vLLM rollout engine."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster."""
    demo: DemoConfig = field(default_factory=DemoConfig)
    """The foundation demo."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How the reward function is called (batched, async, workers) and the remote/classifier rewards."""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """The RL loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt dataset files (for ``workflow.task: jsonl | parquet``)."""
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    """The TransferQueue data plane."""
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """Metrics, progress, timeline and plots."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint and resume."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How each new weight version reaches the rollout engines (``asyncflow.bridge``)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn agent loop of the rollout (tool calls, environments)."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> AsyncFlowConfig:
    """Load ``AsyncFlowConfig`` from an optional YAML file plus ``section.key=value`` overrides, and check its
    cross-field rules (``asyncflow.config_rules.validate``)."""
    cfg = config_loader.load(AsyncFlowConfig, path, overrides)
    validate(cfg)
    return cfg


def replace(cfg, **changes):
    """A copy of a config dataclass with some fields changed (type-checked like a file)."""
    data = dataclasses.asdict(cfg)
    data.update(changes)
    return config_loader.build(type(cfg), data)


def replace_section(cfg: AsyncFlowConfig, section: str, **changes) -> AsyncFlowConfig:
    """A copy of ``cfg`` with some fields of one section changed."""
    return dataclasses.replace(cfg, **{section: replace(getattr(cfg, section), **changes)})
