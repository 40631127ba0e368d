"""Logger callbacks: the user's, the default progress bar, and how metrics are averaged.

A logger is any object with some of these methods (missing ones are skipped):

- ``on_train_begin()``, ``on_train_end()``;
- ``log_train_metrics(metrics, iteration, epoch, workers)``: on a worker, after each step,
  with that step's metrics and the worker's own iteration count; on the driver, after each
  step, with the sample-weighted averages over the epoch so far (loss included), the
  number of steps completed and the number of live workers;
- ``log_test_metrics(metrics, iteration, epoch)``: after each validation.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

HOOKS = ("on_train_begin", "on_train_end", "log_train_metrics", "log_test_metrics")


def call_hook(logger: Any, hook: str, *args: Any) -> None:
    """Call ``logger.hook(*args)`` if the logger defines it."""
    if logger is None:
        return
    method = getattr(logger, hook, None)
    if callable(method):
        method(*args)


def stat_means(names: Sequence[str], sums: Sequence[float]) -> dict[str, float]:
    """Turn ``[sum_0, ..., sum_k, count]`` into ``{name: sum / count}``."""
    count = sums[-1]
    return {name: (float(s) / count if count else float("nan")) for name, s in zip(names, sums)}


class EpochAverage:
    """Sample-weighted running sums of the loss and metrics over the current epoch."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.epoch = -1
        self._sums = [0.0] * (len(self.names) + 1)

    def add(self, epoch: int, sums: Sequence[float]) -> dict[str, float]:
        if epoch != self.epoch:
            self.epoch, self._sums = epoch, [0.0] * (len(self.names) + 1)
        self._sums = [a + float(b) for a, b in zip(self._sums, sums)]
        return stat_means(self.names, self._sums)


class MetricsLog:
    """The run's metric record: one JSON line per step and per validation (``logs/metrics.jsonl``)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")  # one run per directory
        self._flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        # Flushing every step costs the driver CPU that the workers share; once a second
        # keeps the file fresh for someone watching it. Every record but a step is flushed.
        now = time.monotonic()
        if record.get("type") != "train" or now - self._flushed > 1.0:
            self._file.flush()
            self._flushed = now

    def close(self) -> None:
        self._file.close()


class ProgressBar:
    """The default driver logger: one refreshing line with epoch, step, loss, samples/s, workers."""

    def __init__(self, epochs: int, steps_per_epoch: int, global_batch: int, stream: TextIO | None = None) -> None:
        self.epochs, self.steps_per_epoch, self.global_batch = epochs, steps_per_epoch, global_batch
        self.stream = stream if stream is not None else sys.stderr
        self._last_draw = 0.0
        self._t0 = time.monotonic()
        self._steps_at_t0 = 0

    def on_train_begin(self) -> None:
        self._t0 = time.monotonic()

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        now = time.monotonic()
        if self._steps_at_t0 == 0:  # rate from the first step on: start-up is not throughput
            self._t0, self._steps_at_t0 = now, iteration
            return
        step_in_epoch = iteration - epoch * self.steps_per_epoch
        last = step_in_epoch == self.steps_per_epoch
        if now - self._last_draw < 0.2 and not last:
            return  # redrawing more often costs time and shows nothing
        self._last_draw = now
        rate = (iteration - self._steps_at_t0) * self.global_batch / max(now - self._t0, 1e-9)
        width = 20
        done = int(width * step_in_epoch / max(1, self.steps_per_epoch))
        values = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        line = (
            f"\repoch {epoch + 1}/{self.epochs} [{'#' * done}{'.' * (width - done)}] "
            f"step {step_in_epoch}/{self.steps_per_epoch} {values} {rate:,.0f} samples/s workers={workers}"
        )
        self.stream.write(line + ("\n" if last else ""))
        self.stream.flush()

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        values = " ".join(f"val_{k}={v:.4f}" for k, v in metrics.items())
        self.stream.write(f"epoch {epoch + 1}/{self.epochs} validation: {values}\n")
        self.stream.flush()

    def note(self, line: str) -> None:
        """A line of its own under the bar (what happened after training, say)."""
        self.stream.write(line + "\n")
        self.stream.flush()


class Callback:
    """Base class for user callbacks (``user_callback=[...]``); every hook is a no-op.

    Callbacks run **in every worker**, on that worker's replica, so a change they make (a
    learning rate set in ``on_epoch_begin``) reaches every replica identically. Where each
    hook runs:

    - ``on_train_begin()`` / ``on_train_end()``: once per worker, when it starts training
      (a worker that joins mid-run calls it on joining) and when the schedule ends;
    - ``on_epoch_begin(epoch)``: before the first step of each epoch (a worker that joins
      mid-epoch starts from the optimizer state it pulled, which carries any learning rate
      set earlier); ``on_epoch_end(epoch)``: after the epoch's last step, before validation;
    - ``on_batch_begin(step)`` / ``on_batch_end(step)``: around each optimizer step (``step``
      within the epoch; a step redone after a failure runs them again).

    Attributes:
        params: ``optimizer``, ``epochs``, ``batch_size``, ``steps_per_epoch``, ``seed``.
        model: the worker's model (on its device).
    """

    params: dict[str, Any]
    model: Any

    def set_context(self, model: Any, params: dict[str, Any]) -> None:
        self.model, self.params = model, params

    def on_train_begin(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass

    def on_epoch_begin(self, epoch: int) -> None:
        pass

    def on_epoch_end(self, epoch: int) -> None:
        pass

    def on_batch_begin(self, step: int) -> None:
        pass

    def on_batch_end(self, step: int) -> None:
        pass


def run_callbacks(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
    for callback in callbacks:
        getattr(callback, hook)(*args)
