"""The workers membership knows, indexed by state: whom a state holds is found in time that grows
with the answer, not with the job (docs/architecture.md, "Scale").

A :class:`Roster` is a dict of worker id -> record whose records tell it when their ``state``
changes (by plain assignment, ``record.state = ...``), so it keeps one ordered set of ids per
state. Asked for the workers in some states, it returns them in the order they were first
recorded, as a scan of the whole dict would.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from typing import Any


class Indexed:
    """A record whose ``state`` a :class:`Roster` indexes: assigning it moves the id there."""

    state: enum.Enum
    _roster: Roster | None = None
    _id: int = -1
    _seq: int = -1

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and self._roster is not None:
            self._roster._moved(self._id, getattr(self, "state", None), value)
        object.__setattr__(self, name, value)


class Roster(dict[int, Any]):
    """Worker id -> its record (an :class:`Indexed`), with the ids in each state at hand."""

    def __init__(self) -> None:
        super().__init__()
        self._by_state: dict[enum.Enum, dict[int, None]] = {}
        self._order = itertools.count()

    def __setitem__(self, worker_id: int, record: Any) -> None:
        old = self.get(worker_id)
        if old is not None:  # a new record of a known id keeps its place, as in a dict
            self._by_state[old.state].pop(worker_id, None)
            object.__setattr__(old, "_roster", None)
        object.__setattr__(record, "_roster", self)
        object.__setattr__(record, "_id", worker_id)
        object.__setattr__(record, "_seq", old._seq if old is not None else next(self._order))
        self._by_state.setdefault(record.state, {})[worker_id] = None
        super().__setitem__(worker_id, record)

    def __delitem__(self, worker_id: int) -> None:
        record = self[worker_id]
        self._by_state[record.state].pop(worker_id, None)
        object.__setattr__(record, "_roster", None)
        super().__delitem__(worker_id)

    def _moved(self, worker_id: int, old: enum.Enum | None, new: enum.Enum) -> None:
        if old is not None:
            self._by_state.get(old, {}).pop(worker_id, None)
        self._by_state.setdefault(new, {})[worker_id] = None

    def count(self, *states: enum.Enum) -> int:
        """How many workers are in any of ``states``."""
        return sum(len(self._by_state.get(state, ())) for state in states)

    def iter_in(self, state: enum.Enum) -> Iterator[int]:
        """The ids in ``state``, in the order they entered it, lazily (a first match costs O(1));
        no state may change while it is read."""
        return iter(self._by_state.get(state, {}))

    def in_states(self, *states: enum.Enum) -> list[int]:
        """The ids in any of ``states``, in the order they were first recorded."""
        ids = [w for state in states for w in self._by_state.get(state, ())]
        return sorted(ids, key=lambda w: self[w]._seq)
