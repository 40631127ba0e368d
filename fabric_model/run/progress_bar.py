"""The default driver display (a leaf module: no torch; tqdm only).

tqdm rather than rich: it is one small dependency-free package that torch users already have,
it reads the terminal's width on every redraw, and its ``write`` prints a line above the bar
without breaking it (the console log handler uses it). rich comes with Keras but not torch.

``verbose=1``: on a terminal, one bar for the whole run (elapsed, ETA, samples/s, workers)
and a line per epoch; elsewhere (a pipe, a log file) no ``\\r`` at all, a plain line every
``PLAIN_INTERVAL`` seconds instead. ``verbose=2``: the epoch lines only. ``verbose=0``: nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from .status import short_reason

#: Seconds between the plain progress lines written when the stream is not a terminal.
PLAIN_INTERVAL = 10.0
#: The bar's text (metrics, rate) is remade at most this often (seconds), as tqdm redraws.
BAR_TEXT_INTERVAL = 0.1
_BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ProgressBar:
    """The default driver logger: progress, epoch lines and notes on ``stream`` (stderr).

    The rate counts from the first step this process saw, so neither start-up nor a resume's
    set-up (steps done earlier) inflate or deflate it.
    """

    def __init__(
        self, epochs: int, steps_per_epoch: int, global_batch: int, stream: TextIO | None = None, verbose: int = 1
    ) -> None:
        self.epochs, self.steps_per_epoch, self.global_batch = epochs, steps_per_epoch, global_batch
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._start: tuple[float, int] | None = None
        self._last_plain = 0.0
        self._bar_text = 0.0  # time.monotonic() the bar's text was last remade
        self.workers = 0

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    def write(self, line: str) -> None:
        """A line of its own, above the bar when there is one."""
        tqdm.write(line, file=self.stream)
        self.stream.flush()

    def _rate(self, now: float, iteration: int) -> float | None:
        assert self._start is not None
        t0, i0 = self._start
        return (iteration - i0) * self.global_batch / (now - t0) if iteration > i0 and now > t0 else None

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        now, self.workers = time.monotonic(), workers
        if self._start is None:
            self._start = (now, iteration)
        # Called for every committed step, on the cores the workers compute on: the text is
        # made only when something shows it (the bar's redraw, a plain line, the epoch's line).
        shown = iteration == (epoch + 1) * self.steps_per_epoch or iteration == self.total  # a line of its own
        if self._bar is not None:
            shown = shown or now - self._bar_text >= BAR_TEXT_INTERVAL
        elif not (self.tty and self.verbose == 1):  # plain lines (no bar will be made)
            shown = shown or (self.verbose == 1 and now - self._last_plain >= PLAIN_INTERVAL)
        else:
            shown = True  # the bar is made now
        if not shown:
            if self._bar is not None:
                self._bar.update(iteration - self._bar.n)
            return
        self._bar_text = now
        rate = self._rate(now, iteration)
        values = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        speed = f"{rate:,.0f} samples/s" if rate is not None else "- samples/s"
        # What matters most first: a narrow terminal cuts the bar's line from the right.
        postfix = ", ".join([f"workers={workers}", speed, *(f"{k}={v:.4g}" for k, v in metrics.items())])
        if self._bar is None and self.tty and self.verbose == 1:
            self._bar = tqdm(
                total=self.total,
                initial=iteration,
                file=self.stream,
                dynamic_ncols=True,
                bar_format=_BAR_FORMAT,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                postfix=postfix,
            )
        if self._bar is not None:
            self._bar.set_description_str(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(iteration - self._bar.n)
        elif self.verbose == 1 and (now - self._last_plain >= PLAIN_INTERVAL or iteration == self.total):
            self._last_plain = now
            left = (self.total - iteration) * self.global_batch / rate if rate else None
            eta = _clock(left) if left is not None else "?"
            self.write(
                f"epoch {epoch + 1}/{self.epochs} step {iteration - epoch * self.steps_per_epoch}/"
                f"{self.steps_per_epoch} ({100 * iteration // self.total}%) {values} {speed} workers={workers} "
                f"elapsed {_clock(now - self._start[0])} eta {eta}"
            )
        if iteration == (epoch + 1) * self.steps_per_epoch and self.verbose >= 1:
            self.write(f"epoch {epoch + 1}/{self.epochs}: {values} ({speed}, workers={workers})")

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        if self.verbose >= 1:
            values = " ".join(f"val_{k}={v:.4f}" for k, v in metrics.items())
            self.write(f"epoch {epoch + 1}/{self.epochs} validation: {values}")

    def on_generation(self, record: dict[str, Any]) -> None:
        """One short line per generation change (the log file has the full reason)."""
        self.workers = len(record["members"])
        if self.verbose >= 1:
            reason = "" if record["reason"] == "start" else f" ({short_reason(record['reason'])})"
            self.write(f"generation {record['generation']}: {self.workers} worker(s){reason}")

    def note(self, line: str) -> None:
        """A line of its own under the bar (what happened after training, say)."""
        if self.verbose >= 1:
            self.write(line)

    def on_train_end(self) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
