"""Plan the cluster before booking it: a discrete-event simulator of the RL pipeline (docs/simulator.md).

- ``costs``: the cost model of one kind of hardware (JSON), written by ``asyncflow profile``;
- ``profile``: measures the engines' costs along the real code paths (vLLM engine, Megatron trainer, the loop's
  weight staging, the TransferQueue client);
- ``events``: a small discrete-event kernel (processes as generators, processor-shared devices);
- ``rollout_models``: how a rollout engine turns a batch of prompts into finished responses over time
  (registry: chunked, continuous and partial rollout);
- ``workload``: the simulated run's shape, read from an ``AsyncFlowConfig``, and response lengths;
- ``sim``: the pipeline itself (tasks, TransferQueue streaming, staleness bound, weight publication, sync
  and async modes) and its predictions;
- ``search``: the device split search under ``asyncflow plan``'s memory limits; ``sensitivity``: what bounds a
  prediction; ``report``: the CLI table and the Gantt chart, drawn like the real timeline; ``published``: H100
  costs from published figures.
"""

from asyncflow.simulator.costs import CostModel, load_costs
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload

__all__ = ["CostModel", "SimResult", "Workload", "load_costs", "simulate"]
