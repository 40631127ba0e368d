"""The newest committed snapshot, on disk: ``<run_dir>/checkpoints/snapshot.pt``.

Snapshots that rank 0 uploads every few steps or seconds (docs/architecture.md, "Elasticity")
serve rollbacks from the driver's memory; this writes the newest one whose steps are all
committed to the run directory as well, so that a whole-job loss (the driver killed without
notice with its workers, a lost host) costs at most the snapshot interval instead of the
checkpoint interval: ``resume`` takes it when it is newer than the newest checkpoint
(:func:`fabric_model.state.checkpoint.newest_resume_state`).

One file, replaced atomically (the previous one stays whole until the new one is), so the disk
holds one state, not one per snapshot. It has a checkpoint's format, less what does not change:
the job's frozen parameters (those the record's ``base`` names) are left out and a sample of
each kept instead. A resume puts the job's values back and keeps the whole as the checkpoint
of its unit (:func:`adopt_snapshot`), once the samples show they are the values it trained
with. The writes run on a thread of their own, newest first: a snapshot offered while one is
written replaces any that waits, so a slow disk skips snapshots rather than queueing them, and
the writes take at most :data:`WRITE_SHARE` of that thread's time (a large model's snapshots
reach the disk less often than the memory). An exception on that thread is reported once, as what
it costs (run/background.py), and ends the snapshots on disk; training goes on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..run.background import LOGGED, BackgroundFailures
from ..run.rundir import atomic_write
from .checkpoint import SNAPSHOT_NAME, CheckpointInfo, checkpoint_name, encode_state, read_info
from .frozen import BASE

log = logging.getLogger(__name__)

#: The record's samples of the frozen parameters it leaves out: name -> (shape, sample).
BASE_SAMPLES = "base_samples"
_SAMPLE = 4096  # elements a frozen tensor's sample holds (evenly spaced)


def _sample_index(numel: int, k: int = _SAMPLE) -> Any:
    """``min(numel, k)`` evenly spaced indices into ``numel`` elements, the first and the last among
    them, exact at any size: in integers, where a float32 ``linspace`` rounds ``numel - 1`` up past
    the end from 2**24 elements on (index 64,000,000 of a 500,000 x 128 embedding)."""
    import torch

    if numel <= k:
        return torch.arange(numel, dtype=torch.int64)
    return torch.arange(k, dtype=torch.int64) * (numel - 1) // (k - 1)  # < 2**63 up to 2**51 elements


def _sample(tensor: Any) -> tuple[list[int], Any]:
    """``(shape, up to _SAMPLE evenly spaced elements)`` of a tensor: what tells the job's frozen values
    from values built anew (another random draw, another file) without writing them."""
    flat = tensor.detach().reshape(-1)
    index = _sample_index(flat.numel())
    return list(tensor.shape), flat[index.to(flat.device)].cpu().clone()


def _same(tensor: Any, saved: Any) -> bool:
    import torch

    shape, sample = _sample(tensor)
    return bool(shape == list(saved[0]) and sample.dtype == saved[1].dtype and torch.equal(sample, saved[1]))


#: The most of a driver thread's time the writes take: a write of ``s`` seconds is followed by
#: none for ``s / WRITE_SHARE - s`` (a 1 s write of a large model at most every 10 s; a small
#: model's every snapshot).
WRITE_SHARE = 0.1


def _write_all(file: Any, data: bytes) -> None:
    file.write(data)


#: What a failure of the writer's thread costs, as its warning and ``run.json`` say (run/background.py).
FAILURE_COST = "snapshots no longer reach the disk, so a lost job resumes from the last checkpoint"


class DurableSnapshot:
    """Writes the newest committed snapshot offered to ``directory / SNAPSHOT_NAME``.

    Args:
        directory: the run's ``checkpoints/``.
        failures: what reports a failure of the writer's thread (the driver's records it in
            ``run.json``); after one, offers are dropped and nothing waits for the thread.
    """

    def __init__(self, directory: Path, failures: BackgroundFailures | None = None) -> None:
        self.path = directory / SNAPSHOT_NAME
        self._failures = failures if failures is not None else LOGGED
        self.failed = False  # the thread failed (reported): no snapshot is written any more
        self._samples: dict[str, tuple[list[int], Any]] = {}  # the frozen parameters' (fixed) samples
        self.written_unit = -1  # the unit of the snapshot on disk (-1: none of this run)
        self.last: tuple[int, int, float] | None = None  # (unit, bytes, seconds) of the last write
        self._offered = -1
        self._waiting: tuple[int, dict[str, Any]] | None = None
        self._busy = False
        self._closed = False
        self._hurry = False  # flush(): the next write starts now, whatever WRITE_SHARE says
        self._next_at = 0.0  # when the next write may start (WRITE_SHARE)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def offer(self, unit: int, record: dict[str, Any]) -> None:
        """Write the complete state record of ``unit`` (its steps all committed) when the thread is free."""
        with self._cond:
            if unit <= self._offered or self._closed:
                return
            self._offered = unit
            self._waiting = (unit, record)
            if self._thread is None:
                self._thread = self._failures.thread(
                    self._write_loop,
                    name="fabric-snapshot",
                    what="the durable snapshot writer",
                    cost=FAILURE_COST,
                    on_failure=self._failed,
                )
            self._cond.notify()

    def _failed(self) -> None:
        """The thread ended in an exception: closed, so that an offer is dropped and a flush does not
        wait for a write that will never come."""
        with self._cond:
            self.failed = self._closed = True
            self._waiting, self._busy = None, False
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._next_at - time.monotonic()
                    if self._waiting is not None and (wait <= 0 or self._hurry):
                        break
                    self._cond.wait(wait if self._waiting is not None else None)
                if self._waiting is None:
                    return
                (unit, record), self._waiting = self._waiting, None
                self._busy = True
            began = time.monotonic()
            try:
                data = encode_state(self._on_disk(record))
                del record
                atomic_write(self.path, functools.partial(_write_all, data=data))
            except OSError as exc:  # a full disk: the previous snapshot stays; training goes on
                log.warning("snapshot of unit %d not written to %s: %s", unit, self.path, exc)
            else:
                seconds = time.monotonic() - began
                self._next_at = began + seconds / WRITE_SHARE
                self.written_unit, self.last = unit, (unit, len(data), seconds)
                log.debug("snapshot of unit %d on disk: %d bytes in %.3f s", unit, len(data), seconds)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _on_disk(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record less the job's frozen parameters, with a sample of each (computed once: they
        are the job's and do not change)."""
        base = set(record.get(BASE) or ())
        if not base:
            return record
        model = record["model"]
        for name in base - self._samples.keys():
            self._samples[name] = _sample(model[name])
        kept = {k: v for k, v in model.items() if k not in base}
        return {**record, "model": kept, BASE_SAMPLES: {name: self._samples[name] for name in sorted(base)}}

    def flush(self, timeout: float) -> None:
        """Wait (bounded) until the snapshot offered last is on disk."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            while (self._waiting is not None or self._busy) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._hurry = False

    def close(self, timeout: float) -> None:
        """Finish the write under way (bounded); no further one starts."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._waiting = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def remove(self) -> None:
        """No snapshot on disk: a fresh run's directory, or a run that finished (its checkpoints and
        model hold the result)."""
        self.path.unlink(missing_ok=True)


def adopt_snapshot(info: CheckpointInfo, frozen: dict[str, Any], order: list[str]) -> CheckpointInfo | None:
    """The snapshot a run resumes from, made whole with the job's frozen values (``frozen``, the
    user's model's, by state name; ``order``: the model's state names) and kept as the checkpoint
    of its unit: the resumed run writes snapshots of its own over :data:`SNAPSHOT_NAME`, while its
    first state must stay on disk, and a checkpoint is complete. None, the snapshot set aside,
    where the job's frozen values are not those it trained with (a model built anew): the caller
    goes back to the newest checkpoint."""
    import torch

    record = torch.load(info.path, map_location="cpu", weights_only=True)
    saved = record.pop(BASE_SAMPLES, None) or {}
    missing = [name for name in saved if name not in frozen or not _same(frozen[name], saved[name])]
    if missing:
        aside = info.path.with_name(info.path.name + ".unusable")
        info.path.replace(aside)
        log.warning(
            "not resuming from the snapshot of unit %d: %d frozen parameter(s) (%s) are not the values it was "
            "trained with (the model was built anew); set aside as %s",
            info.unit,
            len(missing),
            ", ".join(missing[:3]),
            aside.name,
        )
        return None
    if saved:
        model = {**record["model"], **{name: frozen[name].detach().cpu() for name in saved}}
        record["model"] = {k: model[k] for k in order if k in model} | model  # the model's order
    path = info.path.with_name(checkpoint_name(info.unit))
    data = encode_state(record)
    atomic_write(path, functools.partial(_write_all, data=data))
    info.path.unlink(missing_ok=True)
    log.info("the snapshot of unit %d on disk is kept as %s", info.unit, path.name)
    return read_info(path)
