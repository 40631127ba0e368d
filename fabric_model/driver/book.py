"""The states the driver holds for the run: checkpoints and snapshots that rank 0 uploads.

Rank 0 of a generation uploads the state (a checkpoint's record, see
:mod:`fabric_model.state.checkpoint`, laid out by :mod:`fabric_model.state.wire`) in
:class:`~fabric_model.transport.protocol.StateChunk` messages: a *checkpoint* when one is due
(written to ``checkpoints/`` by :class:`CheckpointBook`), a *snapshot* every few steps or
seconds (kept in memory; the newest whose steps are all committed also on disk, by
:class:`~fabric_model.state.durable.DurableSnapshot`). The job's frozen parameters an upload leaves out are filled
back in from the driver's own (:class:`~fabric_model.state.frozen.FrozenBase`), so every
state held or written is complete. When every worker holding the
committed state is lost, the next generation loads the newest of them at or below the
committed unit, and the run rolls back to it (docs/architecture.md, "Elasticity").

Fencing: an upload is accepted only when its first chunk comes from rank 0 of the current
generation and names that generation; its further chunks only from the same sender, in
order. Messages of workers the driver has given up on never get here (the event loop drops
them), so a zombie of an older generation can neither write a checkpoint nor replace the
snapshot.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..state import wire
from ..state.checkpoint import checkpoint_name, encode_state
from ..state.durable import DurableSnapshot
from ..state.frozen import FrozenBase
from ..state.writer import CheckpointBook
from ..transport import protocol as p
from .commands import RestorePoint
from .ledger import CommittedUnit

log = logging.getLogger(__name__)
#: The longest a restore waits for a checkpoint still being written (seconds): the newest
#: uploaded checkpoint is worth a short wait; a hung disk must not hold the job.
WRITE_WAIT = 10.0


@dataclasses.dataclass
class _Upload:
    generation: int
    unit: int
    kind: str
    parts: list[bytes]


@dataclasses.dataclass
class _Held:
    """A state held in memory: its record, complete (encoded only if a generation loads it)."""

    unit: int
    kind: str
    name: str
    record: dict[str, Any]

    @property
    def data(self) -> bytes:
        return encode_state(self.record)


class StateBook:
    """Checkpoints on disk and snapshots in memory: what a generation restores when no member can
    hand the state over. It answers membership's ``Checkpoints`` questions.

    Memory: the newest state at or below the committed unit, and any newer one whose steps are
    not all committed yet (usually none): one copy of the state, two at most.
    """

    def __init__(
        self,
        checkpoints: CheckpointBook,
        committed: CommittedUnit | None = None,
        frozen: FrozenBase | None = None,
        durable: DurableSnapshot | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.durable = durable
        self.frozen = frozen if frozen is not None else FrozenBase({}, [])
        self.held: list[_Held] = []  # by unit, oldest first
        self._committed = committed or CommittedUnit()  # the driver's ledger's, shared
        self._uploads: dict[int, _Upload] = {}  # sender -> its upload in progress (one at most)
        self.refused = 0  # chunks refused by the fence (for tests and logs)

    # -- uploads ------------------------------------------------------------------------------
    def chunk(self, worker_id: int, message: p.StateChunk, generation: int, members: list[int]) -> None:
        """One chunk from ``worker_id``; ``generation`` and ``members`` are the current ones."""
        upload = self._uploads.get(worker_id)
        if message.index == 0:
            if message.generation != generation or not members or members[0] != worker_id:
                self._refuse(worker_id, message, generation)
                return
            # One upload at a time: a former rank 0's unfinished one (it may have died) is dropped.
            upload = _Upload(message.generation, message.unit, message.kind, [])
            self._uploads = {worker_id: upload}
        elif upload is None or (upload.generation, upload.unit, upload.kind, len(upload.parts)) != (
            message.generation,
            message.unit,
            message.kind,
            message.index,
        ):
            self._uploads.pop(worker_id, None)
            self._refuse(worker_id, message, generation)
            return
        upload.parts.append(message.data)
        if message.last:
            del self._uploads[worker_id]
            self._complete(worker_id, upload)

    def _refuse(self, worker_id: int, message: p.StateChunk, generation: int) -> None:
        self.refused += 1
        if message.index == 0:
            log.warning(
                "refused the %s of unit %d from worker %d: it is not rank 0 of generation %d (it says %d)",
                message.kind,
                message.unit,
                worker_id,
                generation,
                message.generation,
            )

    def _complete(self, worker_id: int, upload: _Upload) -> None:
        data = bytearray().join(upload.parts)
        upload.parts.clear()
        name = f"snapshot of unit {upload.unit}"
        try:
            record = self.frozen.fill(wire.assemble(data))
        except Exception as exc:  # a malformed upload is refused, not fatal: the last good state stays
            self.refused += 1
            log.warning("refused the %s of unit %d from worker %d: %s", upload.kind, upload.unit, worker_id, exc)
            return
        if upload.kind == "checkpoint":
            name = checkpoint_name(upload.unit)
            self.checkpoints.store(worker_id, upload.generation, upload.unit, record)
        self._hold(_Held(upload.unit, upload.kind, name, record))
        # In driver.log: which state a halt or a preemption could fall back on, and since when.
        log.info("%s from worker %d: %d bytes (generation %d)", name, worker_id, len(data), upload.generation)

    def _hold(self, state: _Held) -> None:
        if self.held and state.unit <= self.held[-1].unit:
            return  # not newer than what is held (a checkpoint rank 0 re-sent after a rollback)
        self.held.append(state)
        self._prune()
        self._make_durable()

    def adopt(self, unit: int, record: dict[str, Any]) -> None:
        """Hold the state of ``unit`` (a complete record) that a worker of a vanished driver handed
        over (driver/driver.py, "a changed job"): the next generation loads it as a snapshot."""
        self._hold(_Held(unit, "snapshot", f"state handed over at unit {unit}", record))

    @property
    def committed_unit(self) -> int:
        """Every unit below this is committed."""
        return self._committed.unit

    def _prune(self) -> None:
        """Keep the newest state at or below the committed unit, and the newer ones."""
        below = [i for i, s in enumerate(self.held) if s.unit <= self.committed_unit]
        if below:
            del self.held[: below[-1]]

    # -- progress -----------------------------------------------------------------------------
    def committed(self, unit: int) -> None:
        """Units below ``unit`` are committed: older held states are no longer needed."""
        self._committed.advance(unit)
        self._prune()
        self._make_durable()

    def _make_durable(self) -> None:
        """Offer the newest snapshot whose steps are all committed to the disk (a checkpoint is there already)."""
        if self.durable is None or not self.held:
            return
        newest = self.held[0]  # after _prune: the newest state at or below the committed unit, if any
        if newest.kind == "snapshot" and newest.unit <= self.committed_unit:
            self.durable.offer(newest.unit, newest.record)

    def rolled_back(self, unit: int) -> None:
        """Progress went back to ``unit``: newer states belong to steps that will be redone."""
        self._committed.roll_back(unit)
        self.held = [s for s in self.held if s.unit <= unit]
        self._uploads.clear()

    # -- membership's questions ---------------------------------------------------------------
    def restore_point(self, limit: int) -> RestorePoint | None:
        """The newest state at or below unit ``limit``: in memory, or a checkpoint on disk."""
        in_memory = next((s for s in reversed(self.held) if s.unit <= limit), None)
        self.checkpoints.finish_writes(WRITE_WAIT)
        on_disk = self.checkpoints.newest_on_disk(limit)
        if on_disk is not None and (in_memory is None or on_disk[0] > in_memory.unit):
            unit, path = on_disk
            return RestorePoint(unit, "checkpoint", path.name, path.read_bytes())
        if in_memory is None:
            return None
        return RestorePoint(in_memory.unit, in_memory.kind, in_memory.name, in_memory.data)

    def has_any(self) -> bool:
        return self.checkpoints.has_any()

    def settings(self, restore: str | None = None) -> p.CheckpointSettings:
        return self.checkpoints.settings(restore)
