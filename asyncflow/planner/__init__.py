"""Per-device memory planning: will a recipe's trainer ranks and rollout engines fit their devices?

- ``params``: the parameters one Megatron rank holds, split as Megatron splits them (TP, PP, EP);
- ``activations``: what one transformer layer keeps for the backward pass (Korthikanti et al.'s formulas,
  written out for the Llama / Qwen family), the logits, 1F1B's in-flight micro-batches;
- ``memory``: a trainer rank and a vLLM rollout device, term by term (weights, gradients, optimizer states,
  activations, reference model, KV cache, ...);
- ``plan``: ``asyncflow plan RECIPE``: the table, the verdict against ``DEVICE_MEMORY_GB``, and the smallest
  change that makes a task fit.
"""

from asyncflow.planner.memory import Breakdown, TrainShape, rollout_device, trainer_rank
from asyncflow.planner.plan import Plan, plan_recipe, render, run

__all__ = ["Breakdown", "Plan", "TrainShape", "plan_recipe", "render", "rollout_device", "run", "trainer_rank"]
