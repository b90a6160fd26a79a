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

Holders (a rollout instance's loop, ``holder`` below) and a dead one's leftovers. A claim binds its prompt's group
id to a slot of a step for good: a copy of that prompt (its rows handed out again after a death, or re-fed twice)
that finishes later gets the same slot back while the claimer is dead and its put unconfirmed (an orphan), and
``"dup"`` otherwise. So whatever a dead instance left half-done, each prompt fills one slot once:

    what the dead instance held           what ``forget`` does                       then
    reservations                          given back                                 other engines admit more
    prompts admitted, not claimed         their prompt rows returned (``rows``)      generated again, claimed anew
    a claim, its put not committed        the slot is an orphan; the prompt returns  the copy puts it into the slot
    a claim, its put committed            the same                                   the copy's put is skipped:
                                                                                     the slot's rows are written once
                                                                                     (or trained and cleared already)
    a put confirmed, its rows not acked   the prompt returns                         the copy is a ``"dup"``: dropped

An orphan keeps its step open (``open_step``) and its slot out of the filled ones (``reserve``) until a copy
claims it.
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
    reserved_by: dict[str, int] = dataclasses.field(default_factory=dict)
    """Reservations per holder."""
    holding: dict[str, dict[int, list[int]]] = dataclasses.field(default_factory=dict)
    """Per holder, the prompt-stream rows of each group it admitted and has not confirmed done (``admitted``)."""
    bound: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Group id -> its ``(step, slot)``, from its first ok claim on."""
    claimer: dict[int, str] = dataclasses.field(default_factory=dict)
    """Group id -> the holder whose put of it is not confirmed yet (an orphan slot once that holder is gone)."""
    gone: set[str] = dataclasses.field(default_factory=set)
    """Holders forgotten after their death: a call of theirs that arrives later changes nothing they would hold."""

    def net(self, step: int) -> int:
        """Groups of ``step`` that are (or may still be) trained: claimed minus those dynamic sampling dropped."""
        return self.claimed.get(step, 0) - self.dropped_rows.get(step, 0) // self.group_size

    def _unclaimed_step(self) -> int:
        """The lowest step that still lacks claims (``last`` once every step has its ``B``): where a new group
        goes."""
        for step in range(self.first, self.last):
            if self.net(step) < self.groups_per_step:
                return step
        return self.last

    def _orphans(self) -> list[int]:
        """The steps of the orphan slots (one entry per slot)."""
        return [self.bound[gid][0] for gid, holder in self.claimer.items() if holder in self.gone]

    def open_step(self) -> int:
        """The lowest step that still lacks groups: claims, or the put of an orphan slot (``last`` once every step
        has its ``B``)."""
        return min([self._unclaimed_step(), *self._orphans()])

    def reserve(self, groups: int, version: int, holder: str | None = None) -> int:
        """An engine serving ``version`` asks to admit ``groups`` more; returns how many it may admit now (none when
        they could only go stale: the engine must take newer weights first)."""
        if version + self.max_staleness < self.open_step() or holder in self.gone:
            return 0
        bound = min(version + self.max_staleness + 1, self.last) - self.first
        filled = sum(min(self.net(s), self.groups_per_step) for s in range(self.first, self.last))
        filled -= len(self._orphans())  # their copies are to be generated still
        granted = max(min(groups, bound * self.groups_per_step + self.spare - filled - self.reserved), 0)
        self.reserved += granted
        if holder is not None:
            self.reserved_by[holder] = self.reserved_by.get(holder, 0) + granted
        return granted

    def release(self, groups: int, holder: str | None = None) -> None:
        """Reservations given back unused."""
        if holder in self.gone:  # given back when it was forgotten
            return
        if holder is not None:
            groups = min(groups, self.reserved_by.get(holder, 0))
            self.reserved_by[holder] = self.reserved_by.get(holder, 0) - groups
        self.reserved = max(self.reserved - groups, 0)

    def claim(self, oldest_version: int, reserved: bool = True, gid: int | None = None,
              holder: str | None = None) -> tuple[str, int, int]:
        """A group finished; its oldest token came from ``oldest_version`` (``reserved``: it still holds its
        reservation; ``gid``, ``holder``: its prompt's group id and who claims it). Returns ``(verdict, step, open
        step after the claim)``, the verdict ``"ok"``: put it into ``step`` (at ``bound[gid]``'s slot);
        ``"stale"``: the open step ``step`` is beyond its bound, re-feed its prompt; ``"full"``: every step has its
        groups for now, re-feed its prompt (a drop by dynamic sampling may reopen a step); ``"dup"``: another copy
        of the prompt has its slot, drop this one."""
        if reserved:
            self.release(1, holder)
        if gid in self.bound:
            step, _ = self.bound[gid]
            if self.claimer.get(gid) not in self.gone or holder in self.gone:
                return "dup", step, self.open_step()
            if step > oldest_version + self.max_staleness:  # an orphan's copy too old for its slot: again later
                self.stale[self.open_step()] = self.stale.get(self.open_step(), 0) + 1
                return "stale", step, self.open_step()
            self.claimer[gid] = holder
            return "ok", step, self.open_step()
        step = self._unclaimed_step()
        if step >= self.last:
            return "full", step, self.open_step()
        if step > oldest_version + self.max_staleness:
            self.stale[step] = self.stale.get(step, 0) + 1
            return "stale", step, self.open_step()
        if gid is not None:
            self.bound[gid] = (step, self.claimed.get(step, 0))
            if holder is not None:
                self.claimer[gid] = holder  # an orphan at once when a gone holder's claim arrives late
        self.claimed[step] = self.claimed.get(step, 0) + 1
        return "ok", step, self.open_step()

    def admitted(self, holder: str, rows: dict[int, list[int]]) -> None:
        """``holder`` admitted these groups: group id -> its prompt-stream rows (read and not acked yet)."""
        if holder not in self.gone:
            self.holding.setdefault(holder, {}).update(rows)

    def done(self, holder: str, gids: list[int]) -> None:
        """``holder`` is done with these groups: put where their claims said (confirmed), re-fed or dropped; it
        acks their prompt rows next. From a holder already forgotten too: its put was committed, so its orphan slot
        is filled."""
        held = self.holding.get(holder, {})
        for gid in gids:
            held.pop(gid, None)
            if self.claimer.get(gid, "") == holder:
                del self.claimer[gid]

    def forget(self, prefix: str) -> list[int]:
        """Every holder named ``prefix`` or ``prefix:...`` died: give back its reservations, make its unconfirmed
        slots orphans, and return the prompt-stream rows it held (to be handed out again)."""
        rows: list[int] = []
        for holder in {*self.reserved_by, *self.holding, *self.claimer.values()} - self.gone:
            if holder == prefix or holder.startswith(prefix + ":"):
                self.release(self.reserved_by.pop(holder, 0), None)
                for held in self.holding.pop(holder, {}).values():
                    rows += held
                self.gone.add(holder)  # its unconfirmed slots are orphans now
        return rows

    def judged(self, step: int, kept: int, judged: int) -> None:
        """Dynamic sampling: of the rows of ``step`` judged so far, ``kept`` were kept (cumulative)."""
        self.dropped_rows[step] = max(self.dropped_rows.get(step, 0), judged - kept)

    def state(self) -> dict:
        """The open step, the claims and the stale groups so far (for the rollout's reports and the feeder)."""
        return {"open": self.open_step(), "claimed": sum(self.claimed.values()), "stale": dict(self.stale),
                "dropped_groups": sum(self.dropped_rows.values()) // self.group_size,
                "orphans": len(self._orphans())}
