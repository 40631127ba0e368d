"""What the library's own log messages look like during ``train()`` (a leaf module).

Two handlers on the ``fabric_model`` logger while a run lasts: ``logs/driver.log`` in the run
directory gets every message in full, always; the screen gets a short form (the first line, at
most ``SCREEN_WIDTH`` characters, a warning's cut to the terminal's width: a lost worker's
reason can carry pages of gloo internals), printed above the progress bar, but only when
``verbose >= 1`` and the user has configured no logging of their own (a handler on the root or
the ``fabric_model`` logger), so nothing is printed twice.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from . import screen

LOGGER = "fabric_model"
#: The most characters of a message shown on screen (the log file has the rest).
SCREEN_WIDTH = 160


#: Messages the progress display says in its own short line per generation (``on_generation``):
#: on screen they would repeat it with an error's internals (gloo's file and line, the peer's port).
SAID_BY_THE_DISPLAY = (
    "generation %d ending: %s",
    "worker %d lost: %s",
    "generation %d: %d worker(s) %s on %s, resuming at unit %d (%s)",
    "checkpoint %s %s (%.3f s)",  # the epoch's line gets a mark (state/writer.py)
    "training stopped by a callback after epoch %d",  # a note of the display's
    "training stopped by stop_training() after step %d",  # likewise
    # A preemption: the display's last line says where it stopped and how to resume.
    "%s: stopping training and saving the newest state (FABRIC_MODEL_PREEMPT_GRACE %.0f s)",
    "%s: saved %s in %.2f s",
    "worker %d sent no state (it may have left on a notice of its own); asking the next",
)


#: Messages for the log file only: how the start-up went is in ``run.json`` and ``driver.log``
#: (``fabric-model status`` and the start-up record read them), not a line on every run's screen.
LOG_FILE_ONLY = (
    "local workers fork from the warm process: %s",
    # Which states a halt or a preemption could fall back on (driver/book.py, driver/driver.py).
    "%s from worker %d: %d bytes (generation %d)",
    "the newest state held: %s",
    "worker %d's state is at %s, below the last committed step; looking for a newer one",
)


class ScreenHandler(logging.Handler):
    """One short line per message on stderr, fitted to its width, above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg in SAID_BY_THE_DISPLAY or record.msg in LOG_FILE_ONLY:
            return
        try:
            # The first line, its indentation kept (a table's rows: the profile's summary).
            message = record.getMessage().lstrip("\n").rstrip()
            text = message.splitlines()[0].rstrip() if message else ""
            prefix = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
            # A warning's first line can hold an error's internals: cut to the terminal. Our
            # own information lines are short but may hold a path, which a cut would spoil.
            width = SCREEN_WIDTH if record.levelno <= logging.INFO else min(SCREEN_WIDTH, screen.width_of(sys.stderr))
            screen.write_line(screen.fit([screen.Field(f"[fabric-model] {prefix}{text}")], width), sys.stderr)
        except Exception:  # a display problem must never stop training
            self.handleError(record)


def user_configured_logging() -> bool:
    """Whether the user set up logging (a handler on the root or on our logger)."""
    return bool(logging.getLogger().handlers or logging.getLogger(LOGGER).handlers)


class _Propagate(logging.Handler):
    """Passes on to the root's handlers what our logger would have passed at the user's level.

    The log file wants INFO whatever the user's level, so the logger is lowered to INFO while a
    run lasts; the user's own handlers must not see more for it, so propagation goes through here.
    """

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


def attach(verbose: int, log_file: Path | None) -> Callable[[], None]:
    """Add the run's handlers; returns the function that removes them (and restores the logger)."""
    logger = logging.getLogger(LOGGER)
    level, propagate, handlers = logger.level, logger.propagate, list[logging.Handler]()
    user = user_configured_logging()
    if verbose >= 1 and not user:
        handlers.append(ScreenHandler(logging.INFO))
    elif propagate and user:  # the user's handlers get what they got before, no more
        handlers.append(_Propagate(logger.getEffectiveLevel()))
    # Our handlers decide what is shown: without them (verbose=0, no logging of the user's) Python's
    # last-resort handler would still print warnings; the log file has every message.
    logger.propagate = False
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    for handler in handlers:
        logger.addHandler(handler)

    def detach() -> None:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(level)
        logger.propagate = propagate

    return detach
