"""Which step each finished group goes to in the sample stream (``workflow.mode: stream``); kept by the board.

    prompt stream ─► rollout engines ─► group finished (oldest token: version v) ─► claim ─┬─► TQ[open step s]
                                                                                              │   if s <= v + k
                                                                                              └─► stale: counted,
                                                                                                  prompt re-fed

Steps fill in order: a claim goes to the lowest step that still lacks whole groups (the open step), so step s
trains the first ``B`` groups to finish while it is open. A group whose oldest token is older than ``s - k`` is
never trained: the claim says so and the rollout puts its prompt back into the stream. Under dynamic sampling a
group the advantage task drops (all rewards equal) leaves room in its step, which takes the next group to finish.

Reservations are the back-pressure: an engine serving version v admits new groups only while the groups
claimed (net of drops) and in flight fit the steps up to v + k, as step-tied async admits step v + k at most,
plus ``spare`` groups more: without them a slow response would hold the last slot of its window, and so the step
it would fill (the spares that finish last go stale instead).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StreamLedger:
    """Claims, drops and reservations of groups per step; every method is called by the board under its lock."""

    first: int
    """The first step of this run (a resumed run starts past 0)."""
    last: int
    """One past the last step."""
    groups_per_step: int
    """B: whole groups a step trains (``workflow.prompts_per_step``)."""
    group_size: int
    max_staleness: int
    spare: int = 0
    """Groups admitted beyond the window (``workflow.stream_spare``)."""
    claimed: dict[int, int] = dataclasses.field(default_factory=dict)
    dropped_rows: dict[int, int] = dataclasses.field(default_factory=dict)
    stale: dict[int, int] = dataclasses.field(default_factory=dict)
    """Stale groups per step: the step that was open when they finished."""
    reserved: int = 0

    def net(self, step: int) -> int:
        """Groups of ``step`` that are (or may still be) trained: claimed minus those dynamic sampling dropped."""
        return self.claimed.get(step, 0) - self.dropped_rows.get(step, 0) // self.group_size

    def open_step(self) -> int:
        """The lowest step that still lacks groups (``last`` once every step has its ``B``)."""
        for step in range(self.first, self.last):
            if self.net(step) < self.groups_per_step:
                return step
        return self.last

    def reserve(self, groups: int, version: int) -> int:
        """An engine serving ``version`` asks to admit ``groups`` more; returns how many it may admit now (none when
        they could only go stale: the engine must take newer weights first)."""
        if version + self.max_staleness < self.open_step():
            return 0
        bound = min(version + self.max_staleness + 1, self.last) - self.first
        filled = sum(min(self.net(s), self.groups_per_step) for s in range(self.first, self.last))
        granted = max(min(groups, bound * self.groups_per_step + self.spare - filled - self.reserved), 0)
        self.reserved += granted
        return granted

    def release(self, groups: int) -> None:
        """Reservations given back unused."""
        self.reserved = max(self.reserved - groups, 0)

    def claim(self, oldest_version: int, reserved: bool = True) -> tuple[str, int, int]:
        """A group finished; its oldest token came from ``oldest_version`` (``reserved``: it still holds its
        reservation). Returns ``(verdict, step, open step after the claim)``, the verdict ``"ok"``: put it into
        ``step``; ``"stale"``: the open step ``step`` is beyond its bound, re-feed its prompt; ``"full"``: every
        step has its groups."""
        if reserved:
            self.reserved = max(self.reserved - 1, 0)
        step = self.open_step()
        if step >= self.last:
            return "full", step, step
        if step > oldest_version + self.max_staleness:
            self.stale[step] = self.stale.get(step, 0) + 1
            return "stale", step, step
        self.claimed[step] = self.claimed.get(step, 0) + 1
        return "ok", step, self.open_step()

    def judged(self, step: int, kept: int, judged: int) -> None:
        """Dynamic sampling: of the rows of ``step`` judged so far, ``kept`` were kept (cumulative)."""
        self.dropped_rows[step] = max(self.dropped_rows.get(step, 0), judged - kept)

    def state(self) -> dict:
        """The open step, the claims and the stale groups so far (for the rollout's reports and the feeder)."""
        return {"open": self.open_step(), "claimed": sum(self.claimed.values()), "stale": dict(self.stale),
                "dropped_groups": sum(self.dropped_rows.values()) // self.group_size}
