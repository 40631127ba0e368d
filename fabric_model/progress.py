"""The default driver display: one refreshing progress line (a leaf module: no torch)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
