"""The default driver display: a bar for the epoch, one line per epoch (a leaf module).

``verbose=1``: on a terminal, a status line redrawn in place (the epoch, a bar and the steps
of *this* epoch, the ETA of the run, the running averages, the live worker count, samples/s)
and one line per finished epoch, in order, with its validation and a ``✓`` (``*`` where the
stream is not UTF-8) when its checkpoint was written; elsewhere (a pipe, a log file) no
``\\r`` at all, a plain progress line every ``PLAIN_INTERVAL`` seconds instead.
``verbose=2``: the epoch lines only. ``verbose=0``: nothing. Every line fits the width
(:mod:`.screen`), dropping fields in the order of :data:`BAR_FIELDS` and :data:`EPOCH_FIELDS`;
the rest of what happens is in ``logs/driver.log`` (docs/training.md, "The screen").
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from . import screen
from .screen import Bar, Field
from .status import name_hosts, short_reason

#: Seconds between the plain progress lines written when the stream is not a terminal.
PLAIN_INTERVAL = 10.0
#: The status line is redrawn at most this often (seconds).
BAR_TEXT_INTERVAL = 0.1
#: Ends the line of an epoch whose checkpoint is on disk.
CHECKPOINT_MARK = "✓"
#: An epoch's line waits at most this long for its checkpoint (seconds), then goes out unmarked.
MARK_WAIT = 1.0
#: The bar's fields, most important first (the last is dropped first when the width is short).
BAR_FIELDS = ("epoch", "steps of the epoch", "loss", "eta", "metrics", "workers", "bar", "samples/s")
#: The epoch line's fields, most important first.
EPOCH_FIELDS = (
    *("epoch", "loss", "val_loss", "val_ metrics", "metrics"),
    *("checkpoint mark", "workers", "time", "samples/s"),
)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _priority(name: str, order: tuple[str, ...]) -> int:
    return order.index(name)


@dataclasses.dataclass(frozen=True)
class _Step:
    """A committed step as the display shows it."""

    metrics: dict[str, float]
    iteration: int
    epoch: int
    done: int  # steps of this epoch
    workers: int
    rate: float | None  # samples/s

    @property
    def speed(self) -> str:
        return f"{self.rate:,.0f} samples/s" if self.rate is not None else "- samples/s"


@dataclasses.dataclass
class _Epoch:
    """A finished epoch's line, held until its validation and checkpoint are known."""

    epoch: int
    train: dict[str, float]
    seconds: float
    speed: str
    workers: int
    ended: float  # time.monotonic() at its last step
    val: dict[str, float] | None = None
    saved: bool = False


class ProgressBar:
    """The default driver logger: progress, epoch lines and notes on ``stream`` (stderr).

    ``validates(epoch)`` and ``saves(epoch)`` say whether an epoch ends with a validation and
    a checkpoint: its line waits for them, at most until the next epoch's training ends (a
    late checkpoint is then said in ``logs/driver.log`` only). The rate counts from the first
    step this process saw, so neither start-up nor a resume's set-up inflate or deflate it.
    """

    def __init__(
        self,
        epochs: int,
        steps_per_epoch: int,
        global_batch: int,
        stream: TextIO | None = None,
        verbose: int = 1,
        validates: Callable[[int], bool] | None = None,
        saves: Callable[[int], bool] | None = None,
    ) -> None:
        self.epochs, self.steps_per_epoch, self.global_batch = epochs, steps_per_epoch, global_batch
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        self.validates = validates or (lambda epoch: False)
        self.saves = saves or (lambda epoch: False)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.unicode = screen.unicode_ok(self.stream)
        self._status: screen.StatusLine | None = None
        self._start: tuple[float, int] | None = None
        self._epoch_start: dict[int, float] = {}
        self._last_plain = 0.0
        self._bar_text = 0.0  # time.monotonic() the status line was last drawn
        self._pending: dict[int, _Epoch] = {}
        self._early_saved: set[int] = set()  # checkpoints recorded before their epoch's last step
        self._printed = -1  # the newest epoch whose line was printed
        self._created = time.monotonic()
        self._closed = False
        self.workers = 0

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    def write(self, line: str) -> None:
        """A line of its own, fitted to the width, above the status line when there is one."""
        if not self._closed:
            screen.write_line(screen.fit([Field(line)], screen.width_of(self.stream)), self.stream)

    def _rate(self, now: float, iteration: int) -> float | None:
        assert self._start is not None
        t0, i0 = self._start
        return (iteration - i0) * self.global_batch / (now - t0) if iteration > i0 and now > t0 else None

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        if self._closed:
            return
        now, self.workers = time.monotonic(), workers
        if self._start is None:
            self._start = (now, iteration)
        self._epoch_start.setdefault(epoch, now)
        rate = self._rate(now, iteration)
        step = _Step(metrics, iteration, epoch, iteration - epoch * self.steps_per_epoch, workers, rate)
        ends_epoch = step.done == self.steps_per_epoch
        if ends_epoch:
            seconds = now - self._epoch_start.pop(epoch, now)
            self._pending[epoch] = _Epoch(epoch, dict(metrics), seconds, step.speed, workers, now)
        # Called for every committed step, on the cores the workers compute on: text is made only
        # when something shows it (a redraw, a plain line, the epoch's line).
        if self.verbose == 1 and self.tty:
            if ends_epoch or now - self._bar_text >= BAR_TEXT_INTERVAL:
                self._bar_text = now
                self._draw(step)
        elif self.verbose == 1 and (now - self._last_plain >= PLAIN_INTERVAL and not ends_epoch):
            self._last_plain = now
            self._plain(step, now)
        if ends_epoch:
            self._flush()

    def _eta(self, iteration: int, rate: float | None) -> str:
        left = (self.total - iteration) * self.global_batch / rate if rate else None
        return _clock(left) if left is not None else "?"

    @staticmethod
    def _fields(metrics: dict[str, float], order: tuple[str, ...], prefix: str = "") -> list[Field]:
        """``name=value`` fields, the loss's priority apart from the other metrics'."""
        loss, rest = _priority(f"{prefix}loss", order), _priority(f"{prefix}{' ' if prefix else ''}metrics", order)
        return [Field(f"{prefix}{k}={v:.4f}", loss if k == "loss" else rest) for k, v in metrics.items()]

    def _draw(self, step: _Step) -> None:
        order = BAR_FIELDS
        fields: list[Field | Bar] = [
            Field(f"epoch {step.epoch + 1}/{self.epochs}", 0),
            Bar(step.done / self.steps_per_epoch, _priority("bar", order)),
            Field(f"{step.done}/{self.steps_per_epoch}", _priority("steps of the epoch", order)),
            Field(f"eta {self._eta(step.iteration, step.rate)}", _priority("eta", order)),
            *self._fields(step.metrics, order),
            Field(f"workers={step.workers}", _priority("workers", order)),
            Field(step.speed, _priority("samples/s", order)),
        ]
        if self._status is None:
            self._status = screen.StatusLine(self.stream)
            screen.activate(self._status)
        self._status.show(screen.fit(fields, screen.width_of(self.stream) - 1, self.unicode))

    def _plain(self, step: _Step, now: float) -> None:
        assert self._start is not None
        order = BAR_FIELDS
        fields = [
            Field(f"epoch {step.epoch + 1}/{self.epochs} step {step.done}/{self.steps_per_epoch}", 0),
            *self._fields(step.metrics, order),
            Field(f"workers={step.workers}", _priority("workers", order)),
            Field(step.speed, _priority("samples/s", order)),
            Field(f"elapsed {_clock(now - self._start[0])}", len(order)),
            Field(f"eta {self._eta(step.iteration, step.rate)}", _priority("eta", order)),
        ]
        screen.write_line(screen.fit(fields, screen.width_of(self.stream)), self.stream)

    # -- the epoch lines ------------------------------------------------------------------
    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        # The ledger passes a validation on after its epoch's last step (driver/ledger.py).
        if self._closed:
            return
        pending = self._pending.get(epoch)
        if pending is not None:
            pending.val = dict(metrics)
            self._flush()
        elif self.verbose >= 1:  # its line is out already (a resume's first epoch): a line of its own
            fields = [Field(f"epoch {epoch + 1}/{self.epochs}:", 0), *self._fields(metrics, EPOCH_FIELDS, "val_")]
            screen.write_line(screen.fit(fields, screen.width_of(self.stream)), self.stream)

    def on_checkpoint(self, epoch: int, name: str) -> None:
        """The checkpoint after ``epoch`` is on disk: its line gets the mark."""
        if not self._closed and epoch > self._printed:
            self._early_saved.add(epoch)
            self._flush()

    def _flush(self, final: bool = False) -> None:
        """Print, in order, the held epoch lines that are complete. A line whose checkpoint is
        late goes out without its mark after ``MARK_WAIT`` seconds or once a later epoch's line is
        complete; ``final`` prints them all."""
        now = time.monotonic()
        for epoch in sorted(self._pending):
            line = self._pending[epoch]
            line.saved = line.saved or epoch in self._early_saved
            if not (final or self._complete(line)):
                validated = line.val is not None or not self.validates(epoch)
                later = any(self._complete(self._pending[e]) for e in self._pending if e > epoch)
                if not (later or (validated and now - line.ended >= MARK_WAIT) or now - line.ended >= 10 * MARK_WAIT):
                    break
            del self._pending[epoch]
            self._early_saved.discard(epoch)
            self._printed = max(self._printed, epoch)
            if self.verbose >= 1:
                screen.write_line(self._epoch_line(line), self.stream)

    def _complete(self, line: _Epoch) -> bool:
        val = line.val is not None or not self.validates(line.epoch)
        saved = line.saved or line.epoch in self._early_saved or not self.saves(line.epoch)
        return val and saved

    def _epoch_line(self, line: _Epoch) -> str:
        order = EPOCH_FIELDS
        fields = [Field(f"epoch {line.epoch + 1}/{self.epochs}:", 0), *self._fields(line.train, order)]
        if line.val is not None:
            fields += self._fields(line.val, order, "val_")
        fields += [
            Field(f"{line.seconds:.1f}s", _priority("time", order)),
            Field(line.speed, _priority("samples/s", order)),
            Field(f"workers={line.workers}", _priority("workers", order)),
        ]
        if line.saved:
            fields.append(Field(CHECKPOINT_MARK if self.unicode else "*", _priority("checkpoint mark", order)))
        return screen.fit(fields, screen.width_of(self.stream))

    # -- other lines ----------------------------------------------------------------------
    def on_generation(self, record: dict[str, Any]) -> None:
        """One short line when the workers change (the log file has the full reason)."""
        self.workers = len(record["members"])
        if self.verbose < 1 or self._closed:
            return
        if record["reason"] == "start":
            took = time.monotonic() - self._created
            self.write(f"{screen.count(self.workers, 'worker')} training (started in {took:.1f} s)")
        else:
            self._flush(final=True)  # the epochs before the change stay above its line
            reason = short_reason(record["reason"])
            if record.get("hosts"):  # on several hosts: which ("worker 3 on 10.0.0.7 joins")
                reason = name_hosts(reason, record["hosts"])
            self.write(f"now {screen.count(self.workers, 'worker')} ({reason})")

    def note(self, line: str) -> None:
        """A line of its own under the epoch lines (what happened after training, say)."""
        if self.verbose >= 1 and not self._closed:
            self._flush(final=True)
            self.write(line)

    def on_train_end(self) -> None:
        self.close()

    def close(self) -> None:
        """Print the held epoch lines and take the status line away; nothing is drawn after."""
        if self._closed:
            return
        self._flush(final=True)
        self.interrupt()

    def interrupt(self) -> None:
        """Stop drawing at once (Ctrl-C): the status line is erased, held lines are dropped."""
        self._closed = True
        self._pending.clear()
        if self._status is not None:
            self._status.clear()
            screen.activate(None)
            self._status = None
