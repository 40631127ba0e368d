"""The driver's background threads, each failure of which is reported once (a leaf module: no torch).

The driver writes checkpoints (state/writer.py) and the newest snapshot (state/durable.py) on
threads of their own. An exception there would end the thread with Python's bare traceback on
stderr, in the middle of the progress display, and the run would go on without the guarantee
the thread kept. Each such thread runs under :meth:`BackgroundFailures.thread` instead: a
failure is one warning, whose first line the screen shows (what failed, why, what the run goes
on without) and whose traceback ``logs/driver.log`` keeps (run/console.py); then the owner's
``on_failure``, so that nothing waits for the dead thread; and, once the driver calls
:meth:`BackgroundFailures.record` on its own thread, an entry in ``run.json``'s
``background_failures`` (docs/run-directory.md).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rundir import RunDirectory

log = logging.getLogger(__name__)

#: The most characters of an error's first line that the line and the record keep.
ERROR_CHARS = 300


@dataclasses.dataclass(frozen=True)
class BackgroundFailure:
    """One thread's failure, as its warning and ``run.json`` say it."""

    thread: str  # what failed: "the durable snapshot writer"
    error: str  # the exception's type and the first line of its message
    cost: str  # what the run goes on without
    time: str  # when, ISO 8601, UTC

    @property
    def line(self) -> str:
        # The error last: the screen cuts a warning to the terminal's width, and its internals matter least.
        return f"{self.thread} failed: {self.cost} ({self.error})"


class BackgroundFailures:
    """Starts background threads and reports each one's failure once.

    Args:
        run_dir: whose ``run.json`` :meth:`record` adds the failures to; None (:data:`LOGGED`,
            what an owner given none uses): logged only.
    """

    def __init__(self, run_dir: RunDirectory | None = None) -> None:
        self.run_dir = run_dir
        self.failures: list[BackgroundFailure] = []  # every failure reported, in order
        self._pending: list[BackgroundFailure] = []  # those not yet in run.json
        self._lock = threading.Lock()

    def thread(
        self,
        target: Callable[[], None],
        *,
        name: str,
        what: str,
        cost: str,
        on_failure: Callable[[], None] | None = None,
    ) -> threading.Thread:
        """A started daemon thread running ``target()``. An exception ends it: reported as ``what``
        failed, costing ``cost`` (:meth:`report`), then ``on_failure()`` is called on it (the owner
        stops taking work and waiting for the thread)."""

        def run() -> None:
            try:
                target()
            except Exception as exc:  # reported here, not by threading.excepthook's bare traceback
                self.report(what, cost, exc)
                if on_failure is not None:
                    on_failure()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def report(self, what: str, cost: str, exc: BaseException) -> BackgroundFailure:
        """One warning: its message one line (the screen shows it), its traceback for the log file."""
        lines = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        failure = BackgroundFailure(what, error[:ERROR_CHARS], cost, when)
        log.warning("%s", failure.line, exc_info=exc)
        with self._lock:
            self.failures.append(failure)
            if self.run_dir is not None:
                self._pending.append(failure)
        return failure

    def record(self) -> None:
        """Add the failures reported since the last call to ``run.json`` (best effort). Called on the
        driver's thread, where ``run.json``'s other writers run: a write from the failing thread
        could interleave with theirs and lose one of the two updates."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending and self.run_dir is not None:
            self.run_dir.record_background_failures([dataclasses.asdict(f) for f in pending])


#: What an owner given no :class:`BackgroundFailures` reports to: the warning, no ``run.json``.
LOGGED = BackgroundFailures()
