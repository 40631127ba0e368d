"""Replica checks: the members' state fingerprints compared, and what differs named
(docs/architecture.md, "Invariants", 4, and "Replica checks").

Every member of a generation of several sends a :class:`~fabric_model.transport.protocol.Fingerprint`
at the same units; within a generation every replica applies the same reduced step, so the
fingerprints must be equal. (Across generations they need not be: another worker count sums a
step's terms in another order, invariant 2.) Pure: no process, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..step.digest import differing
from ..transport import protocol as p

#: Tensors named in a message; the rest are counted.
NAMED = 5
#: Units of the current generation whose fingerprints are still awaited, at most (older ones are
#: dropped: a member lost before sending its own leaves its unit incomplete for good).
PENDING = 8


class ReplicaDivergenceError(AssertionError):
    """Replicas hold different states (a bug in the framework, or code that changes weights,
    buffers or optimizer state differently on each worker).

    Attributes:
        divergence: which workers and tensors differ, when known.
        model_path: where the state handed back was written (rank 0's), None if none was.
    """

    def __init__(self, message: str, divergence: Divergence | None = None, model_path: str | None = None) -> None:
        super().__init__(message)
        self.divergence, self.model_path = divergence, model_path


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Replicas that differ: each worker whose state is not the reference's (rank 0's), with the
    names of the tensors that differ, in state order.

    Attributes:
        reference: the worker the others are compared with (the lowest rank that reported).
        differing: worker -> the names of the tensors in which it differs from ``reference``.
        where: when it was seen ("after epoch 0, step 9 (unit 10, generation 0)", "at the end").
    """

    reference: int
    differing: dict[int, list[str]]
    where: str

    @property
    def tensors(self) -> list[str]:
        """Every tensor some replica differs in, first seen first."""
        return list(dict.fromkeys(name for names in self.differing.values() for name in names))

    def describe(self) -> str:
        """Who differs from the reference, in what (``NAMED`` names each, then a count); workers
        that hold the same state are named together."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for worker, names in self.differing.items():
            groups.setdefault(tuple(names), []).append(worker)
        return "; ".join(self._part(workers, list(names)) for names, workers in groups.items())

    def _part(self, workers: list[int], names: list[str]) -> str:
        who = f"worker {workers[0]} differs" if len(workers) == 1 else f"workers {', '.join(map(str, workers))} differ"
        if not names:  # only the end's SHA-256 digests saw it
            return f"{who} from worker {self.reference} in bytes the per-tensor fingerprints do not see"
        shown = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
        return f"{who} from worker {self.reference} in {len(names)} tensor(s): {shown}"


def compare(fingerprints: Mapping[int, Mapping[str, int]], where: str) -> Divergence | None:
    """``fingerprints``: worker -> its fingerprint, rank 0's (the reference) first. None when all are equal."""
    (reference, mine), *others = fingerprints.items()
    diff = {worker: differing(mine, theirs) for worker, theirs in others if theirs != mine}
    return Divergence(reference, diff, where) if diff else None


class ReplicaChecks:
    """Collects a generation's fingerprints by unit and compares them once every member's is in.

    ``where(generation, unit)`` words the position of a divergence for a person.
    """

    def __init__(self, where: Callable[[int, int], str]) -> None:
        self.where = where
        self._pending: dict[tuple[int, int], dict[int, tuple[int, dict[str, int]]]] = {}  # rank -> (worker, fp)
        self.compared = 0  # units compared (for tests and logs)

    def add(self, worker_id: int, message: p.Fingerprint) -> Divergence | None:
        """One member's fingerprint; a :class:`Divergence` when it completes a unit whose replicas differ."""
        key = (message.generation, message.unit)
        # Older generations' units will never complete: their members were re-formed.
        self._pending = {k: v for k, v in self._pending.items() if k[0] >= message.generation}
        reports = self._pending.setdefault(key, {})
        reports[message.rank] = (worker_id, message.tensors)
        if len(reports) < message.world_size:
            while len(self._pending) > PENDING:
                del self._pending[min(self._pending)]
            return None
        del self._pending[key]
        self.compared += 1
        ordered = {worker: tensors for _, (worker, tensors) in sorted(reports.items())}
        return compare(ordered, self.where(*key))
