"""Published RL runs, configured for the simulator, with the step times they report (``bench/simulator_published.py``).

Every run is simulated with the same constants (``simulator.published``: GPU figures, efficiencies, switching
costs; ``RESPONSE_MAX_OVER_MEAN`` and ``RESPONSE_SIGMA`` for the lengths); only what the publication states
about the run changes between cases. Where a publication leaves an input out, the docstring of the field says
what is assumed.

Sources:

- verl fully-async, "Asynchronous Training on 7B Model" table: https://github.com/volcengine/verl/blob/
  b178a3cd56f58b2d502255daba591e92833930a7/verl/experimental/fully_async_policy/README.md lines 349-385
  (Qwen2.5-Math-7B on H20, DAPO, n 16, ``train_batch_size`` 512 prompts for colocated (line 367),
  ``ppo_mini_batch_size`` 32 prompts (line 362), responses up to 28K tokens (line 357), ``require_batches`` 4,
  ``trigger_parameter_sync_step`` 4, staleness_threshold 0.5, partial rollout (lines 371-374), vLLM + FSDP2),
  and its scripts ``shell/dapo_7b_math_fsdp2_{16_16,32_32,64_64}.sh`` (rollout TP 4 and Ulysses SP 4 at lines
  59-60, ``fsdp_size`` 8 at line 61, prompts up to 2,048 tokens at line 38, no KL at lines 29-32, old log-probs
  taken from rollout: ``use_rollout_log_probs=True`` at line 162); vLLM's ``max_num_seqs`` is verl's default
  256 (verl/trainer/config/rollout/rollout.yaml line 68).

  The colocated rows' own scripts: ``recipe/fully_async_policy/exp/qwen2-7B-math_{32,64,128}/fsdp2_colocate/
  run.sh`` at commit 94d681dce4911c3ad6abb011a2d03c62d318868d (experiment names
  ``dapo_qwen2-7B-math_28k_fsdp2_colocate_{32,64,128}_mbs32``, line 5; removed from the repository later). Line by
  line against the fully-async scripts they differ in two trainer settings only: the actor's parameters and
  optimizer are offloaded (``offload=True``, lines 53 and 94-95; fully-async ``actor_offload=False``, shell
  line 58) and FSDP shards over 2 GPUs (``fsdp_size=2``, lines 56 and 114; fully-async 8). Equal on both sides:
  rollout TP 4, Ulysses SP 4, ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu`` twice the longest row,
  ``use_remove_padding``, ``entropy_coeff`` 0, ``ppo_epochs`` 1 (default), no KL and no reference model,
  gradient checkpointing (set at line 89; verl's default, ``config/model/hf_model.yaml`` line 34, on the
  fully-async side), ``ppo_mini_batch_size`` 32 and n 16. verl's ``update_actor`` column times the actor
  workers' ``update_actor`` on both sides (``verl/trainer/ppo/ray_trainer.py`` line 1186;
  ``recipe/fully_async_policy/ray_trainer.py`` line 435, at commit c4a063374dd2317597a8fd18032bf0f4ae034131),
  and that call loads the offloaded parameters and optimizer state at its start and offloads them at its end
  (``verl/workers/fsdp_workers.py`` lines 852-855 and 882-887): so the colocated column holds the trainer's
  offload, and neither holds a weight sync (colocated: in ``gen``; fully-async: ``param_sync``, outside the
  step). The FSDP workers reduce gradients in fp32 unless ``mixed_precision`` is set (``fsdp_workers.py`` line
  448; no script sets it).

  What a fully-async "step" is: the trainer fetches ``require_batches x ppo_mini_batch_size`` = 128 prompts per
  local update and syncs the weights every ``trigger_parameter_sync_step`` = 4 of them (fully_async_trainer.py,
  ``_trigger_parameter_sync_after_step``), and logs one row per sync whose ``timing_s/*`` columns are summed over
  its 4 local updates (detach_utils.py ``MetricsAggregator``: ``timing_s/`` is ``time_sum``). So a published
  async step is 512 prompts x 16 responses, the colocated step's samples (README line 126: the setting that
  compares the two fairly), and ``rollout.total_rollout_steps`` 512 x 400 gives the 400 steps of the
  total-time columns. Its ``gen`` is the trainer's wait for samples and ``update_actor`` its training; there is no
  ``old_log_prob`` (rollout's log-probs are used).
- AReaL, "End-to-end comparison between asynchronous AReaL and synchronous AReaL" (Table 2):
  https://github.com/inclusionAI/AReaL/blob/main/blog/AReaL_v0_3.md (R1-Distill-Qwen 1.5B on 16 nodes, 7B on 24
  nodes, 1,000 PPO steps each, training hours). The post gives no batch, length, GPU or split for these runs:
  the assumptions are in ``AREAL``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from asyncflow.models.arch import GPTArch
from asyncflow.simulator.published import H20, H100, Gpu, gpu_costs
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload

REPO = Path(__file__).resolve().parents[2]
RESPONSE_MAX_OVER_MEAN = 18
"""Longest response over the mean, for every case (the issue's 10-20x for reasoning RL; neither publication gives
its mean response length)."""
RESPONSE_SIGMA = 1.3
"""Spread of the lognormal response lengths (clipped at ``max_new_tokens``), for every case: with
``RESPONSE_MAX_OVER_MEAN`` a step of thousands of responses has a few at the cap, as DAPO's overlong ones."""
PROMPT_LEN = 200
"""Prompt tokens, for every case (neither publication gives its prompts' length; math prompts with their template
run to a few hundred tokens)."""
NO_BOUND = 10**6
"""``max_staleness`` of a run that bounds staleness only by admission (verl's ``staleness_threshold``), never by
dropping a sample."""


def heavy_tail(max_new_tokens: int) -> str:
    """The lognormal length spec with mean ``max_new_tokens / RESPONSE_MAX_OVER_MEAN`` and ``RESPONSE_SIGMA``."""
    median = max_new_tokens / RESPONSE_MAX_OVER_MEAN / math.exp(RESPONSE_SIGMA**2 / 2)
    return f"lognormal:{median:.0f}:{RESPONSE_SIGMA}"


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: its shape, and the step time it reports."""

    name: str
    arch: str
    """Architecture: a recipe's ``model_arch.json`` (``recipes/<name>``), or a key of ``ARCHS``."""
    gpu: Gpu
    gpus: int
    rollout_gpus: int
    """GPUs that generate (0: colocated, every GPU generates then trains)."""
    rollout_tp: int
    trainer_replica: int
    """GPUs of one trainer data-parallel replica (TP x PP, or Ulysses SP)."""
    sharded: bool
    """FSDP / ZeRO-3 trainer."""
    prompts: int
    samples: int
    mini_batches: int
    prompt_len: int
    max_new_tokens: int
    max_num_seqs: int
    stream_ahead: float = 0.0
    max_staleness: int = NO_BOUND
    partial: bool = True
    old_logprob: bool = False
    published_step_s: float = 0.0
    published_columns: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The publication's per-step ``gen``, ``old_log_prob`` and ``update_actor`` seconds (0: not reported)."""
    published_totals_h: tuple[float, ...] = ()
    """The publication's total hours after each hundred steps (its "total time" columns), when it gives them: the
    mean step of each hundred, to show how far the published mean step moves within one run."""
    shard_devices: int = 0
    """A sharded trainer's shard group (FSDP ``fsdp_size``; 0: every trainer GPU)."""
    grad_bytes: int = 2
    """Bytes per gradient element the trainer reduces (2: bf16; verl's FSDP workers: fp32)."""
    source: str = ""

    def hundreds_s(self) -> list[float]:
        """Mean seconds per step of each hundred steps, from ``published_totals_h``."""
        totals = [0.0, *self.published_totals_h]
        return [(b - a) * 3600 / 100 for a, b in zip(totals, totals[1:])]

    def workload(self, steps: int = 6) -> Workload:
        """The run as a ``Workload`` (``colocated`` or ``stream``)."""
        colocated = self.rollout_gpus == 0
        trainer_gpus = self.gpus if colocated else self.gpus - self.rollout_gpus
        return Workload(
            mode="colocated" if colocated else "stream", max_staleness=self.max_staleness, steps=steps,
            warmup_steps=2, prompts_per_step=self.prompts, samples_per_prompt=self.samples,
            rollout_instances=(self.gpus if colocated else self.rollout_gpus) // self.rollout_tp,
            max_num_seqs=self.max_num_seqs, data_parallel=trainer_gpus // self.trainer_replica, packing=True,
            devices_per_replica=self.trainer_replica,
            ppo_epochs=1, mini_batches=self.mini_batches, reference=False, old_logprob=self.old_logprob and colocated,
            prompt_len=self.prompt_len, max_new_tokens=self.max_new_tokens, lengths=heavy_tail(self.max_new_tokens),
            rollout_model="partial" if self.partial else "continuous", placement="devices",
            stream_ahead=self.stream_ahead)

    def predict(self, steps: int = 6) -> SimResult:
        """The simulated run."""
        costs = gpu_costs(arch(self.arch), self.trainer_replica, self.gpu, sharded=self.sharded,
                          rollout_tps=(self.rollout_tp,), shard_devices=self.shard_devices,
                          grad_bytes=self.grad_bytes)
        return simulate(self.workload(steps), costs.variant(f"device-tp{self.rollout_tp}"))


ARCHS = {
    # R1-Distill-Qwen-1.5B (Qwen2.5-Math-1.5B's architecture: its config.json on Hugging Face).
    "r1-distill-qwen-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28,
                                 num_attention_heads=12, num_query_groups=2, head_dim=128, ffn_hidden_size=8960,
                                 max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=10000.0,
                                 qkv_bias=True, qk_layernorm=False, tie_word_embeddings=False),
}


def arch(name: str) -> GPTArch:
    """The architecture ``name`` (a recipe directory's ``model_arch.json`` or ``ARCHS``)."""
    if name in ARCHS:
        return GPTArch(**ARCHS[name])
    from asyncflow.recipes_check import load_recipe

    recipe, problems = load_recipe(REPO / "recipes" / name)
    if recipe is None:
        raise ValueError(f"recipes/{name}: {problems}")
    return recipe.arch


def _h(days: int, hours: int, minutes: int) -> float:
    """A "1d 3h 43m" total time, in hours."""
    return 24 * days + hours + minutes / 60


VERL_SOURCE = "github.com/volcengine/verl verl/experimental/fully_async_policy/README.md, 7B table"
# Qwen2.5-Math-7B has Qwen2.5-7B's architecture (28 layers, 3584 hidden, 28 heads, 4 KV heads, 18944 MLP).
# 16 mini-batches: 512 prompts / ppo_mini_batch_size 32. stream_ahead: 1 + staleness_threshold 0.5 (README line
# 373; the 16:16 and 32:32 scripts set 0.1 at their line 74, the table's text says 0.5 for every row).
# fsdp_size: 2 in the colocated scripts, 8 in the fully-async ones (module docstring); the colocated trainer's
# offload is the colocated switch's (``SwitchCosts``), over its 2-GPU shard group.
_VERL = dict(arch="qwen2.5-7b", gpu=H20, rollout_tp=4, trainer_replica=4, sharded=True, grad_bytes=4,
             prompts=512, samples=16, mini_batches=16, prompt_len=PROMPT_LEN, max_new_tokens=28672, max_num_seqs=256,
             source=VERL_SOURCE)
_COLOCATED, _ASYNC = dict(shard_devices=2, old_logprob=True), dict(shard_devices=8, stream_ahead=1.5)
VERL = [
    Run("verl colocated 32", gpus=32, rollout_gpus=0, published_step_s=790.10,
        published_columns=(357.41, 107.71, 269.80),
        published_totals_h=(_h(0, 13, 44), _h(1, 3, 43), _h(2, 9, 22), _h(3, 17, 5)), **_COLOCATED, **_VERL),
    Run("verl fully-async 16:16", gpus=32, rollout_gpus=16, published_step_s=294.77,
        published_columns=(21.26, 0.0, 313.81),
        published_totals_h=(_h(0, 7, 58), _h(0, 16, 21), _h(1, 0, 53), _h(1, 9, 26)), **_ASYNC, **_VERL),
    Run("verl colocated 64", gpus=64, rollout_gpus=0, published_step_s=365.28,
        published_columns=(150.72, 70.26, 133.41),
        published_totals_h=(_h(0, 10, 22), _h(0, 20, 45), _h(1, 7, 6), _h(1, 17, 32)), **_COLOCATED, **_VERL),
    Run("verl fully-async 32:32", gpus=64, rollout_gpus=32, published_step_s=189.26,
        published_columns=(28.46, 0.0, 156.98),
        published_totals_h=(_h(0, 4, 57), _h(0, 10, 14), _h(0, 16, 58), _h(0, 21, 40)), **_ASYNC, **_VERL),
    Run("verl colocated 128", gpus=128, rollout_gpus=0, published_step_s=356.30,
        published_columns=(177.85, 53.92, 113.81),
        published_totals_h=(_h(0, 8, 36), _h(0, 17, 56), _h(1, 5, 6), _h(1, 16, 48)), **_COLOCATED, **_VERL),
    Run("verl fully-async 64:64", gpus=128, rollout_gpus=64, published_step_s=150.63,
        published_columns=(33.14, 0.0, 113.16),
        published_totals_h=(_h(0, 3, 13), _h(0, 6, 46), _h(0, 10, 53), _h(0, 17, 22)), **_ASYNC, **_VERL),
]
"""verl's fully-async 7B table (README lines 376-383): each colocated row, then the fully-async row on the same GPUs,
with its ``gen`` / ``old_log_prob`` / ``update_actor`` columns and its total time after 100, 200, 300 and 400 steps."""

AREAL_SOURCE = "github.com/inclusionAI/AReaL blog/AReaL_v0_3.md, Table 2"
# Not in the source, assumed: H800 (H100 compute and HBM), 512 prompts x 16 samples in one mini-batch, responses up
# to 27K tokens (the same post's code runs), rollout TP 1 on 3/4 of the GPUs, an FSDP trainer, staleness 4.
_AREAL = dict(gpu=H100, rollout_tp=1, trainer_replica=1, sharded=True, prompts=512, samples=16, mini_batches=1,
              prompt_len=PROMPT_LEN, max_new_tokens=27648, max_num_seqs=256, source=AREAL_SOURCE)
AREAL = [
    Run("AReaL sync 1.5B, 128 GPUs", arch="r1-distill-qwen-1.5b", gpus=128, rollout_gpus=0, old_logprob=True,
        published_step_s=41.0 * 3600 / 1000, **_AREAL),
    Run("AReaL async 1.5B, 128 GPUs", arch="r1-distill-qwen-1.5b", gpus=128, rollout_gpus=96, max_staleness=4,
        stream_ahead=5, published_step_s=14.8 * 3600 / 1000, **_AREAL),
    Run("AReaL sync 7B, 192 GPUs", arch="qwen2.5-7b", gpus=192, rollout_gpus=0, old_logprob=True,
        published_step_s=57.7 * 3600 / 1000, **_AREAL),
    Run("AReaL async 7B, 192 GPUs", arch="qwen2.5-7b", gpus=192, rollout_gpus=144, max_staleness=4,
        stream_ahead=5, published_step_s=25.4 * 3600 / 1000, **_AREAL),
]
"""AReaL's sync / async pairs (1,000 PPO steps each: a step is the training hours x 3.6 s)."""
