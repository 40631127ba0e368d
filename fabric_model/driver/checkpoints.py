"""The driver's checkpoint bookkeeping: which complete checkpoints this run has, pruning, and
what a generation must load. Workers write the files (``fabric_model.checkpoint``); see
docs/architecture.md, "Run directory"."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .. import checkpoint
from .. import protocol as p

log = logging.getLogger(__name__)


class CheckpointBook:
    """The complete checkpoints of this run, by unit.

    Args:
        directory: the run's ``checkpoints/``.
        framework: the framework's name, recorded in each checkpoint.
        keep: how many of the newest to keep.
        metrics: the run's metrics log (a record per checkpoint and per resume).
    """

    def __init__(self, directory: Path, framework: str, keep: int, metrics: Any) -> None:
        self.directory, self.framework, self.keep, self.metrics = directory, framework, keep, metrics
        self.by_unit: dict[int, Path] = {}

    def prepare(self, resumed: checkpoint.CheckpointInfo | None, iteration: int) -> None:
        """A fresh run starts with no checkpoint; a resumed one keeps those up to its own."""
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
        self.metrics.resume(
            checkpoint=resumed.path.name, resume_unit=resumed.unit, epoch=resumed.epoch, iteration=iteration
        )
        log.info("resuming from %s at unit %d (epoch %d done)", resumed.path.name, resumed.unit, resumed.epoch + 1)

    def restore_point(self, unit: int) -> Path | None:
        """This run's complete checkpoint of ``unit``; one on disk whose report has not arrived
        (its writer died right after the rename) counts too: complete files only get that name."""
        path = self.by_unit.get(unit, self.directory / checkpoint.checkpoint_name(unit))
        if not path.exists():
            return None
        self.by_unit[unit] = path
        return path

    def has_any(self) -> bool:
        return bool(self.by_unit)

    def settings(self, restore: Path | None) -> p.CheckpointSettings:
        return p.CheckpointSettings(
            str(self.directory), self.framework, max(self.by_unit, default=-1), str(restore) if restore else None
        )

    def written(self, worker_id: int, message: p.CheckpointWritten) -> None:
        """A worker wrote (or failed to write) a checkpoint: record it, then prune old ones."""
        where = {"unit": message.unit, "epoch": message.epoch, "worker": worker_id, "generation": message.generation}
        if message.error or message.path is None:
            self.metrics.checkpoint(**where, error=message.error)
            log.warning(
                "checkpoint after epoch %d failed on worker %d: %s; the previous one stays the newest and "
                "training goes on",
                message.epoch + 1,
                worker_id,
                message.error,
            )
            return
        path = Path(message.path)
        self.by_unit[message.unit] = path
        # Only now that the new one is durable may the oldest go.
        removed = checkpoint.prune(self.directory, self.keep)
        self.by_unit = {u: q for u, q in self.by_unit.items() if q not in removed}
        self.metrics.checkpoint(
            **where,
            path=f"checkpoints/{path.name}",
            seconds=message.seconds,
            removed=[q.name for q in removed],
        )
        log.info("checkpoint %s after epoch %d", path.name, message.epoch + 1)
