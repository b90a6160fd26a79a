"""How much a prediction moves when one side's fitted cost is off: the bottleneck, and tipping points.

A profile's fit is good to some percent (10-20% between profiles of a shared machine).
A pipeline far from balance moves with its bottleneck's cost and not at all with the other side's; one near
balance can move by much more than the error that tipped it: with continuous rollout the actor either keeps up
(its micro-batches fill as responses finish, roughly by length, and pad little) or falls a step behind (it finds
the whole step ready, takes it in index order, pads every micro-batch to a long row and stays behind). The real
loop and the simulation can settle on different sides of that point, so a prediction near it is a range, not a
number. ``sensitivity`` simulates the workload again with rollout's costs and then the trainer's ``1 + tilt``
times the fitted ones and says which side bounds the pipeline and whether a tipping point is within reach.
"""

from __future__ import annotations

import dataclasses

from asyncflow.simulator.costs import CostModel
from asyncflow.simulator.sim import SimResult, simulate
from asyncflow.simulator.workload import Workload

TILT = 0.10
"""The cost error tried on each side (10%: about what one profile of a shared machine misses by)."""
TIPPING = 1.5
"""A side whose ``TILT`` moves throughput down by more than ``TIPPING`` times what a proportional bottleneck can
(9% for 10%), or up by more than a quarter of the tilt (dearer work cannot speed a pipeline that keeps its
state), is past a tipping point: the pipeline changes state, not just speed."""


@dataclasses.dataclass
class Sensitivity:
    """Throughput with each side's costs ``1 + tilt`` times the fitted ones, against the prediction."""

    base: float
    """Predicted samples/s with the costs as fitted."""
    rollout_dearer: float
    """Samples/s with rollout's costs (engine and service) ``1 + tilt`` times the fitted ones."""
    train_dearer: float
    """Samples/s with the trainer's costs (actor and reference) ``1 + tilt`` times the fitted ones."""
    tilt: float = TILT

    def change(self, side: str) -> float:
        """Relative change of throughput when ``side`` (``rollout`` or ``train``) costs ``1 + tilt`` times more."""
        return getattr(self, f"{side}_dearer") / self.base - 1 if self.base > 0 else 0.0

    @property
    def bottleneck(self) -> str:
        """The side whose cost moves throughput most (``balanced`` when neither moves it by a quarter of the
        tilt more than the other)."""
        r, t = -self.change("rollout"), -self.change("train")
        if abs(r - t) < self.tilt / 4:
            return "balanced"
        return "rollout" if r > t else "training"

    @property
    def tipping(self) -> bool:
        """True when a ``tilt`` error on one side changes the pipeline's state (``TIPPING``)."""
        changes = (self.change("rollout"), self.change("train"))
        return min(changes) < -TIPPING * self.tilt / (1 + self.tilt) or max(changes) > self.tilt / 4

    def cell(self) -> str:
        """``-1% / -9%``: the change with rollout, then training, ``1 + tilt`` times dearer."""
        return f"{self.change('rollout'):+.0%} / {self.change('train'):+.0%}"


def sensitivity(w: Workload, model: CostModel, base: SimResult | None = None, tilt: float = TILT,
                lengths: list[list[int]] | None = None) -> Sensitivity:
    """Simulate ``w`` with rollout's and then the trainer's costs ``1 + tilt`` times ``model``'s (``lengths``: the
    same response lengths as ``base``'s simulation, when it was given some)."""
    if base is None:
        base = simulate(w, model, lengths)
    rollout = simulate(w, model.tilted(rollout=1 + tilt), lengths)
    train = simulate(w, model.tilted(train=1 + tilt), lengths)
    return Sensitivity(base.samples_per_s, rollout.samples_per_s, train.samples_per_s, tilt)
