"""Rank 0's uploads of the training state to the driver: checkpoints and snapshots.

At a step boundary, rank 0 of a generation copies the state a step can change (its frozen
parameters stay out: docs/architecture.md, "State that does not change") when a checkpoint is
due, or when a snapshot is due: every ``FABRIC_MODEL_SNAPSHOT_STEPS`` committed steps (but not
while snapshots would take more than ``FABRIC_MODEL_SNAPSHOT_SHARE`` of the time) or once
``FABRIC_MODEL_SNAPSHOT_SECONDS`` have passed since the last upload. The copy is the only part
the step loop waits for: one copy of each tensor (on a GPU, into pinned memory, queued on the
training stream without waiting for it). A background thread then waits for the copy and sends
it in :class:`~fabric_model.transport.protocol.StateChunk` messages over the control channel, as
:mod:`fabric_model.state.wire` cuts it (no ``torch.save`` here: it would hold the interpreter's
lock for a tensor's whole length); the driver fills in the frozen parameters, writes
checkpoints and keeps the newest state in memory, for when every worker holding the state is
lost (docs/architecture.md, "Elasticity").

One upload at a time: a snapshot due while one is in flight waits for the next boundary; a
due checkpoint waits for the one in flight to finish.

What an upload costs (``cost``, which the share rule weighs) is measured as the steps paid it:
the time the steps from its start until a few after its thread ended took beyond the pace of
the steps before it. Its own work is a fraction of that where cores are busy: on 2 cores, a
BERT snapshot's copy and send took 9-16 ms, and the step beside the send 25-65 ms more (its
intra-op threads wait for the one the sending thread and the driver displace).

With a sharded optimizer state (``train(shard_optimizer_state=True)``) every member of a
generation of several takes part in gathering it (state/layouts.py, ``uploads_together``), so
all must decide alike when an upload is due (``agreed``). Checkpoints fall at units fixed by the
schedule (epoch ends, every ``checkpoint_steps``-th step), alike everywhere; the snapshot rules
read the clock, which differs between members, so rank 0 alone applies them (``snapshot_due``)
and votes inside a step's allreduce; every member reads the same sum and gathers before the
next unit (``voted``). A snapshot due while one is in flight waits for it there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..setup.config import TrainConfig
from ..step.plan import Schedule
from ..transport import protocol as p
from ..transport.control import Channel
from . import wire
from .checkpoint import checkpoint_due, next_checkpoint_unit, state_record
from .layouts import layout_for

log = logging.getLogger(__name__)

#: Bytes per StateChunk: heartbeats and step reports are never queued behind more than this.
CHUNK_BYTES = 4 << 20

#: An upload's cost is measured over at least this many units from its start, and until its
#: thread has ended (the driver's receiving and writing it slow the steps after the send too).
COST_UNITS = 3

#: The steps' pace is measured over a stretch between uploads of at least this many units.
PACE_UNITS = 5


class StateUploader:
    """Knows when rank 0 uploads the state, copies it, and sends it from a thread.

    Args:
        channel: the worker's control channel (``send`` is thread-safe).
        schedule: the run's schedule.
        config: the run's configuration (``checkpoint_freq``, ``checkpoint_steps``, ``batch_size``, ``snapshots``, and
            its state layout's: state/layouts.py).
    """

    def __init__(self, channel: Channel, schedule: Schedule, config: TrainConfig) -> None:
        self.channel, self.schedule = channel, schedule
        self.freq, self.batch_size = config.checkpoint_freq, config.batch_size
        self.checkpoint_steps = config.checkpoint_steps
        cadence = config.snapshots
        self.every_steps, self.every_seconds, self.share = (
            int(cadence.steps),
            float(cadence.seconds),
            float(cadence.share),
        )
        self.together = layout_for(config).uploads_together  # every member takes part in an upload
        self.agreed = False  # every member decides (and gathers) alike: together, with several members
        self.voted = False  # rank 0's snapshot vote came through the last step's allreduce (agreed)
        self.cost = 0.0  # seconds the last upload cost the steps (_measure_cost)
        self.framework = ""
        self.written = -1  # the newest checkpoint the driver has
        self._last_steps = 0  # steps below the unit of the last upload (or of entering)
        self._last_time = time.monotonic()
        self._thread: threading.Thread | None = None
        # The cost's measure: the upload in flight (its start, unit and copy's seconds), the
        # seconds a step took between uploads, and where the stretch measured for it began.
        self._flight: tuple[float, int, float] | None = None
        self._pace: float | None = None
        self._pace_from = (self._last_time, 0)
        # The newest checkpoint uploaded, kept until the driver says it is on disk (Written): a
        # driver that dies before then is sent it again by the next generation's rank 0.
        self._unconfirmed: tuple[int, dict[str, Any]] | None = None
        self._thresholds()

    def entered(self, settings: p.CheckpointSettings, resume_unit: int, members: int = 1) -> None:
        """A generation of ``members`` was entered at ``resume_unit``: the driver holds a state of it or before."""
        self.agreed, self.voted = self.together and members > 1, False
        self.framework = settings.framework
        self.written = max(self.written, settings.written)
        self._last_steps = self.schedule.steps_before(resume_unit)
        self._last_time = time.monotonic()
        self._flight, self._pace_from = None, (self._last_time, resume_unit)  # (a new group's steps)
        self._thresholds()

    def _thresholds(self) -> None:
        """Before these, nothing is due but by time: the next checkpoint's unit, and the unit the
        steps' rule reaches (``kind_due`` runs before every unit: its common answer is cheap)."""
        schedule, per_epoch = self.schedule, self.schedule.plan.steps_per_epoch
        self._checkpoint_unit = next_checkpoint_unit(schedule, self.freq, self.checkpoint_steps, self.written)
        self._steps_unit = schedule.total_units
        if self.every_steps > 0:
            target = self._last_steps + self.every_steps
            epoch, step = divmod(target, per_epoch)
            self._steps_unit = schedule.unit(epoch, step) - (1 if step == 0 and epoch > 0 else 0)

    def kind_due(self, unit: int, rank: int) -> str | None:
        """ "checkpoint", "snapshot" or None: what rank ``rank`` uploads before running ``unit``
        (agreed: what every member gathers, each passing rank 0)."""
        if rank != 0 or not 0 < unit < self.schedule.total_units:
            return None
        if self._flight is not None:
            self._measure_cost(unit)
        if self.agreed:
            voted, self.voted = self.voted, False
            if unit >= self._checkpoint_unit and unit > self.written and self._checkpoint_due(unit):
                return "checkpoint"
            return "snapshot" if voted else None
        return None if self._quiet(unit) else self._due(unit)

    def _measure_cost(self, unit: int) -> None:
        """Once the upload in flight has ended and ``COST_UNITS`` have passed since it began: its
        cost, the time its units took beyond the pace of the steps before it (at least its copy's).
        Where that cannot be told (no pace yet, a validation slot among them), the upload's own
        copy and send stand (``_send``)."""
        assert self._flight is not None
        started, first, copied = self._flight
        units = unit - first
        if units < COST_UNITS or (self._thread is not None and self._thread.is_alive()):
            return
        now = time.monotonic()
        self._flight, self._pace_from = None, (now, unit)
        if self._pace is not None and self._steps_between(first, unit) == units:
            self.cost = max(copied, now - started - units * self._pace)

    def _measure_pace(self, unit: int, now: float) -> None:
        """The seconds a step took since the last upload's cost was measured, over steps alone."""
        since, first = self._pace_from
        units = unit - first
        if units >= PACE_UNITS and self._steps_between(first, unit) == units:
            self._pace = (now - since) / units

    def _steps_between(self, first: int, unit: int) -> int:
        return self.schedule.steps_before(unit) - self.schedule.steps_before(first)

    def _due(self, unit: int) -> str | None:
        """``kind_due``'s rule in full (not agreed)."""
        if unit > self.written and self._checkpoint_due(unit):
            return "checkpoint"
        if self._thread is not None and self._thread.is_alive():
            return None  # the last one is still on its way: try at the next boundary
        return "snapshot" if self._snapshot_due(unit) else None

    def _checkpoint_due(self, unit: int) -> bool:
        return checkpoint_due(self.schedule, self.freq, unit, self.checkpoint_steps)

    def snapshot_due(self, unit: int) -> bool:
        """Rank 0 of agreed members, in the step before ``unit``: whether to vote that every
        member gather a snapshot before ``unit`` (the step's allreduce carries the vote)."""
        return 0 < unit < self.schedule.total_units and not self._quiet(unit) and self._snapshot_due(unit)

    def _quiet(self, unit: int) -> bool:
        """Nothing can be due before ``unit``: the common answer, in a few comparisons (before
        the next checkpoint's unit, short of the steps' rule and of the seconds')."""
        if unit >= self._checkpoint_unit:
            return False
        now = time.monotonic()
        waits = unit < self._steps_unit or (self.share > 0 and (now - self._last_time) * self.share < self.cost)
        return waits and (self.every_seconds <= 0 or now - self._last_time < self.every_seconds)

    def _snapshot_due(self, unit: int) -> bool:
        """The snapshot rules in full: by steps (while affordable), or by time."""
        steps = self.schedule.steps_before(unit) - self._last_steps
        if steps <= 0:
            return False
        since = time.monotonic() - self._last_time
        # On fast steps, N steps can be less time than a snapshot costs (a 2 ms step, a 3 MB
        # state: 7% of the run at every 100 steps). The steps' rule then waits until the last
        # upload's cost is at most ``share`` of the time since it began.
        affordable = self.share <= 0 or since * self.share >= self.cost
        by_steps = self.every_steps > 0 and steps >= self.every_steps and affordable
        by_time = self.every_seconds > 0 and since >= self.every_seconds
        return by_steps or by_time

    def upload(
        self,
        kind: str,
        unit: int,
        generation: int,
        model_state: Any,
        optimizer_state: Any,
        omitted: list[str] | None = None,
    ) -> float:
        """Copy the state (on the caller's thread) and send it from a background thread; returns
        the seconds the copy took (what the step loop pays). ``omitted``: the frozen parameters
        left out of ``model_state``, which the driver fills in."""
        started = time.monotonic()
        self.flush()  # one at a time (only a due checkpoint can find one in flight)
        self._measure_pace(unit, started)
        copies = HostCopies()
        model, optimizer = copies.of(model_state), copies.of(optimizer_state)
        copies.queued()
        record = state_record(self.schedule, unit, self.framework, self.batch_size, model, optimizer)
        if omitted:
            record["omitted"] = list(omitted)
        copied = time.monotonic() - started
        self.mark(kind, unit)
        if kind == "checkpoint":
            self._unconfirmed = (unit, record)
        self._thread = threading.Thread(
            target=self._send, args=(kind, unit, generation, record, copies, copied), name="fabric-upload", daemon=True
        )
        self._thread.start()
        self._flight = (started, unit, copied)
        return copied

    @property
    def unconfirmed_unit(self) -> int:
        """The unit of the checkpoint uploaded and not yet confirmed on disk; -1: none."""
        kept = self._unconfirmed
        return kept[0] if kept is not None else -1

    def confirmed(self, unit: int) -> None:
        """The driver wrote the checkpoint of ``unit`` (the inbox's thread calls this): the copy
        kept of it, or of an older one, is no longer needed."""
        kept = self._unconfirmed
        if kept is not None and kept[0] <= unit:
            self._unconfirmed = None

    def send_unconfirmed(self, generation: int, written: int) -> bool:
        """As rank 0 of ``generation``: send again the kept checkpoint the driver does not have
        (its newest is ``written``: a restarted driver, whose predecessor died before writing it);
        whether one was sent (docs/elasticity.md, "A lost driver")."""
        kept = self._unconfirmed
        if kept is None or kept[0] <= written:
            return False
        unit, record = kept
        self.flush()
        log.warning("the checkpoint of unit %d was never confirmed on disk: sending it again", unit)
        self._thread = threading.Thread(
            target=self._send,
            args=("checkpoint", unit, generation, record, HostCopies(), 0.0),
            name="fabric-upload",
            daemon=True,
        )
        self._thread.start()
        return True

    def mark(self, kind: str, unit: int) -> None:
        """An upload of ``unit`` started: the next snapshot counts from it."""
        if kind == "checkpoint":
            self.written = unit
        self._last_steps, self._last_time = self.schedule.steps_before(unit), time.monotonic()
        self._thresholds()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the upload in flight, if any, is sent."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(
        self, kind: str, unit: int, generation: int, record: dict[str, Any], copies: HostCopies, copied: float
    ) -> None:
        started = time.monotonic()
        size = 0
        try:
            copies.wait()  # a GPU's copies were queued on the training stream
            parts = wire.pieces(record, CHUNK_BYTES)
            part, index = next(parts), 0
            for following in parts:  # one ahead: the last part says so
                size += _length(part)
                self.channel.send(p.StateChunk(generation, unit, kind, index, part, last=False))
                part, index = following, index + 1
            size += _length(part)
            self.channel.send(p.StateChunk(generation, unit, kind, index, part, last=True))
        except (OSError, EOFError) as exc:  # the driver is gone: the inbox thread ends the process
            log.warning("%s of unit %d not sent: %s", kind, unit, exc)
            return
        sent = time.monotonic() - started
        # Until the steps' measure replaces it (_measure_cost): wall time, not this thread's CPU
        # time, which on busy cores is nearer what the steps lost meanwhile.
        self.cost = copied + sent
        # The copy is what the step loop paid; the send ran beside the steps that followed.
        log.info("%s of unit %d sent: %d bytes in %.3f s (copied in %.3f s)", kind, unit, size, sent, copied)


def _length(part: Any) -> int:
    return part.raw().nbytes if hasattr(part, "raw") else len(part)


class HostCopies:
    """Copies of a state's tensors that the training loop can no longer change: a CPU tensor
    cloned; a device tensor copied into pinned host memory on the training stream, without
    waiting (the stream orders the copy before any later write to the tensor), and waited for
    by the upload thread (:meth:`wait`), not by the step loop."""

    def __init__(self) -> None:
        self._cuda = False
        self._event: Any = None

    def queued(self) -> None:
        """On the training thread, after the last :meth:`of`: mark where the device copies end."""
        if self._cuda:
            import torch

            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, after every copy queued on it

    def of(self, tree: Any) -> Any:
        """A copy of ``tree``'s nest (dicts, lists, tuples; plain values are kept as they are)."""
        import torch

        if isinstance(tree, torch.Tensor):
            tensor = tree.detach()
            if tensor.device.type == "cpu":
                return tensor.clone()
            cuda = tensor.device.type == "cuda"
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
            host.copy_(tensor, non_blocking=cuda)
            self._cuda = self._cuda or cuda
            return host
        if isinstance(tree, dict):
            return {k: self.of(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.of(v) for v in tree)
        return tree  # plain values are immutable (numbers, strings) or rebuilt above (containers)

    def wait(self) -> None:
        """Until every device copy has landed."""
        if self._event is not None:
            self._event.synchronize()
