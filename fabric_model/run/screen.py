"""The terminal under the progress display: lines fitted to a width, one live status line.

A line is made of fields, each dropped whole, lowest priority first, until the line fits the
width: a number is never cut and a line never wraps (docs/architecture.md, "Display"). On a
terminal the progress bar is a status line redrawn in place; every other line goes through
:func:`write_line`, which erases the status line, prints, and draws it again, so a log line
neither breaks the bar nor leaves a stale copy of it. A leaf module.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

#: The width assumed where none can be read (a pipe with no ``COLUMNS``).
DEFAULT_WIDTH = 80
_ERASE = "\r\x1b[K"
_EIGHTHS = " ▏▎▍▌▋▊▉"


@dataclasses.dataclass(frozen=True)
class Field:
    """Text shown whole or not at all; ``priority`` 0 is always kept, higher goes first."""

    text: str
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Bar:
    """The elastic field: a bar ``fraction`` full, as wide as the room left (``low``..``high``)."""

    fraction: float
    priority: int
    low: int = 8
    high: int = 30


def width_of(stream: TextIO) -> int:
    """The stream's terminal width; elsewhere ``COLUMNS`` or :data:`DEFAULT_WIDTH`. Read on
    every call: a resized terminal is followed at the next redraw."""
    try:
        if stream.isatty():
            return max(20, os.get_terminal_size(stream.fileno()).columns)
    except (AttributeError, OSError, ValueError):
        pass
    return max(20, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def draw_bar(fraction: float, width: int, unicode: bool) -> str:
    """``|████▌    |`` of ``width`` characters, the frame included."""
    inner = max(1, width - 2)
    fraction = min(1.0, max(0.0, fraction))
    if not unicode:
        full = int(fraction * inner)
        return "|" + "#" * full + " " * (inner - full) + "|"
    eighths = int(fraction * inner * 8)
    full, part = divmod(eighths, 8)
    body = "█" * full + (_EIGHTHS[part] if full < inner else "")
    return "|" + body.ljust(inner) + "|"


def fit(fields: Sequence[Field | Bar], width: int, unicode: bool = True) -> str:
    """The fields in their order, joined by spaces, the lowest-priority ones dropped until the
    line fits ``width``; a :class:`Bar` takes the room left over, or is dropped if too little.
    Only when the priority-0 fields alone are too wide is the line cut (ending in ``…``)."""
    kept = list(fields)

    def length(items: Sequence[Field | Bar]) -> int:
        texts = [f.text for f in items if isinstance(f, Field)]
        return len(" ".join(texts)) + sum(f.low + 1 for f in items if isinstance(f, Bar))

    while length(kept) > width:
        droppable = [i for i, f in enumerate(kept) if f.priority > 0]
        if not droppable:
            break
        worst = max(droppable, key=lambda i: (kept[i].priority, i))
        del kept[worst]
    texts = [f.text for f in kept if isinstance(f, Field)]
    room = width - len(" ".join(texts)) - 1
    parts = []
    for f in kept:
        if isinstance(f, Bar):
            parts.append(draw_bar(f.fraction, min(f.high, room), unicode))
        else:
            parts.append(f.text)
    line = " ".join(parts)
    return line if len(line) <= width else line[: width - 1] + "…"


class StatusLine:
    """One line redrawn in place at the bottom of a terminal, with lines printed above it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.text = ""
        self._lock = threading.Lock()

    def show(self, text: str) -> None:
        with self._lock:
            self.text = text
            self._write(_ERASE + text)

    def print_above(self, line: str) -> None:
        with self._lock:
            self._write(_ERASE + line + "\n" + self.text)

    def clear(self) -> None:
        """Erase the status line for good (the display is done, or was interrupted)."""
        with self._lock:
            if self.text:
                self._write(_ERASE)
            self.text = ""

    def _write(self, data: str) -> None:
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal must not stop training
            pass


#: The status line being shown, if any: the console log handler prints above it.
_active: StatusLine | None = None
_active_lock = threading.Lock()


def activate(status: StatusLine | None) -> None:
    global _active
    with _active_lock:
        _active = status


def write_line(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` on ``stream`` (stderr), above the status line when one is shown there."""
    stream = stream if stream is not None else sys.stderr
    status = _active
    if status is not None and status.stream is stream:
        status.print_above(line)
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def count(n: int, noun: str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def unicode_ok(stream: TextIO) -> bool:
    return "utf" in (getattr(stream, "encoding", None) or "").lower()
