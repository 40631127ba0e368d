"""The driver's checkpoint files: writing the bytes rank 0 uploads, which complete checkpoints
this run has, pruning. Writes run on one background thread, so a slow disk never stalls the
event loop (heartbeats would look late); see docs/architecture.md, "Run directory". An exception
there other than a failed write (``OSError``: that checkpoint is skipped) is reported once, as
what it costs (run/background.py), and ends the writes."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..run.background import LOGGED, BackgroundFailures
from ..transport import protocol as p
from . import checkpoint
from .best import BestCheckpoints

log = logging.getLogger(__name__)

#: What a failure of the writer's thread costs, as its warning and ``run.json`` say (run/background.py).
FAILURE_COST = "no further checkpoint is written, so a lost job resumes from the last one on disk"


@dataclasses.dataclass(frozen=True)
class _Written:
    """A finished write: ``path`` or ``error``, and what the metrics record says of it."""

    unit: int
    epoch: int
    worker: int
    generation: int
    path: Path | None
    seconds: float
    error: str | None = None


class CheckpointBook:
    """The complete checkpoints of this run, by unit.

    Args:
        directory: the run's ``checkpoints/``.
        framework: the framework's name, recorded in each checkpoint.
        keep: how many of the newest to keep.
        units_per_epoch: the schedule's (a checkpoint's record names its epoch).
        metrics: the run's metrics log (a record per checkpoint and per resume).
        wrap_stream: the driver hooks' ``wrap_checkpoint_stream`` seam (docs/architecture.md,
            "Testing seams").
        best: which of the older checkpoints to spare by a monitored metric, if any.
        epoch_logs: ``epoch -> logs`` (training averages and ``val_`` metrics) the driver has so far.
        on_written: called with ``(unit, epoch, file name)`` once a checkpoint is on disk (the
            display's mark, the driver loggers' ``on_checkpoint`` and ``on_step_checkpoint``).
        failures: what reports a failure of the writer's thread (the driver's records it in
            ``run.json``); after one, checkpoints are no longer accepted and nothing waits for it.
    """

    def __init__(
        self,
        directory: Path,
        framework: str,
        keep: int,
        units_per_epoch: int,
        metrics: Any,
        wrap_stream: Any = None,
        best: BestCheckpoints | None = None,
        epoch_logs: Callable[[int], dict[str, float]] | None = None,
        on_written: Callable[[int, int, str], None] | None = None,
        failures: BackgroundFailures | None = None,
    ) -> None:
        self.directory, self.framework, self.keep, self.metrics = directory, framework, keep, metrics
        self.units_per_epoch = units_per_epoch
        self.wrap_stream = wrap_stream
        self.best, self.epoch_logs, self.on_written = best, epoch_logs, on_written
        self._scored: dict[int, float] = {}  # what the spared set was last computed from
        self.by_unit: dict[int, Path] = {}
        self.accepted = -1  # the newest checkpoint handed to the writer (written or not yet)
        self._todo: queue.Queue[tuple[int, int, int, int, bytes | dict[str, Any]] | None] = queue.Queue()
        self._done: queue.Queue[_Written] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._writing = 0  # checkpoints handed to the writer and not yet written
        self._writing_lock = threading.Lock()
        self._failures = failures if failures is not None else LOGGED
        self.failed = False  # the writer's thread failed (reported): no checkpoint is written any more

    def prepare(self, resumed: checkpoint.CheckpointInfo | None, iteration: int, record: bool = True) -> None:
        """A fresh run starts with no checkpoint; a resumed one keeps those up to its own.
        ``record``: say the resume in the metrics and the log (not when workers that were taken
        back go on from a later state)."""
        checkpoint.remove_temp_files(self.directory)  # no writer of this run has started yet
        if resumed is None:
            old = checkpoint.list_checkpoints(self.directory)
            if old:  # else a later resume=True could pick another run's checkpoint
                log.warning("removing %d checkpoint(s) of an earlier run in %s", len(old), self.directory)
            for _, path in old:
                path.unlink(missing_ok=True)
            return
        checkpoint.set_aside_after(self.directory, resumed.unit)
        self.by_unit = dict(checkpoint.list_checkpoints(self.directory))
        self.by_unit[resumed.unit] = resumed.path
        self.accepted = resumed.unit
        if record:
            self.say_resumed(resumed, iteration)

    def say_resumed(self, resumed: checkpoint.CheckpointInfo, iteration: int) -> None:
        """Say the resume from ``resumed`` in the metrics and the log."""
        self.metrics.resume(
            checkpoint=resumed.path.name, resume_unit=resumed.unit, epoch=resumed.epoch, iteration=iteration
        )
        # Named as the preemption line names it: the last step done, counted from 1.
        per_epoch, done = resumed.plan.steps_per_epoch, resumed.steps_done
        where = f"after epoch {(done - 1) // per_epoch + 1}, step {(done - 1) % per_epoch + 1}/{per_epoch}"
        log.info("resuming from %s: %s", resumed.path.name, where if done else "no step was done")

    def newest_on_disk(self, limit: int) -> tuple[int, Path] | None:
        """This run's newest recorded checkpoint at or below unit ``limit`` that is still on disk."""
        for unit, path in sorted(self.by_unit.items(), reverse=True):
            if unit <= limit and path.exists():
                return unit, path
        return None

    def has_any(self) -> bool:
        return bool(self.by_unit) or self.accepted >= 0

    def settings(self, restore: str | None = None) -> p.CheckpointSettings:
        return p.CheckpointSettings(str(self.directory), self.framework, self.accepted, restore)

    # -- writing ------------------------------------------------------------------------------
    def store(self, worker_id: int, generation: int, unit: int, data: bytes | dict[str, Any]) -> None:
        """Write the checkpoint of ``unit`` that ``worker_id`` (rank 0 of ``generation``) uploaded:
        its bytes, or its record (complete), which the writer's thread encodes. Dropped once the
        thread has failed (reported then): not accepted, so nothing counts on it."""
        with self._writing_lock:
            if self.failed:
                log.debug("checkpoint of unit %d dropped: the checkpoint writer failed", unit)
                return
            self._writing += 1
        self.accepted = max(self.accepted, unit)
        if self._writer is None:
            self._writer = self._failures.thread(
                self._write_loop,
                name="fabric-checkpoints",
                what="the checkpoint writer",
                cost=FAILURE_COST,
                on_failure=self._failed,
            )
        self._todo.put((worker_id, generation, unit, unit // self.units_per_epoch, data))

    def _write_loop(self) -> None:
        while (item := self._todo.get()) is not None:
            worker, generation, unit, epoch, data = item
            started = time.monotonic()
            try:
                if isinstance(data, dict):
                    data = checkpoint.encode_state(data)
                path: Path | None = checkpoint.write_checkpoint(self.directory, unit, data, self.wrap_stream)
                error = None
            except OSError as exc:
                path, error = None, str(exc)
            self._done.put(_Written(unit, epoch, worker, generation, path, time.monotonic() - started, error))
            with self._writing_lock:
                self._writing -= 1

    def _failed(self) -> None:
        """The thread ended in an exception: what was queued will never be written, so no one waits for it."""
        with self._writing_lock:
            self.failed, self._writing = True, 0

    def finish_writes(self, timeout: float) -> None:
        """Wait (bounded) for the checkpoints being written, and record them: a restore must see
        the newest one a worker finished uploading even while the disk still writes it."""
        deadline = time.monotonic() + timeout
        while self._writing and time.monotonic() < deadline:
            time.sleep(0.002)
        self.poll()

    def poll(self) -> None:
        """Record the writes that finished (on the event loop's thread): metrics, pruning; and
        prune again when a checkpoint's score came (a validation ends after its checkpoint)."""
        while True:
            try:
                self._record(self._done.get_nowait())
            except queue.Empty:
                break
        if self.best is not None and self._scores() != self._scored:
            self._prune()

    def at_epoch_end(self, unit: int) -> bool:
        """Whether the checkpoint of ``unit`` holds the state after an epoch's last step (it is
        taken before that epoch's validation slot), not one inside an epoch (``checkpoint_steps``,
        a preemption's)."""
        return unit % self.units_per_epoch == self.units_per_epoch - 1

    def _scores(self) -> dict[int, float]:
        """The monitored value of each checkpoint at an epoch's end whose epoch's logs have it (one
        inside an epoch holds other weights than the epoch's metrics measured: it is never scored)."""
        assert self.best is not None and self.epoch_logs is not None
        scores = {}
        for unit in filter(self.at_epoch_end, self.by_unit):
            value = self.epoch_logs(unit // self.units_per_epoch).get(self.best.monitor)
            if value is not None:
                scores[unit] = float(value)
        return scores

    def _prune(self) -> list[Path]:
        """Delete the checkpoints neither among the newest ``keep`` nor spared as the best."""
        spare: set[int] = set()
        if self.best is not None:
            self._scored = scores = self._scores()
            # Only checkpoints at an epoch's end are candidates (or wait for their score); those
            # inside an epoch are kept as the newest ``keep`` only.
            spare = self.best.protected(sorted(filter(self.at_epoch_end, self.by_unit)), scores)
        removed = checkpoint.prune(self.directory, self.keep, spare)
        self.by_unit = {u: q for u, q in self.by_unit.items() if q not in removed}
        if self.best is not None:
            names = {u: q.name for u, q in self.by_unit.items()}
            self.best.write_record(self.directory, {u: v for u, v in self._scored.items() if u in names}, names)
        return removed

    def close(self, timeout: float) -> None:
        """Let the queued writes finish (the last epoch's checkpoint is on disk when train() returns)."""
        if self._writer is not None:
            self._todo.put(None)
            self._writer.join(timeout)
            self._writer = None
        self.poll()

    def _record(self, done: _Written) -> None:
        where = {"unit": done.unit, "epoch": done.epoch, "worker": done.worker, "generation": done.generation}
        if done.path is None:
            self.metrics.checkpoint(**where, error=done.error)
            log.warning(
                "checkpoint after epoch %d not written: %s; the previous one stays the newest and training goes on",
                done.epoch + 1,
                done.error,
            )
            return
        self.by_unit[done.unit] = done.path
        # Only now that the new one is durable may the oldest go.
        removed = self._prune()
        self.metrics.checkpoint(
            **where,
            path=f"checkpoints/{done.path.name}",
            seconds=done.seconds,
            removed=[q.name for q in removed],
        )
        said = f"after epoch {done.epoch + 1}"
        if not self.at_epoch_end(done.unit):  # checkpoint_steps', a preemption's
            said = (
                f"in epoch {done.epoch + 1}, after step {done.unit % self.units_per_epoch}/{self.units_per_epoch - 1}"
            )
        log.info("checkpoint %s %s (%.3f s)", done.path.name, said, done.seconds)
        if self.on_written is not None:
            self.on_written(done.unit, done.epoch, done.path.name)
