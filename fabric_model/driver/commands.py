"""What membership says and asks: the commands it returns, its limits, and what it needs to
know of the run's checkpoints (docs/architecture.md, "Elasticity")."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from ..transport import protocol as p


@dataclasses.dataclass(frozen=True)
class Send:
    """Send ``message`` to worker ``worker_id``."""

    worker_id: int
    message: p.DriverMessage


@dataclasses.dataclass(frozen=True)
class AbortGeneration:
    """Give up generation ``generation``: its ``members`` stop its collectives (a peer was lost or
    froze), and the rendezvous store fails the ranks still forming its group."""

    generation: int
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Kill:
    """Make sure the process of a lost worker is dead (a frozen one cannot come back half-alive);
    a worker on another host is told ``reason`` and cut off (docs/architecture.md, "Processes")."""

    worker_id: int
    reason: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class Start:
    """Start a new worker process with id ``worker_id`` on local device slot ``slot``."""

    slot: int
    worker_id: int


@dataclasses.dataclass(frozen=True)
class Settle:
    """Settle the step reports of generations up to ``upto_generation``: steps below
    ``resume_unit`` were committed, the others will be redone."""

    resume_unit: int
    upto_generation: int


@dataclasses.dataclass(frozen=True)
class Formed:
    """Generation ``generation`` formed (for the metrics log, the driver's log and the store's
    fence); it comes before the ``EnterGeneration`` messages of its members."""

    generation: int
    members: tuple[int, ...]
    reason: str
    resume_unit: int
    source_rank: int
    checkpoint: str | None
    restored: str | None = None  # "checkpoint" or "snapshot": what every member loaded
    rolled_back_from: int | None = None  # the committed unit given up (no holder of it was left)
    subjects: tuple[int, ...] = ()  # the workers the reason names (joined, left, lost)


@dataclasses.dataclass(frozen=True)
class RollBack:
    """No live worker held the committed state: progress goes back to ``unit``, where the next
    generation resumes; the steps from there on are redone (docs/architecture.md, "Elasticity")."""

    unit: int


@dataclasses.dataclass(frozen=True)
class RestorePoint:
    """A state a generation can load: the checkpoint or snapshot of ``unit``, as bytes."""

    unit: int
    kind: str  # "checkpoint" or "snapshot"
    name: str  # the checkpoint's file name, or "snapshot of unit N"
    data: bytes = dataclasses.field(repr=False)


Command = Send | AbortGeneration | Kill | Start | Settle | Formed | RollBack


class Checkpoints(Protocol):
    """What membership asks of the run's saved states (:class:`~fabric_model.driver.book.StateBook`)."""

    def restore_point(self, limit: int) -> RestorePoint | None:
        """The newest state the driver has (a checkpoint on disk or a snapshot in memory) at or
        below unit ``limit``, or None."""

    def has_any(self) -> bool:
        """Whether this run has a checkpoint at all."""

    def settings(self, restore: str | None = None) -> p.CheckpointSettings:
        """The checkpoint settings sent with a generation (``restore``: the name of what it loads)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds membership enforces (seconds, except ``max_workers``)."""

    max_workers: int  # engines_number: the most members at once, hand-started workers included
    total_units: int  # the schedule's length
    heartbeat: float
    recovery: float
    start: float
    replace_workers: bool = True
    local_slots: int | None = None  # workers the launcher starts (this host's devices); None: max_workers
