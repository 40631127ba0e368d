"""The job of tests/test_ray.py, in a module beside the test: the workers must import it from
the script's folder that the Ray runtime_env carried to them (cloudpickle ships these by name)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fabric_model.context import worker_context

from .helpers import make_data
from .load import scaled

DATA = make_data(240)  # 10 steps an epoch of 24 samples


def datasets():
    return DATA, DATA[:40]


class Pace:
    """A worker logger: records where this module was imported from; while ``<dir>/resized``
    is absent and ``workers == pace_while``, sleeps after each step from ``pace_from`` on (so a
    node change lands mid-run); sleeps ``every`` seconds after every step; with ``hold_at``
    workers, waits once for a join to be pending (so the join lands before the end, however
    long the new node takes)."""

    def __init__(
        self, marker_dir: str, pace_while: int = 0, pace_from: int = 3, hold_at: int = 0, every: float = 0.0
    ) -> None:
        self.marker_dir, self.pace_while, self.pace_from, self.hold_at = marker_dir, pace_while, pace_from, hold_at
        self.every = every  # seconds slept after every step
        self.held = False
        self.wait_up_to = scaled(60.0)  # measured here, in the test's process, and pickled with the logger

    def on_train_begin(self) -> None:
        Path(self.marker_dir, f"module-{os.getpid()}").write_text(__file__)

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        time.sleep(self.every)
        resized = Path(self.marker_dir, "resized")
        deadline = time.monotonic() + self.wait_up_to
        if workers == self.pace_while and iteration >= self.pace_from:
            while not resized.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if workers == self.hold_at and not self.held:
            self.held = True
            ctx = worker_context()
            while ctx is not None and not ctx.join_pending and time.monotonic() < deadline:
                time.sleep(0.05)


class ResizeAt:
    """A driver logger: when ``iteration`` reaches ``at``, runs ``action`` on a thread (so the
    driver's loop goes on), which ends by creating ``<dir>/resized``."""

    def __init__(self, at: int, action, marker_dir: str) -> None:
        self.at, self.action, self.marker_dir = at, action, marker_dir
        self.thread = None
        self.generation_times: list[float] = []

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        import threading

        if iteration >= self.at and self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.action()
        finally:
            Path(self.marker_dir, "resized").write_text(repr(time.time()))

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(scaled(60.0) if timeout is None else timeout)
