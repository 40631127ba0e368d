"""The worker's side of the control channel: a reader thread and a heartbeat thread.

When the control connection drops without a :class:`~fabric_model.transport.protocol.Stop`, a
worker that holds the training state gives up its generation and waits, bounded, for the
driver to come back (worker/reattach.py); any other exits at once. Two driver messages are
not queued but recorded as flags the training loop polls: :class:`~fabric_model.transport.protocol.JoinPending`
(read at step boundaries, voted on inside the step's allreduce) and
:class:`~fabric_model.transport.protocol.Abort` (checked between micro-batches and between the wait
slices of a collective). See docs/architecture.md, "Elasticity".
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..transport import protocol as p
from ..transport.control import Channel
from .reattach import DriverWait, LossyChannel

M = TypeVar("M")

#: Exit codes: the driver turned this worker away (a refused join, a removed worker fenced out),
#: or the control connection dropped.
REFUSED_EXIT, LOST_EXIT = 4, 3
#: A step report goes out at once when the channel sent nothing for this long (seconds), else
#: with the next frame: the driver is woken once per ~0.1 s of fast steps, not once a step.
REPORT_WITHIN = 0.1
#: Above any generation: while the driver is away, every collective gives up.
ABORT_ALL = 1 << 62
#: ``expect`` waits in slices this long (seconds), to see whether the driver went away meanwhile.
EXPECT_SLICE = 0.5


class TrainingHalted(Exception):
    """The driver asked for this worker's state before the schedule's end, in place of a next
    generation: replicas diverged (docs/architecture.md, "Replica checks"), the driver was
    preempted, or a restarted driver runs a changed job. Its argument: the
    :class:`~fabric_model.transport.protocol.SendFinalState`."""


#: Run before the process ends from the inbox's thread (``os._exit`` runs no ``finally`` or ``atexit``).
_AT_EXIT: list[Callable[[], None]] = []


def at_exit(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the inbox ends the process (a Stop, a lost driver)."""
    _AT_EXIT.append(fn)


def _exit(code: int, reason: str) -> None:
    """End the process now, saying why on its console (a hand-started worker's user reads it)."""
    for fn in _AT_EXIT:
        try:
            fn()
        except Exception:  # the process ends anyway: a clean-up that fails must not stop it
            pass
    if reason:
        sys.stderr.write(f"fabric_model worker: exiting ({code}): {reason}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_again(why: str) -> None:
    """A worker started by hand whose job a restarted driver replaced: run this command line anew
    (a fresh process, which joins the driver as a new worker with the new job), as its user
    would have; on failure it exits as any stopped worker does."""
    for fn in _AT_EXIT:
        try:
            fn()
        except Exception:
            pass
    sys.stderr.write(f"fabric_model worker: {why}; starting again as a new worker of the restarted driver\n")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, "-m", "fabric_model", *sys.argv[1:]])
    except OSError as exc:
        sys.stderr.write(f"fabric_model worker: cannot start again ({exc})\n")


class Inbox:
    """Reads the driver's messages on a thread; :class:`~fabric_model.transport.protocol.Stop`
    ends the process, and so does a closed link unless :attr:`driver_wait` takes the worker to
    a driver that comes back."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._messages: queue.Queue[Any] = queue.Queue()
        self.pending_generation = -1  # written by the reader thread only
        self.abort_generation = -1  # likewise: collectives of this generation and older give up
        self.stop_together: str | None = None  # likewise: the signal the job was told to go by (p.StopTogether)
        #: Set once the job has arrived: how to wait for a vanished driver (worker/reattach.py).
        self.driver_wait: DriverWait | None = None
        self.away = threading.Event()  # the driver vanished and has not come back yet
        self.parked = threading.Event()  # the training thread waits in expect()
        #: Called with a checkpoint's unit once the driver wrote it (p.Written): rank 0's uploader.
        self.on_written: Callable[[int], None] = lambda unit: None
        threading.Thread(target=self._run, name="fabric-inbox", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                while True:
                    message = self.channel.recv()
                    if isinstance(message, p.Stop):
                        if message.rejoin:
                            _start_again(message.ended)
                        ended = f"the job ended ({message.ended}); nothing left to train for" if message.ended else ""
                        _exit(REFUSED_EXIT if message.reason else 0, message.reason or ended)
                    elif isinstance(message, p.JoinPending):
                        self.pending_generation = max(self.pending_generation, message.generation)
                    elif isinstance(message, p.Abort):
                        self.abort_generation = max(self.abort_generation, message.generation)
                    elif isinstance(message, p.StopTogether):
                        self.stop_together = message.signal_name
                    elif isinstance(message, p.Written):
                        self.on_written(message.unit)
                    else:
                        self._messages.put(message)
            except (EOFError, OSError) as exc:
                if not self._wait_for_driver():
                    why = type(exc).__name__
                    _exit(LOST_EXIT, f"lost the connection to the driver ({why}); nothing left to train for")

    def _wait_for_driver(self) -> bool:
        """The driver vanished: give up the generation and wait for it (worker/reattach.py);
        whether it came back."""
        wait, channel = self.driver_wait, self.channel
        if wait is None or wait.wait <= 0 or not isinstance(channel, LossyChannel):
            return False
        self.away.set()
        self.abort_generation = ABORT_ALL  # every collective gives up: the step under way is undone
        channel.detach()
        while True:  # what the vanished driver sent and nobody read is void
            try:
                self._messages.get_nowait()
            except queue.Empty:
                break
        held = wait(channel, self.parked)
        if held is None:
            return False
        # The generations it was in stay given up; the new driver's next one is above them.
        self.pending_generation, self.abort_generation = held.generation, held.generation
        self.away.clear()
        return True

    def expect(self, kind: type[M], timeout: float) -> M:
        """The driver's next queued message, which must be a ``kind``; ``TimeoutError`` after
        ``timeout`` s, not counting time the driver was away. A
        :class:`~fabric_model.transport.protocol.SendFinalState` where another message was
        expected raises :class:`TrainingHalted`."""
        deadline = time.monotonic() + timeout
        self.parked.set()
        try:
            while True:
                try:
                    message = self._messages.get(timeout=min(EXPECT_SLICE, max(0.0, deadline - time.monotonic())))
                    break
                except queue.Empty:
                    if self.away.is_set():
                        deadline += EXPECT_SLICE  # waiting for the driver to come back is no timeout
                    elif time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"no {kind.__name__} message from the driver within {timeout:.0f} s"
                        ) from None
        finally:
            self.parked.clear()
        if isinstance(message, p.SendFinalState) and kind is not p.SendFinalState:
            raise TrainingHalted(message)
        if not isinstance(message, kind):
            raise RuntimeError(f"expected {kind.__name__} from the driver, received {type(message).__name__}")
        return message

    def aborted(self, generation: int) -> bool:
        """Whether the driver told the members of ``generation`` to give up its collectives."""
        return self.abort_generation >= generation


class Heartbeat:
    """Tells the driver this process is alive, from a thread (a frozen process goes silent),
    and sends the step reports held back longer than ``REPORT_WITHIN`` when the training loop
    sends nothing (a long validation, a wait in a collective).

    The interval can change once the job arrives with the driver's heartbeat bound."""

    def __init__(self, channel: Channel, interval: float) -> None:
        self.channel, self.interval = channel, interval
        threading.Thread(target=self._run, name="fabric-heartbeat", daemon=True).start()

    def _run(self) -> None:
        beat = time.monotonic()
        while True:
            # Asleep until the next beat unless reports are held: no wake-ups while none are
            # (a generation of several, slow steps).
            if self.channel.holding.wait(max(0.0, beat + self.interval - time.monotonic())):
                time.sleep(REPORT_WITHIN)
            try:
                if time.monotonic() - beat >= self.interval:
                    self.channel.send(p.Heartbeat())  # sends the held reports first
                    beat = time.monotonic()
                else:
                    self.channel.flush(older_than=REPORT_WITHIN)
            except (OSError, EOFError):
                return
