"""The driver told to go: a preemption signal caught while training runs (docs/architecture.md,
"Preemption").

Kubernetes evicts a pod with SIGTERM and a grace period, Slurm signals a job before its
allocation ends, a spot VM gets a warning. The driver catches ``FABRIC_MODEL_PREEMPT_SIGNALS``
while ``train()`` runs; its event loop then ends training as when replicas diverge (every member
is sent ``Abort``; the members are asked for their state, rank 0 first), writes the state it
gets as a checkpoint (else the newest state it holds), stops every worker and raises
:class:`Preempted`, all within ``FABRIC_MODEL_PREEMPT_GRACE``.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any


class Preempted(Exception):
    """Training was ended by a preemption signal once the newest state was saved.

    Attributes:
        signal_name: the signal ("SIGTERM").
        checkpoint: the checkpoint to resume from (None: no step was done yet).
        unit: the unit it resumes at.
        position: where that is, for a person ("after epoch 2, step 7").
        seconds: from the signal to the state on disk.
    """

    def __init__(self, signal_name: str, checkpoint: Path | None, unit: int, position: str, seconds: float) -> None:
        where = f"{checkpoint.name}, {position}" if checkpoint is not None else "the start (no step was done)"
        super().__init__(f"{signal_name}: training stopped; resumes from {where}")
        self.signal_name, self.checkpoint, self.unit = signal_name, checkpoint, unit
        self.position, self.seconds = position, seconds


class SignalWatch:
    """Catches the preemption ``signals`` for as long as it is entered, and restores the
    handlers it replaced. Python delivers signals to the main thread only: ``train()`` called
    from another thread leaves the signals as they were (the notice then reaches nobody)."""

    def __init__(self, signals: tuple[str, ...], grace: float) -> None:
        self.signals, self.grace = signals, grace
        #: Seconds of the grace kept for writing the state and stopping the workers.
        self.reserve = min(5.0, grace / 3)
        self.signal_name: str | None = None
        self.received = 0.0
        self.acted = False  # the driver stopped training for it
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                number = int(getattr(signal, name))
                self._previous[number] = signal.signal(number, self._caught)
        return self

    def __exit__(self, *exc: object) -> None:
        """Restore the handlers; a signal caught and never acted on (training ended first) is
        raised again, so the program gets it as it would have without us."""
        for number, handler in self._previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        previous, self._previous = self._previous, {}
        if self.signal_name is not None and not self.acted and previous:
            signal.raise_signal(getattr(signal, self.signal_name))

    def _caught(self, number: int, frame: FrameType | None) -> None:
        if self.signal_name is None:  # the first one counts; the grace runs from it
            self.signal_name, self.received = signal.Signals(number).name, time.monotonic()

    @property
    def deadline(self) -> float:
        """When everything must be done (``received`` + grace)."""
        return self.received + self.grace
