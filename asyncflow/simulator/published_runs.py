"""Published RL runs, configured for the simulator, with the step times they report (``bench/simulator_published.py``).

Every run is simulated with the same constants (``simulator.published``: GPU figures, efficiencies, switching
costs; ``RESPONSE_MAX_OVER_MEAN`` and ``RESPONSE_SIGMA`` for the lengths); only what the publication states
about the run changes between cases. Where a publication leaves an input out, the docstring of the field says
what is assumed.

Sources:

- verl fully-async, "Asynchronous Training on 7B Model" table: https://github.com/volcengine/verl/blob/main/
  verl/experimental/fully_async_policy/README.md (Qwen2.5-Math-7B on H20, DAPO, n 16, 512 prompts a step,
  ``ppo_mini_batch_size`` 32, responses up to 28K tokens, staleness_threshold 0.5, partial rollout, vLLM +
  FSDP2), and its script verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh (rollout TP 4,
  Ulysses SP 4, prompts up to 2,048 tokens, no KL); vLLM's ``max_num_seqs`` is verl's default 256
  (verl/trainer/config/rollout/rollout.yaml).
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
    source: str = ""

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
                          rollout_tps=(self.rollout_tp,))
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


VERL_SOURCE = "github.com/volcengine/verl verl/experimental/fully_async_policy/README.md, 7B table"
# Qwen2.5-Math-7B has Qwen2.5-7B's architecture (28 layers, 3584 hidden, 28 heads, 4 KV heads, 18944 MLP).
_VERL = dict(arch="qwen2.5-7b", gpu=H20, rollout_tp=4, trainer_replica=4, sharded=True, prompts=512, samples=16,
             mini_batches=16, prompt_len=PROMPT_LEN, max_new_tokens=28672, max_num_seqs=256, source=VERL_SOURCE)
VERL = [
    Run("verl colocated 32", gpus=32, rollout_gpus=0, old_logprob=True, published_step_s=790.10, **_VERL),
    Run("verl fully-async 16:16", gpus=32, rollout_gpus=16, stream_ahead=1.5, published_step_s=294.77, **_VERL),
    Run("verl colocated 64", gpus=64, rollout_gpus=0, old_logprob=True, published_step_s=365.28, **_VERL),
    Run("verl fully-async 32:32", gpus=64, rollout_gpus=32, stream_ahead=1.5, published_step_s=189.26, **_VERL),
    Run("verl colocated 128", gpus=128, rollout_gpus=0, old_logprob=True, published_step_s=356.30, **_VERL),
    Run("verl fully-async 64:64", gpus=128, rollout_gpus=64, stream_ahead=1.5, published_step_s=150.63, **_VERL),
]
"""verl's fully-async 7B table: each colocated row, then the fully-async row on the same GPUs."""

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
