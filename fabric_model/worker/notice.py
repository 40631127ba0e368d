"""A notice to leave, in a worker: a preemption signal (docs/architecture.md, "Preemption").

Platforms take machines back with notice: Kubernetes sends SIGTERM and waits 30 s, Slurm sends
the signal named in ``--signal`` before an allocation ends, a spot VM gets a warning. A worker
that gets one of ``FABRIC_MODEL_PREEMPT_SIGNALS`` finishes the step it is in, votes in that
step's allreduce to leave, and exits 0 once its generation has ended after that step, so its
peers go on with no failed collective and no redone step. A worker that holds no state yet
(setting up, waiting to join) leaves at once. One that cannot finish within
``FABRIC_MODEL_PREEMPT_GRACE`` exits as the signal would have ended it, and the others
recover as from any lost worker.

The signal is read on a thread from Python's wakeup file descriptor, not in the handler: a
handler runs only when the main thread next executes Python, which a long operator in C
delays, and the grace must count from the signal itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)


def _leave_now(code: int, reason: str) -> None:
    sys.stderr.write(f"fabric_model worker: exiting ({code}): {reason}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LeaveNotice:
    """Whether this worker was told to leave, and by which signal. ``holds_state`` is set once
    the worker entered a generation: from then on it leaves at a step boundary."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        #: Whether a signal came (``signal_name`` is set first): read every step, a plain attribute.
        self.requested = False
        self.received = 0.0
        self.holds_state = False
        self.grace = 0.0
        self._numbers: set[int] = set()
        self._lock = threading.Lock()

    def install(self, signals: tuple[str, ...], grace: float) -> None:
        """Catch ``signals`` from now on (the main thread only; called again when the job brings
        the driver's settings, which replace the worker's own)."""
        self.grace = grace
        numbers = {int(getattr(signal, name)) for name in signals}
        for number in self._numbers - numbers:
            signal.signal(number, signal.SIG_DFL)
        for number in numbers:
            signal.signal(number, self._on_signal)
        if not self._numbers:
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read,), name="fabric-notice", daemon=True).start()
        self._numbers = numbers

    def _on_signal(self, number: int, frame: object) -> None:
        """The Python-level handler: the watcher thread has acted already (it reads the same signal)."""

    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            for number in data:
                if number in self._numbers:
                    self.notify(signal.Signals(number).name)

    def notify(self, name: str) -> None:
        """Told to leave by ``name``: at once when nothing is held, else after the current step,
        within the grace."""
        with self._lock:
            if self.requested:
                return
            self.signal_name, self.received = name, time.monotonic()
            self.requested = True
        if not self.holds_state:
            _leave_now(0, f"{name}: leaving (it held no state yet)")
        log.warning("%s: leaving after the current step (grace %.0f s)", name, self.grace)
        threading.Thread(target=self._grace_ends, args=(name,), name="fabric-grace", daemon=True).start()

    def _grace_ends(self, name: str) -> None:
        time.sleep(self.grace)
        # Not finished within the grace: leave as the signal would have ended the process.
        number = int(getattr(signal, name))
        _leave_now(128 + number, f"{name}: the step did not end within {self.grace:.0f} s (FABRIC_MODEL_PREEMPT_GRACE)")
