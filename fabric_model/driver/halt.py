"""Ending training before its end with a state for the user: replicas diverged
(docs/architecture.md, "Replica checks"), the driver was told to go ("Preemption"), or the
caller asked (``FabricModel.stop_training()``: docs/training.md, "Stopping from the caller").

Training stops: every member is sent ``Abort``, and the members are asked for their state one
at a time, in rank order (rank 0 first), until one sends it. A member answers in place of
entering a next generation, or at once if it had finished. Membership no longer acts: no new
generation, no replacement. Pure: driver/ending.py does the sending.

A preempted or stopped job whose optimizer state is sharded asks no one: no member holds the whole state.
Its members are told to stop together instead (``stopping``): they vote to, leave after the same
step, and rank 0 uploads the state gathered from all their slices before it leaves.
"""

from __future__ import annotations

import dataclasses

from .replicas import Divergence


@dataclasses.dataclass
class Halt:
    """Who is asked for the state to hand back, and since when.

    Attributes:
        divergence: what differed; None when a preemption signal (``preempted``) stops training.
        candidates: the members still to ask, rank 0 first.
        patience: seconds a member has to send its state before the next is asked.
        preempted: the signal's name when the driver was told to go.
        requested: the caller asked training to stop (a normal end, at the state handed back).
        stopping: the members told to stop together that have not left yet.
    """

    divergence: Divergence | None
    candidates: list[int]
    patience: float
    preempted: str | None = None
    requested: bool = False
    asked: int = -1
    since: float = 0.0
    stopping: set[int] = dataclasses.field(default_factory=set)

    def next(self, now: float) -> int | None:
        """The next member to ask (it is asked from ``now``); None when none is left."""
        if not self.candidates:
            self.asked = -1
            return None
        self.asked, self.since = self.candidates.pop(0), now
        return self.asked

    def overdue(self, now: float) -> bool:
        """The member asked has not answered within ``patience``."""
        return self.asked >= 0 and now - self.since > self.patience
