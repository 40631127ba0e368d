"""Step reports sent together on short steps (docs/architecture.md, "The step").

A ``StepDone`` a step costs the driver two thread wake-ups, an unpickle and a commit; on a
2 ms step, with the driver sharing the workers' cores, that is a few percent of the run.
:class:`ReportingChannel` holds a worker's reports and sends them as one ``StepsDone`` once
``interval`` seconds have passed since its last send (a thread sends them then), so the
driver wakes a few tens of times a second whatever the step time. Long steps are reported
one by one, as before.

Nothing is weakened: the driver commits each report of the batch as it would a lone one, and
every other message this worker sends (``LeftGeneration``, ``EvalDone``, a ``StateChunk``,
...) goes out after the reports held before it, so the driver sees the same order. The first
report of a generation goes at once (the driver's recovery and join figures count from it).
A worker killed while holding reports loses them as it would lose a report in its socket:
the steps whose allreduce completed are settled by the survivors (``Progress.settle``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import protocol as p
from ..control import Channel

#: Longest a report waits for company (seconds): well under the heartbeat and recovery bounds.
REPORT_INTERVAL = 0.05


class ReportingChannel:
    """A worker's channel that batches its ``StepDone`` reports; ``send`` flushes them first.

    A thread sends what is held once ``interval`` has passed since the last send, so a
    report waits at most that long even when the next step is slow or never comes (a worker
    held in a callback, a validation, a hang)."""

    def __init__(self, channel: Channel, interval: float = REPORT_INTERVAL) -> None:
        self._channel = channel
        self._interval = interval
        self._held: list[p.StepDone] = []
        self._sent = 0.0
        self._generation = -1
        self._lock = threading.Condition()  # the flusher and the snapshot uploader send from their threads
        threading.Thread(target=self._flush_when_due, name="fabric-reports", daemon=True).start()

    def report(self, message: p.StepDone) -> None:
        """Send ``message`` with the next ones, within ``interval``; a generation's first at once."""
        with self._lock:
            self._held.append(message)
            if message.generation != self._generation or self._interval <= 0:
                self._generation = message.generation
                self._send_held()
            elif len(self._held) == 1:
                self._lock.notify()

    def send(self, message: Any) -> None:
        """Send ``message`` after the reports held so far."""
        with self._lock:
            self._send_held()
            self._channel.send(message)

    def flush(self) -> None:
        """Send the reports held so far (the end of training: ``Finished`` goes on the raw channel).

        A connection already lost is no error here: the inbox thread ends the worker then."""
        with self._lock:
            try:
                self._send_held()
            except (OSError, EOFError):
                pass

    def _flush_when_due(self) -> None:
        with self._lock:
            while True:
                if not self._held:
                    self._lock.wait()
                    continue
                wait = self._sent + self._interval - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                try:
                    self._send_held()
                except (OSError, EOFError):
                    return  # the connection is gone: the inbox thread ends the worker

    def _send_held(self) -> None:
        held, self._held = self._held, []
        self._sent = time.monotonic()
        if len(held) == 1:
            self._channel.send(held[0])
        elif held:
            self._channel.send(p.StepsDone(tuple(held)))
