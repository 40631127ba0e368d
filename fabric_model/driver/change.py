"""A generation ending: what caused it, since when, and how far each member got.

A change is begun by whichever event the driver sees first: often a member's report that its
collective failed, before the driver learns which peer died. The reason the next generation
carries names the causes instead, every one of them (two workers of one host leave together,
a loss and a join fall in one change), and only joiners that were admitted. See
docs/architecture.md, "Elasticity".
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection

JOINS = "joins"


@dataclasses.dataclass
class Change:
    """One generation's end while it is under way; ``first`` is how it began ("worker 0: switch")."""

    first: str
    started: float
    causes: dict[int, str] = dataclasses.field(default_factory=dict)  # worker id -> what it did, in order
    reports: dict[int, int] = dataclasses.field(default_factory=dict)  # worker id -> next_unit
    #: The generation's members, front first, of whom the front ones may still report: membership
    #: drops them as they report or go, so its check of the whole is O(1) a message, not O(members).
    waiting: collections.deque[int] = dataclasses.field(default_factory=collections.deque)

    def cause(self, worker_id: int, what: str) -> None:
        """Worker ``worker_id`` joined, left or was lost (``what``: "joins", "lost: ...")."""
        self.causes.setdefault(worker_id, what)

    def subjects(self, members: Collection[int]) -> tuple[int, ...]:
        """The workers the reason names: every cause but a joiner left out of ``members``."""
        return tuple(w for w, what in self.causes.items() if what != JOINS or w in members)

    def reason(self, members: Collection[int]) -> str:
        """Why the generation of ``members`` formed, e.g. "workers 3, 4 leave (SIGTERM)"."""
        subjects = self.subjects(members)
        return describe([(w, self.causes[w]) for w in subjects]) if subjects else self.first


def describe(causes: list[tuple[int, str]]) -> str:
    """Causes as one reason, workers that did the same thing named together:
    [(3, "leaves (SIGTERM)"), (4, "leaves (SIGTERM)"), (5, "joins")] ->
    "workers 3, 4 leave (SIGTERM); worker 5 joins"."""
    groups: dict[str, list[int]] = {}
    for worker_id, what in causes:
        groups.setdefault(what, []).append(worker_id)
    return "; ".join(
        f"worker {ids[0]} {what}" if len(ids) == 1 else f"workers {', '.join(map(str, sorted(ids)))} {_plural(what)}"
        for what, ids in groups.items()
    )


def _plural(what: str) -> str:
    """The verb for several workers: "leaves (SIGTERM)" -> "leave (SIGTERM)"; "lost: ..." stays."""
    verb, _, rest = what.partition(" ")
    if verb in ("joins", "leaves"):
        verb = verb[:-1]
    return f"{verb} {rest}".rstrip()
