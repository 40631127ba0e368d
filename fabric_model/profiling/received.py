"""The driver's side of a profile: the parts of each profiling worker's trace, written to the run
directory's ``profile/`` with the summary (docs/training.md, "Profiling").

Files: ``profile/worker-<id>.pt.trace.json`` (the torch profiler's Chrome trace, as written by
``export_chrome_trace``) and ``profile/summary.txt`` (every profile's summary, in arrival order).
The driver names the files; a worker sends bytes only, bounded by :data:`MOST_BYTES`.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

from ..transport import protocol as p
from .summary import render

log = logging.getLogger(__name__)

#: The most trace bytes taken from one worker, compressed and uncompressed: past it, the
#: trace is dropped (the summary is kept).
MOST_BYTES = 1 << 30


class ProfileInbox:
    """Collects :class:`~fabric_model.transport.protocol.ProfilePart` messages into files."""

    def __init__(self, directory: Path, shown: str | None = None) -> None:
        self.directory = directory
        self.shown = shown or str(directory)  # the folder as the screen names it
        self.summaries: list[list[str]] = []
        self._parts: dict[int, list[bytes]] = {}
        self._sizes: dict[int, int] = {}

    def part(self, worker_id: int, message: p.ProfilePart) -> None:
        """One part from ``worker_id``; the last one writes the files."""
        if message.index == 0:
            self._parts[worker_id], self._sizes[worker_id] = [], 0
        parts = self._parts.get(worker_id)
        if parts is None or len(parts) != message.index:
            log.warning("dropped a profile part from worker %d: out of order", worker_id)
            self._parts.pop(worker_id, None)
            return
        self._sizes[worker_id] += len(message.data)
        if self._sizes[worker_id] <= MOST_BYTES:
            parts.append(message.data)
        else:
            parts.append(b"")
        if message.last and message.figures is not None:
            del self._parts[worker_id]
            self._write(worker_id, b"".join(parts), message.figures)

    def _write(self, worker_id: int, compressed: bytes, figures: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"worker-{worker_id}.pt.trace.json"
        trace = _inflate(compressed)
        shown = None
        if trace:
            (self.directory / name).write_bytes(trace)
            shown = f"{self.shown}/{name}"
        lines = render(figures, shown)
        with open(self.directory / "summary.txt", "a") as f:
            f.write("\n".join(lines) + "\n\n")
        self.summaries.append(lines)
        log.debug("profile of worker %d written to %s", worker_id, self.directory)


def _inflate(data: bytes) -> bytes:
    """``data`` ungzipped, at most :data:`MOST_BYTES`; empty when it is not gzip or too large."""
    if not data:
        return b""
    try:
        inflater = zlib.decompressobj(wbits=31)  # gzip
        out = inflater.decompress(data, MOST_BYTES)
    except zlib.error:
        log.warning("a profile's trace could not be read (not gzip)")
        return b""
    if inflater.unconsumed_tail:
        log.warning("a profile's trace is over %d bytes: not written", MOST_BYTES)
        return b""
    return out
