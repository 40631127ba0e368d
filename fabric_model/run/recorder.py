"""The driver's record for people and tools: TensorBoard scalars and ``logs/metrics.csv`` (a leaf module).

:class:`RunRecorder` is a driver hook object, held by the driver's ``Hooks`` next to the
progress display (``train(tensorboard=False)`` leaves it out). TensorBoard tags:
``train/<name>`` per step (that step's own mean), ``epoch/<name>`` per epoch (the epoch's
sample-weighted average), ``val/<name>`` per validation, ``workers`` (the live worker count,
per step and at each generation), ``generation`` (its number, at the step it formed),
``samples_per_s`` (per epoch, from the first step this process saw: start-up and a resume's
set-up are not throughput), and ``lr`` when a metric of that name is reported. The x axis of the
per-epoch scalars (``epoch/*``, ``val/*``, ``samples_per_s``) is the epoch, counted from 1 as in
the CSV and the progress lines (Keras' TensorBoard callback logs its epoch scalars by epoch too,
from 0); that of the others the global iteration (steps committed). The CSV has one row per
epoch, as Keras' ``CSVLogger``, written once the epoch's validation is in (the driver's ledger
passes a validation on only after its epoch's last step, however the reports arrived).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from .tb_events import EventWriter

#: Event files are flushed at most this often (seconds), and at epoch ends and generation changes.
FLUSH_INTERVAL = 2.0


class RunRecorder:
    """Writes TensorBoard events under ``tensorboard_dir`` and one CSV row per epoch to ``csv_path``.

    Args:
        tensorboard_dir: the directory ``tensorboard --logdir`` is pointed at.
        csv_path: the CSV file (a resumed run keeps the rows of the epochs before the one it redoes).
        stat_names: "loss" and the metrics, the CSV's columns (``val_`` ones too with validation).
        global_batch, steps_per_epoch: samples per step (for ``samples_per_s``), steps per epoch.
    """

    def __init__(
        self, tensorboard_dir: Path, csv_path: Path, stat_names: list[str], global_batch: int, steps_per_epoch: int
    ) -> None:
        self.tensorboard_dir, self.csv_path = tensorboard_dir, csv_path
        self.stat_names, self.global_batch = list(stat_names), global_batch
        self.steps_per_epoch = steps_per_epoch
        self._writer: EventWriter | None = None
        self._csv_file: Any = None
        self._row: dict[str, Any] | None = None  # the last epoch's row, until its validation is in
        self._start: tuple[float, int] | None = None  # (time, iteration) of the first step seen
        self._flushed = 0.0
        self._workers = 0

    # -- files -----------------------------------------------------------------------------
    def _events(self) -> EventWriter:
        if self._writer is None:  # opened on first use: a run that fails before training leaves none
            self._writer = EventWriter(self.tensorboard_dir)
        return self._writer

    def _write_row(self) -> None:
        if self._row is None:
            return
        columns = ["epoch", "iteration", "workers", "samples_per_s", *self.stat_names]
        columns += [f"val_{n}" for n in self.stat_names]
        if self._csv_file is None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._earlier_rows(int(self._row["epoch"]))
            self._csv_file = open(self.csv_path, "w", newline="", encoding="utf-8")
            self._csv = csv.DictWriter(self._csv_file, columns, extrasaction="ignore")
            self._csv.writeheader()
            self._csv.writerows(kept)
        self._csv.writerow(self._row)
        self._csv_file.flush()
        self._row = None

    def _earlier_rows(self, epoch: int) -> list[dict[str, str]]:
        """A resumed run's rows before ``epoch``: epochs after the checkpoint it resumed from are
        trained again, and their rows written again, not twice."""
        if not self.csv_path.exists():
            return []
        with open(self.csv_path, newline="", encoding="utf-8") as f:
            return [row for row in csv.DictReader(f) if row.get("epoch", "").isdigit() and int(row["epoch"]) < epoch]

    # -- hooks -----------------------------------------------------------------------------
    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        """A committed step's own means (``metrics``) at global ``iteration``."""
        now = time.time()
        if self._start is None:
            self._start = (now, iteration)
        if self._row is not None and self._row["epoch"] != epoch + 1:
            self._write_row()  # the previous epoch had no validation
        events = self._events()
        for name, value in metrics.items():
            events.scalar(f"train/{name}", value, iteration, now)
            if name in ("lr", "learning_rate"):
                events.scalar("lr", value, iteration, now)
        if workers != self._workers:
            events.scalar("workers", workers, iteration, now)
            self._workers = workers
        if now - self._flushed > FLUSH_INTERVAL:
            events.flush()
            self._flushed = now

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        """The epoch's averages so far; at the epoch's last step they are the epoch's."""
        if self._start is None or iteration != (epoch + 1) * self.steps_per_epoch:
            return
        now, (t0, i0) = time.time(), self._start
        rate = (iteration - i0) * self.global_batch / (now - t0) if iteration > i0 and now > t0 else None
        events = self._events()
        for name, value in metrics.items():
            events.scalar(f"epoch/{name}", value, epoch + 1, now)
        if rate is not None:
            events.scalar("samples_per_s", rate, epoch + 1, now)
        events.scalar("workers", workers, iteration, now)
        events.flush()
        self._row = {"epoch": epoch + 1, "iteration": iteration, "workers": workers, **metrics}
        self._row["samples_per_s"] = "" if rate is None else f"{rate:.1f}"

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        """A validation after ``epoch``: completes its row."""
        events, now = self._events(), time.time()
        for name, value in metrics.items():
            events.scalar(f"val/{name}", value, epoch + 1, now)
        events.flush()
        if self._row is not None and self._row["epoch"] == epoch + 1:
            self._row.update({f"val_{k}": v for k, v in metrics.items()})
            self._write_row()

    def on_generation(self, record: dict[str, Any]) -> None:
        """A generation formed: its number and size at the iteration it resumes from."""
        events, now, at = self._events(), time.time(), int(record.get("iteration", 0))
        events.scalar("generation", record["generation"], at, now)
        events.scalar("workers", len(record["members"]), at, now)
        self._workers = len(record["members"])
        events.flush()

    def on_train_end(self) -> None:
        self.close()

    def close(self) -> None:
        self._write_row()
        if self._writer is not None:
            self._writer.close()
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
