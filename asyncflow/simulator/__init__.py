"""Plan the cluster before booking it: a discrete-event simulator of the RL pipeline.

- ``costs``: the cost model of one kind of hardware (JSON), written by ``asyncflow profile``;
- ``profile``: measures those costs along the real code paths (vLLM engine, Megatron trainer, the loop's
  weight staging, the TransferQueue client);
- ``events``: a small discrete-event kernel (processes as generators, processor-shared devices);
- ``rollout_models``: how a rollout engine turns a batch of prompts into finished responses over time
  (registry: today's chunked generation; continuous batching plugs in beside it);
- ``workload``: the simulated run's shape, read from an ``AsyncFlowConfig``, and response lengths;
- ``sim``: the pipeline itself (tasks, TransferQueue streaming, staleness bound, weight publication, sync
  and async modes) and its predictions;
- ``search``: the device split search under ``asyncflow plan``'s memory limits; ``report``: the CLI table
  and the Gantt chart, drawn like the real timeline.
"""

from asyncflow.simulator.costs import CostModel, load_costs
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload

__all__ = ["CostModel", "SimResult", "Workload", "load_costs", "simulate"]
